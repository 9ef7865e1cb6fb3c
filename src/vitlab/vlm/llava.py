"""LLaVA (Liu et al., 2023, "Visual Instruction Tuning", Sec. 4.1 and Fig. 1; LLaVA-1.5: Liu et al., 2023,
"Improved Baselines with Visual Instruction Tuning", Sec. 3.1): an image tower, a projector into the language
model's token embedding, and a decoder-only language model that reads the projected image tokens in place of an
``<image>`` placeholder in the prompt.

- ``vision_tower``: any vitlab image model (default: CLIP's ViT, :mod:`vitlab.models.clip_vit`; LLaVA-1.5 uses
  CLIP ViT-L/14 at 336 px). Its tokens are taken after block ``vision_feature_layer`` in transformers' counting
  (``hidden_states[i]``: 0 is the embedded patches, i > 0 the output of block i; negatives from the end, so -2 is
  the penultimate block, LLaVA's choice: Sec. 4.1 of the first paper) -- several layers (a list) are concatenated
  along the channels. A hierarchical tower (Swin, PVT, ...) counts stages instead and gives that stage's grid.
  ``vision_feature_select_strategy='default'`` drops the [CLS] token (LLaVA's), ``'full'`` keeps it.
- ``projector``: LLaVA-1.5's two-layer MLP with GELU (``'mlp2x_gelu'``, Sec. 3.1 of the second paper) or the first
  paper's single linear map (``'linear'``).
- ``language_model``: the Llama decoder (:class:`vitlab.models.llama.Llama`, Touvron et al., 2023).

The prompt marks the image with ``image_token_id``, either once (LLaVA's own code: the placeholder is replaced by the
image's T tokens, so the sequence grows by T - 1, and ``attention_mask`` / ``labels`` grow with it, the image's
positions unscored) or T times in a row (transformers' processor expands it: the tokens are overwritten in place).
A prompt without the placeholder, or with more placeholders than the one image per prompt, is refused in one line.

transformers' ``LlavaForConditionalGeneration`` ``save_pretrained`` directories load by ``create_model(name,
checkpoint_path=DIR)`` or :meth:`LLaVA.from_pretrained` (architecture from ``config.json``); for the same weights
the logits and the greedy tokens are equal.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from vitlab.convert import (
    config_differences,
    load_state_dict,
    read_hf_config,
    read_hf_state_dict,
    read_state_dict,
    with_generation_eos,
)
from vitlab.layers import get_act_layer
from vitlab.models import (
    Llama,
    TokenModel,
    VisionTransformer,
    clip_vision_transformer,
    convert_hf_clip_vision_state_dict,
    fill_tied_head,
    hf_act,
    hf_act_pair,
    hf_clip_vision_differences,
    llama_config_from_hf,
    set_grad_checkpointing,
)
from vitlab.registry import create_model, get_model_config

HF_ARCHITECTURES = ("LlavaForConditionalGeneration", "llava")
PROJECTORS = ("mlp2x_gelu", "linear")
STRATEGIES = ("default", "full")
IGNORE_INDEX = -100


class LlavaOutput(NamedTuple):
    """``logits`` (B, N', vocab) over the merged sequence (N' = N + T - 1 where a placeholder was widened), or
    (M, vocab) at the M scored positions only (``scored_only``), and the mean next-token cross-entropy on the
    labelled tokens (None without ``labels``)."""

    logits: torch.Tensor
    loss: torch.Tensor | None


class Projector(nn.Module):
    """Image features -> language-model embeddings: ``linear_2(GELU(linear_1(x)))`` (LLaVA-1.5) or
    ``linear_1(x)`` (LLaVA). transformers' ``multi_modal_projector`` names."""

    def __init__(self, in_dim: int, out_dim: int, kind: str = "mlp2x_gelu", act_layer: str = "gelu",
                 bias: bool = True):
        super().__init__()
        if kind not in PROJECTORS:
            raise ValueError(f"unknown projector {kind!r}; choose from {list(PROJECTORS)}")
        self.linear_1 = nn.Linear(in_dim, out_dim, bias=bias)
        self.act = get_act_layer(act_layer)() if kind != "linear" else None
        self.linear_2 = nn.Linear(out_dim, out_dim, bias=bias) if kind != "linear" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear_1(x)
        return x if self.linear_2 is None else self.linear_2(self.act(x))


def _num_levels(tower: nn.Module) -> int:
    """The blocks (plain ViTs) or stages (hierarchical models) whose outputs ``forward_intermediates`` gives."""
    for name in ("blocks", "stages", "layers"):
        levels = getattr(tower, name, None)
        if isinstance(levels, (nn.ModuleList, nn.Sequential)):
            return len(levels)
    raise ValueError(f"{type(tower).__name__} has no blocks or stages to take features from")


def image_shape(tower: nn.Module) -> tuple[int, int, int]:
    """(channels, height, width) of the images an image tower takes: a plain ViT's (:class:`TokenModel`) patch
    embedding's, a hierarchical model's own ``in_chans`` and ``img_size``."""
    if isinstance(tower, TokenModel):
        return (tower.patch_embed.in_chans, *tower.patch_embed.img_size)
    return (tower.in_chans, *tower.img_size)


class LLaVA(nn.Module):
    """``vision_tower`` -> ``projector`` -> ``language_model``, the image tokens spliced in at ``image_token_id``.

    Public interface (what the caption / VQA tasks use; freeze a part by its name): ``vision_tower``,
    ``projector``, ``language_model``; :meth:`image_features`, :meth:`forward` ``(input_ids, pixel_values,
    attention_mask, labels) -> LlavaOutput(logits, loss)``, :meth:`generate` ``(input_ids, pixel_values, ...) ->
    new tokens``, ``num_image_tokens``."""

    def __init__(self, vision_tower: nn.Module, language_model: Llama, image_token_id: int,
                 projector: str = "mlp2x_gelu", projector_act: str = "gelu", projector_bias: bool = True,
                 vision_feature_layer: int | list[int] = -2, vision_feature_select_strategy: str = "default"):
        super().__init__()
        if vision_feature_select_strategy not in STRATEGIES:
            raise ValueError(f"unknown vision_feature_select_strategy {vision_feature_select_strategy!r}; choose "
                             f"from {list(STRATEGIES)}")
        self.vision_tower, self.language_model = vision_tower, language_model
        self.image_token_id, self.select_strategy = image_token_id, vision_feature_select_strategy
        layers = [vision_feature_layer] if isinstance(vision_feature_layer, int) else list(vision_feature_layer)
        n = _num_levels(vision_tower)
        bad = [i for i in layers if not (-n <= i <= n) or i == 0]
        if bad or not layers:
            raise ValueError(f"vision_feature_layer {vision_feature_layer} must name blocks 1..{n} or -1..-{n} of "
                             f"the image tower (0, the embedded patches, is not offered)")
        self.vision_feature_layer = vision_feature_layer
        self._take = self._blocks(layers)
        # the prefix tokens (CLS, distillation) in the blocks' sequence; CaiT's join after them, a hierarchical
        # tower's intermediates are its feature maps' positions only
        self._prefix = vision_tower.num_block_prefix_tokens if isinstance(vision_tower, TokenModel) else 0
        if isinstance(vision_tower, TokenModel):  # a plain ViT: one width, the patch grid (and the prefix) as tokens
            grid = vision_tower.patch_embed.grid_size
            self.num_image_tokens = grid[0] * grid[1] + (self._prefix if self.select_strategy == "full" else 0)
            width = vision_tower.num_features * len(layers)
        else:  # a hierarchical tower: its stages' widths and grids, from one image of its size
            with torch.no_grad():
                self.num_image_tokens, width = self._select(self._probe_image()).shape[1:]
        self.projector = Projector(width, language_model.config.dim, projector, projector_act, projector_bias)

    # ---- the image ----------------------------------------------------------------------------------------
    def _probe_image(self) -> torch.Tensor:
        w = next(self.vision_tower.parameters())
        return torch.zeros(1, *image_shape(self.vision_tower), device=w.device, dtype=w.dtype)

    def _select(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The image tower's tokens at the feature layers, prefix tokens kept or dropped, layers concatenated."""
        kw = {"return_prefix_tokens": True} if self._prefix else {}
        feats = self.vision_tower.forward_intermediates(pixel_values, indices=self._take, output_fmt="NLC",
                                                        intermediates_only=True, stop_early=True, **kw)
        if self._prefix:
            feats = [torch.cat([prefix, patches], 1) if self.select_strategy == "full" else patches
                     for patches, prefix in feats]
        return torch.cat(feats, dim=-1)

    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Images (B, C, H, W) -> projected image tokens (B, T, dim of the language model); T is
        ``num_image_tokens``."""
        return self.projector(self._select(pixel_values))

    def merge(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None = None,
              attention_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None):
        """The language model's input embeddings (B, N', dim) with the image tokens at the placeholders, and
        ``attention_mask`` / ``labels`` widened to match (the image's positions: attended, label -100)."""
        tok = self.image_token_id
        is_image = input_ids == tok
        embeds = self.language_model.embed_tokens(input_ids.masked_fill(is_image, 0))  # the id may be out of vocab
        counts = is_image.sum(1).tolist()
        if pixel_values is None:
            if any(counts):
                raise ValueError(f"the prompt holds {max(counts)} image placeholder(s) (token {tok}) but no image "
                                 f"is given")
            return embeds, attention_mask, labels
        feats = self.image_features(pixel_values).to(embeds.dtype)
        b, t = input_ids.shape[0], feats.shape[1]
        if feats.shape[0] != b:
            raise ValueError(f"{feats.shape[0]} images for {b} prompts: one image per prompt")
        for i, c in enumerate(counts):
            if c == 0:
                raise ValueError(f"prompt {i} has no image placeholder (token {tok}); this model reads its image "
                                 f"there")
            if c not in (1, t) or c != counts[0]:
                raise ValueError(f"prompt {i} has {c} image placeholders for its one image (expected one, or {t} "
                                 f"in a row as transformers' processor writes them, the same in every prompt)")
        if counts[0] == t:  # expanded placeholders: the image's tokens overwrite them in order
            n = input_ids.shape[1]
            first, last = is_image.long().argmax(1), n - 1 - is_image.flip(1).long().argmax(1)
            if bool((last - first + 1 != t).any()):  # scattered ones would put the image's tokens apart
                raise ValueError(f"the {t} image placeholders of a prompt must stand in a row, as transformers' "
                                 f"processor writes them")
            return embeds.masked_scatter(is_image[..., None], feats), attention_mask, labels
        # one placeholder per prompt, widened into the T image tokens: output position j of a row whose
        # placeholder stands at p takes text token j before p, image token j - p from p on, then text token
        # j - T + 1; one gather for the whole batch (rows cut and joined one by one cost a full-size zero-filled
        # gradient per slice in the backward pass)
        n = input_ids.shape[1]
        p = is_image.long().argmax(1, keepdim=True)
        j = torch.arange(n - 1 + t, device=input_ids.device).expand(b, -1)
        src = torch.where(j < p, j, torch.where(j < p + t, n + j - p, j - t + 1))  # into [text tokens, image]

        def widen(x: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
            both = torch.cat([x, image], 1)
            return both.gather(1, src if both.dim() == 2 else src[..., None].expand(-1, -1, both.shape[-1]))

        return (widen(embeds, feats),
                None if attention_mask is None else widen(attention_mask, attention_mask.new_ones(b, t)),
                None if labels is None else widen(labels, labels.new_full((b, t), IGNORE_INDEX)))

    # ---- the model ----------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None, *,
                position_ids: torch.Tensor | None = None, scored_only: bool = False) -> LlavaOutput:
        """Next-token logits of the merged sequence and, with ``labels`` (B, N; -100 where not scored, aligned
        with ``input_ids``), the mean cross-entropy of position i's logits against label i + 1 (transformers'
        ``LlavaForConditionalGeneration`` loss). ``attention_mask`` (B, N): 1 for real tokens, 0 for (left)
        padding.

        ``scored_only`` (with ``labels``): the logits of the positions the loss reads only, (M, vocab) row by row,
        and the same loss; the language model's last block then runs its MLP on those M positions alone
        (instruction tuning scores the answers, a small share of the tokens)."""
        if scored_only and labels is None:
            raise ValueError("scored_only needs labels: the scored positions are those whose next label is not -100")
        embeds, mask, labels = self.merge(input_ids, pixel_values, attention_mask, labels)
        if scored_only:
            target = labels[:, 1:]
            scored = target != IGNORE_INDEX
            logits = self.language_model(inputs_embeds=embeds, attention_mask=mask, position_ids=position_ids,
                                         logits_at=F.pad(scored, (0, 1)))  # position i is scored against label i + 1
            return LlavaOutput(logits, F.cross_entropy(logits.float(), target[scored]))
        logits = self.language_model(inputs_embeds=embeds, attention_mask=mask, position_ids=position_ids)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                   ignore_index=IGNORE_INDEX)
        return LlavaOutput(logits, loss)

    def _check_context(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None,
                       max_new_tokens: int) -> None:
        """``ValueError`` when the merged prompt plus ``max_new_tokens`` exceed the language model's context,
        counted as :meth:`merge` will build it: one placeholder per prompt becomes the image's T tokens (N + T - 1
        positions), T placeholders in a row are overwritten in place (N). A malformed placeholder count is left
        to :meth:`merge`'s own message."""
        n, context, t = input_ids.shape[1], self.language_model.config.max_seq_len, self.num_image_tokens
        counts = (input_ids == self.image_token_id).sum(1)
        if pixel_values is None:
            if bool(counts.any()):
                return
            total, what = n, f"{n} tokens"
        elif bool((counts == 1).all()):
            total = n + t - 1
            what = (f"{n} ids: {n - 1} text tokens + the image's {t} tokens in place of its one placeholder = "
                    f"{total} tokens")
        elif bool((counts == t).all()):
            total, what = n, f"{n} ids: {n - t} text tokens + {t} placeholders holding the image's tokens"
        else:
            return
        if total + max_new_tokens <= context:
            return
        raise ValueError(f"the prompt ({what}) plus max_new_tokens ({max_new_tokens}) exceed the language model's "
                         f"context of {context} tokens")

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None = None, max_new_tokens: int = 32,
                 temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                 eos_token_id: int | list[int] | None = None, *, attention_mask: torch.Tensor | None = None,
                 pad_token_id: int | None = None, generator: torch.Generator | None = None,
                 on_token=None, vocab_size: int | None = None) -> torch.Tensor:
        """Continue each (image, prompt) by up to ``max_new_tokens`` tokens; returns the new tokens (B, n_new).
        Greedy by default; sampling, stopping at ``eos_token_id`` (default: the language model's
        ``config.eos_token_id``; ``[]``: never stop), padding, streaming and ``vocab_size`` as
        :meth:`vitlab.models.llama.Llama.generate`. Prompts of different lengths are left-padded with
        ``attention_mask`` 0 on the padding.

        The merged prompt (a single placeholder widened into the image's ``num_image_tokens``) plus
        ``max_new_tokens`` must fit the language model's context: otherwise ``ValueError`` naming the text and image
        tokens, before the image tower runs."""
        self._check_context(input_ids, pixel_values, max_new_tokens)
        embeds, mask, _ = self.merge(input_ids, pixel_values, attention_mask)
        return self.language_model.generate(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=max_new_tokens,
                                            temperature=temperature, top_k=top_k, top_p=top_p,
                                            eos_token_id=eos_token_id,
                                            pad_token_id=pad_token_id, generator=generator, on_token=on_token,
                                            vocab_size=vocab_size)

    def profile_inputs(self, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What :mod:`vitlab.profile` runs: ``image`` with the tower's own channels and a prompt of 32 tokens (fewer
        where the context is shorter: with the image's tokens it fills at most the context) with its placeholder
        after the first token. The ids stay on the CPU: the placeholder is found from their values, which the
        profiler's ``meta`` device does not hold."""
        n = max(2, min(32, self.language_model.config.max_seq_len - self.num_image_tokens + 1))
        ids = torch.ones(image.shape[0], n, dtype=torch.long)
        ids[:, 1] = self.image_token_id
        chans = image_shape(self.vision_tower)[0]
        if image.shape[1] != chans:  # a tower that reads more than the pixels (e.g. coordinate channels)
            image = image.new_zeros(image.shape[0], chans, *image.shape[2:])
        return ids, image

    def shard_units(self) -> list[nn.Module]:
        """FSDP units: the image tower's, then the decoder's."""
        return [*self.vision_tower.shard_units(), *self.language_model.shard_units()]

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute activations in the backward pass in every part that checkpoints its blocks (the image
        tower's; the language model's where it has the switch)."""
        set_grad_checkpointing(self, enable)

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        nwd = getattr(self.vision_tower, "no_weight_decay", set)()
        return {f"vision_tower.{n}" for n in nwd}

    # ---- weights --------------------------------------------------------------------------------------------
    def check_hf_config(self, cfg: dict, source: str, token_ids: bool = True) -> None:
        """``ValueError`` (one line: the field, the checkpoint's value, this model's) unless a transformers
        ``LlavaConfig`` dict describes this model's function beyond its tensors' shapes: a Llama language model
        (``text_config.model_type``) of this architecture (:meth:`Llama.check_config`), a CLIP tower's activation,
        eps and heads, the feature layers (compared as the blocks they name) and selection, the projector's
        activation and, with ``token_ids``, the image placeholder ``image_token_index``. ``token_ids=False`` is for
        a checkpoint whose token ids are mapped onto the model's (``--init``'s vocabulary transfer)."""
        try:
            kw = llava_kwargs_from_hf(cfg)
            self.language_model.check_config(llama_config_from_hf(cfg.get("text_config") or {}), source)
        except KeyError as e:
            raise ValueError(f"{source}: its config.json has no text_config field {e}") from None
        except ValueError as e:  # an activation, a language model or a RoPE vitlab does not have
            msg = str(e)
            raise ValueError(msg if msg.startswith(f"{source}:") else f"{source}: {msg}") from None
        # a CLIP ViT tower's activation, eps and heads (the blocks' tokens are read, not its pooled output)
        bad = (hf_clip_vision_differences(self.vision_tower, kw["vision"], pooled=False)
               if isinstance(self.vision_tower, VisionTransformer) else [])
        # field: (the checkpoint's value, this model's)
        # the feature layers compared as the blocks they name (2 and -2 are one block of a 3-block tower)
        pairs = {"vision_feature_layer": (kw["vision_feature_layer"], self.vision_feature_layer,
                                          self._blocks(kw["vision_feature_layer"]) == self._take),
                 "vision_feature_select_strategy": (kw["vision_feature_select_strategy"], self.select_strategy)}
        if self.projector.act is not None:  # compared as modules, named as transformers names them
            pairs["projector_hidden_act"] = hf_act_pair(cfg.get("projector_hidden_act", "gelu"), self.projector.act)
        if token_ids:
            pairs["image_token_index"] = (kw["image_token_id"], self.image_token_id)
        bad += config_differences(pairs)
        if bad:
            raise ValueError(f"{source}: another LLaVA architecture: {', '.join(bad)}")

    def _blocks(self, layers: int | list[int]) -> list[int]:
        """The tower's blocks (0-based) that transformers' ``vision_feature_layer`` names: ``hidden_states[i]`` is
        block i - 1's output, a negative i counts from the end (-1 for an index outside the tower)."""
        n = _num_levels(self.vision_tower)
        layers = [layers] if isinstance(layers, int) else list(layers)
        return [i - 1 if 0 < i <= n else n + i if -n <= i < 0 else -1 for i in layers]

    def read_checkpoint(self, path: str | os.PathLike, token_ids: bool = True) -> dict[str, torch.Tensor]:
        """The tensors of a transformers ``save_pretrained`` directory of a LLaVA model, else of a file. A
        directory's ``config.json`` must describe this model (:meth:`check_hf_config`: what the weights cannot
        tell, the image placeholder's id too unless ``token_ids`` is False)."""
        p = Path(path)
        if not p.is_dir():
            return read_state_dict(p)
        cfg = read_hf_config(p, architectures=HF_ARCHITECTURES)
        self.check_hf_config(cfg, str(p), token_ids=token_ids)
        sd = read_hf_state_dict(p)
        # a tied head is left out of the file: the saved layout (transformers 4) or the in-memory one (5)
        for embed, head in (("language_model.model.embed_tokens.weight", "language_model.lm_head.weight"),
                            ("model.language_model.embed_tokens.weight", "lm_head.weight")):
            sd = fill_tied_head(sd, cfg, embed, head)
        return sd

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> LLaVA:
        """A LLaVA with the architecture (``config.json``) and weights of a transformers
        ``LlavaForConditionalGeneration`` directory (a CLIP image tower and a Llama decoder), in eval mode."""
        cfg = read_hf_config(path, architectures=HF_ARCHITECTURES)
        text = with_generation_eos(cfg.get("text_config") or {}, path)  # where generate stops
        try:
            kw = llava_kwargs_from_hf(cfg)
            language = Llama(llama_config_from_hf(text))
        except ValueError as e:  # an image tower, a language model or an activation vitlab does not have
            raise ValueError(f"{path}: {e}") from None
        model = cls(clip_vision_transformer(kw.pop("vision")), language, **kw)
        return load_state_dict(model, model.read_checkpoint(path), source=str(path)).eval()

    @staticmethod
    def checkpoint_filter_fn(sd: dict[str, torch.Tensor], model: LLaVA) -> dict[str, torch.Tensor]:
        """transformers' key names (either layout) -> ours; ours pass as they are."""
        return convert_hf_llava_state_dict(sd, model) if is_hf_llava_state_dict(sd) else sd


def is_hf_llava_state_dict(sd: dict) -> bool:
    return any(k.startswith(("multi_modal_projector.", "model.multi_modal_projector.")) for k in sd)


def convert_hf_llava_state_dict(sd: dict[str, torch.Tensor], model: LLaVA) -> dict[str, torch.Tensor]:
    """A transformers ``LlavaForConditionalGeneration`` state dict -> ours. Both of its layouts: the saved one
    (``vision_tower.``, ``multi_modal_projector.``, ``language_model.model.``, ``language_model.lm_head``) and
    the in-memory one of transformers 5 (``model.vision_tower.``, ``model.language_model.``, ``lm_head``). The
    image tower is CLIP's (:func:`vitlab.models.clip_vit.convert_hf_clip_vision_state_dict`), the decoder goes
    through the Llama's own key map."""
    flat: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        if k.startswith("model.language_model."):
            k = "language_model.model." + k[len("model.language_model."):]
        elif k.startswith("model."):
            k = k[len("model."):]
        elif k == "lm_head.weight":
            k = "language_model.lm_head.weight"
        flat[k] = v
    out = {f"vision_tower.{k}": v for k, v in convert_hf_clip_vision_state_dict(flat, "vision_tower.").items()}
    out.update({"projector." + k[len("multi_modal_projector."):]: v for k, v in flat.items()
                if k.startswith("multi_modal_projector.")})
    lm = model.language_model
    lm_sd = {k[len("language_model."):]: v for k, v in flat.items() if k.startswith("language_model.")}
    lm_sd = lm.checkpoint_filter_fn(lm_sd, lm)
    out.update({f"language_model.{k}": v for k, v in lm_sd.items()})
    return out


def build_llava(vision: str | dict, language: str, vision_kwargs: dict | None = None,
                language_kwargs: dict | None = None, **kwargs) -> LLaVA:
    """A LLaVA of an image tower and a registered language model.

    ``vision``: a transformers ``CLIPVisionConfig`` dict (CLIP's ViT, :func:`clip_vision_transformer`) or a
    registered model name (a ``clip_*`` model gives its image tower's ViT). ``kwargs``: ``vision_*`` (and
    ``img_size``, ``in_chans``, ``drop_path_rate``) go to the image tower, ``text_*`` (and ``vocab_size``,
    ``max_seq_len``) to the language model, the rest to :class:`LLaVA`. ``max_seq_len`` counts the text: the
    image's tokens are added to the language model's context."""
    vkw, lkw = dict(vision_kwargs or {}), dict(language_kwargs or {})
    for key in list(kwargs):
        if key.startswith("vision_") and key not in ("vision_feature_layer", "vision_feature_select_strategy"):
            vkw[key[7:]] = kwargs.pop(key)
        elif key.startswith("text_"):
            lkw[key[5:]] = kwargs.pop(key)
        elif key in ("img_size", "in_chans", "drop_path_rate", "dynamic_img_size"):
            vkw[key] = kwargs.pop(key)
        elif key in ("vocab_size", "max_seq_len"):
            lkw[key] = kwargs.pop(key)
    kwargs.pop("num_classes", None)  # create_model's; the language model's vocabulary is its classifier
    if isinstance(vision, dict):
        tower = clip_vision_transformer(vision, **vkw)
    elif get_model_config(vision).family == "clip":  # a CLIP's image-tower options are its image_* arguments
        common = ("img_size", "in_chans", "drop_path_rate", "dynamic_img_size")
        tower = create_model(vision, **{k if k in common else f"image_{k}": v for k, v in vkw.items()}).visual.trunk
    else:
        tower = create_model(vision, num_classes=0, **vkw)
    text_len = lkw.pop("max_seq_len", None)
    lm = create_model(language, **lkw)
    model = LLaVA(tower, lm, **kwargs)
    if text_len is not None:  # the text context plus the image's tokens (one placeholder becomes T)
        lm.config.max_seq_len = text_len + model.num_image_tokens - 1
        lm.reset_rope()
    return model


def llava_kwargs_from_hf(cfg: dict) -> dict:
    """:func:`build_llava`'s arguments (less the language model) of a transformers ``LlavaConfig`` dict."""
    vision, text = cfg.get("vision_config") or {}, cfg.get("text_config") or {}
    if vision.get("model_type", "clip_vision_model") != "clip_vision_model":
        raise ValueError(f"only CLIP image towers are supported, not {vision.get('model_type')!r}")
    if text.get("model_type", "llama") != "llama":  # another decoder (e.g. Mistral's sliding window) computes else
        raise ValueError(f"only Llama language models are supported, not text_config.model_type "
                         f"{text.get('model_type')!r}")
    return dict(vision=vision, image_token_id=cfg.get("image_token_index", cfg.get("image_token_id", 32000)),
                projector_act=hf_act(cfg.get("projector_hidden_act", "gelu")),
                projector_bias=cfg.get("multimodal_projector_bias", True),
                vision_feature_layer=cfg.get("vision_feature_layer", -2),
                vision_feature_select_strategy=cfg.get("vision_feature_select_strategy", "default"))
