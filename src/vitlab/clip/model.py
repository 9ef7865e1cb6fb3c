"""CLIP (Radford et al., 2021, "Learning Transferable Visual Models From Natural Language Supervision"): an image
tower and a text tower map into one ``embed_dim`` space; ``logits = exp(t) * <norm(I), norm(T)>`` with a learned
temperature ``t`` (Sec. 2.5 and Fig. 3 of the paper: ``logit_scale``, initialised to log(1 / 0.07)).

- :class:`ImageTower`: any registered vitlab model with its classifier removed, pooled features -> linear
  projection. For a ViT, CLIP's extra pre-norm (``ln_pre``: a LayerNorm on the embedded tokens before the first
  block, Sec. 2.4 of the paper; :class:`vitlab.models.PreNorm`) is swapped in from outside, behind the
  position-embedding dropout, so the trunk's token interface (:class:`vitlab.models.TokenModel`: ``embed``, the
  blocks, ``finish_tokens``) includes it; hierarchical models (Swin, PVT, ...) give their pooled features.
- :class:`TextTransformer`: CLIP's causal text transformer (Sec. 2.4: pre-norm blocks, a causal mask, the
  activation of the end-of-text token after the final LayerNorm, linearly projected), or, with ``style='llama'``,
  the Llama-2 tower (Touvron et al., 2023: 1-D RoPE instead of learned positions, RMSNorm, SwiGLU, causal mask), both
  from :mod:`vitlab.layers` / :class:`vitlab.attention.Block`. Causal attention means the end-of-text token sees
  only the text before it, so padding after it needs no mask.
- :class:`CLIP`: ``encode_image``, ``encode_text``, ``forward(image, text) -> (image_features, text_features,
  logit_scale.exp())`` with unit-norm features, as open_clip's ``CLIP``.

The registered configurations (``clip_vit_base_patch16`` ...) are in :mod:`vitlab.clip.model_configs`.
Module names differ from open_clip's; :func:`vitlab.clip.openclip.convert_openclip_state_dict` maps an open_clip
state dict (the model's ``checkpoint_filter_fn``, so ``create_model(..., checkpoint_path=FILE)`` loads one).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

from vitlab.attention import Block
from vitlab.clip.openclip import convert_openclip_state_dict, is_openclip_state_dict, openclip_config
from vitlab.convert import load_state_dict, read_hf_config, read_hf_state_dict, read_state_dict
from vitlab.layers import RotaryEmbedding1D, check_heads, checkpoint_seq, get_norm_layer
from vitlab.models import (
    CLIP_ARCHITECTURES,
    PreNorm,
    VisionTransformer,
    clip_vit_kwargs,
    convert_hf_clip_state_dict,
    hf_clip_tower_differences,
    hf_clip_vision_differences,
    hf_layernorm,
    is_hf_clip_state_dict,
    set_grad_checkpointing,
)
from vitlab.registry import create_model, get_model_config

# the tiny text tower (tests, the offline digits demo): 2 layers of width 64 over a word-level vocabulary (the task
# sets its size)
PICO_TEXT = dict(vocab_size=64, context_length=16, width=64, depth=2, num_heads=4)

TextStyle = Literal["clip", "llama"]


class ImageTower(nn.Module):
    """``proj(trunk(x))``: a registered model built with ``num_classes=0`` (pooled features), then a linear map
    to ``out_dim`` without bias (open_clip's ``visual.proj``)."""

    def __init__(self, model_name: str, out_dim: int, pre_norm: bool = True, **model_kwargs):
        super().__init__()
        self.trunk = create_model(model_name, num_classes=0, **model_kwargs)
        if pre_norm:
            if not isinstance(getattr(self.trunk, "pos_drop", None), nn.Dropout):
                raise ValueError(f"CLIP's pre-norm needs a ViT trunk with a position-embedding dropout; "
                                 f"{model_name} has none: pass pre_norm=False")
            self.trunk.pos_drop = PreNorm(self.trunk.pos_drop, self.trunk.embed_dim,
                                          model_kwargs.get("norm_layer", "layernorm_eps5"))
        self.num_features = self.trunk.num_features
        self.proj = nn.Linear(self.num_features, out_dim, bias=False)
        nn.init.normal_(self.proj.weight, std=self.num_features**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.trunk(x))


class TextTransformer(nn.Module):
    """A causal text transformer over token ids (B, context_length) -> (B, embed_dim), pooled at the end-of-text
    token, which both vitlab tokenizers (and CLIP's) give the largest id: ``argmax`` over the ids finds it.

    ``style='clip'``: learned absolute positions, LayerNorm (eps ``norm_eps``, CLIP's 1e-5), GELU
    (``act_layer='quick_gelu'`` for OpenAI's weights), MLP ratio 4. ``style='llama'``: 1-D RoPE in every attention
    layer, RMSNorm, SwiGLU (Touvron et al., 2023). ``post_norm=True`` gives original-Transformer blocks (an
    option, not CLIP's)."""

    def __init__(self, vocab_size: int = 49408, context_length: int = 77, width: int = 512, depth: int = 12,
                 num_heads: int = 8, mlp_ratio: float = 4.0, embed_dim: int = 512, style: TextStyle = "clip",
                 act_layer: str = "gelu", post_norm: bool = False, rope_base: float = 10000.0,
                 norm_eps: float = 1e-5):
        super().__init__()
        if style not in ("clip", "llama"):
            raise ValueError(f"unknown text tower style {style!r}; choose 'clip' or 'llama'")
        head_dim = check_heads(width, num_heads)
        self.style, self.context_length, self.vocab_size, self.width = style, context_length, vocab_size, width
        self.grad_checkpointing = False
        norm = hf_layernorm(norm_eps) if style == "clip" else "rmsnorm"
        self.token_embedding = nn.Embedding(vocab_size, width)
        if style == "clip":
            self.pos_embed = nn.Parameter(torch.zeros(context_length, width))
            self.rope = None
        else:
            self.pos_embed = None
            self.rope = RotaryEmbedding1D(head_dim, rope_base)
        self.blocks = nn.ModuleList([
            Block(width, num_heads, mlp_ratio, norm_layer=norm, act_layer=act_layer, post_norm=post_norm,
                  mlp_layer="mlp" if style == "clip" else "swiglu") for _ in range(depth)])
        self.norm = get_norm_layer(norm)(width)
        self.proj = nn.Linear(width, embed_dim, bias=False)
        self._init_clip()

    def _init_clip(self) -> None:
        """open_clip's ``TextTransformer.init_parameters`` (OpenAI's CLIP code): small embeddings, attention and
        MLP weights scaled by width and depth so the residual stream keeps its scale."""
        width, depth = self.width, len(self.blocks)
        nn.init.normal_(self.token_embedding.weight, std=0.02)
        if self.pos_embed is not None:
            nn.init.normal_(self.pos_embed, std=0.01)
        proj_std, attn_std, fc_std = width**-0.5 * (2 * depth) ** -0.5, width**-0.5, (2 * width) ** -0.5
        for blk in self.blocks:
            for lin, std in ((blk.attn.qkv, attn_std), (blk.attn.proj, proj_std), (blk.mlp.fc1, fc_std),
                             (blk.mlp.fc2, proj_std)):
                nn.init.normal_(lin.weight, std=std)
                if lin.bias is not None:
                    nn.init.zeros_(lin.bias)
        nn.init.normal_(self.proj.weight, std=width**-0.5)

    def check_text(self, text: torch.Tensor) -> None:
        if text.ndim != 2 or text.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"expected token ids of shape (B, L) and an integer dtype, got {tuple(text.shape)} "
                             f"{text.dtype}")
        if text.shape[1] > self.context_length:
            raise ValueError(f"text of {text.shape[1]} tokens is longer than the context length "
                             f"{self.context_length}")

    def forward_features(self, text: torch.Tensor) -> torch.Tensor:
        """(B, L) token ids -> (B, L, width) after the final norm."""
        self.check_text(text)
        n = text.shape[1]
        x = self.token_embedding(text)
        rope = None
        if self.pos_embed is not None:
            x = x + self.pos_embed[:n]
        else:
            rope = self.rope(n, device=x.device, dtype=x.dtype)
        x = checkpoint_seq(self.blocks, x, None, rope, None, True, enabled=self.grad_checkpointing)
        return self.norm(x)

    def forward(self, text: torch.Tensor) -> torch.Tensor:
        x = self.forward_features(text)
        eot = x[torch.arange(x.shape[0], device=x.device), text.argmax(dim=-1)]  # (B, width)
        return self.proj(eot)


class CLIP(nn.Module):
    """An image tower and a text tower with a shared ``embed_dim`` and a learnable ``logit_scale``."""

    def __init__(self, embed_dim: int = 512, image_model: str = "vit_base_patch16_224",
                 image_kwargs: dict | None = None, image_pre_norm: bool = True, text_kwargs: dict | None = None,
                 init_logit_scale: float = math.log(1 / 0.07)):
        super().__init__()
        self.embed_dim = embed_dim
        self.visual = ImageTower(image_model, embed_dim, pre_norm=image_pre_norm, **(image_kwargs or {}))
        self.text = TextTransformer(embed_dim=embed_dim, **(text_kwargs or {}))
        self.context_length = self.text.context_length
        # shape (1,), not a scalar: FSDP2 shards only parameters with a dimension
        self.logit_scale = nn.Parameter(torch.full((1,), float(init_logit_scale)))

    def encode_image(self, image: torch.Tensor, normalize: bool = False) -> torch.Tensor:
        x = self.visual(image)
        return F.normalize(x, dim=-1) if normalize else x

    def encode_text(self, text: torch.Tensor, normalize: bool = False) -> torch.Tensor:
        x = self.text(text)
        return F.normalize(x, dim=-1) if normalize else x

    def forward(self, image: torch.Tensor, text: torch.Tensor):
        """Unit-norm image and text features and ``exp(logit_scale)``; logits are ``scale * img @ txt.T``."""
        return (self.encode_image(image, normalize=True), self.encode_text(text, normalize=True),
                self.logit_scale[0].exp())  # exp of the element: a new tensor, not a view (FSDP2 hooks outputs)

    def profile_inputs(self, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What :mod:`vitlab.profile` runs: the image and one full-context text per image (open_clip's convention
        for a CLIP model's MACs: image + text tower)."""
        return image, torch.zeros(image.shape[0], self.context_length, dtype=torch.long, device=image.device)

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        set_grad_checkpointing(self, enable)

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        trunk = {f"visual.trunk.{n}" for n in getattr(self.visual.trunk, "no_weight_decay", set)()}
        return trunk | {"text.pos_embed", "logit_scale"}

    def shard_units(self) -> list[nn.Module]:
        """FSDP units: the image trunk's own units, then the text blocks."""
        return [*self.visual.trunk.shard_units(), *self.text.blocks]


def build_clip(embed_dim: int, image_model: str, image_kwargs: dict, text_kwargs: dict, quick_gelu: bool = False,
               img_size=None, in_chans: int | None = None, drop_path_rate: float = 0.0,
               dynamic_img_size: bool = False, **kwargs) -> CLIP:
    """A CLIP of a registered image model and a text configuration; ``kwargs`` go to :class:`CLIP` except
    ``text_*`` (to the text tower: ``text_depth=2``) and ``image_*`` (to the image model: ``image_depth=2``).
    ``img_size``, ``in_chans``, ``drop_path_rate`` and ``dynamic_img_size`` (``create_model``'s) are the image
    model's."""
    image_kwargs, text_kwargs = dict(image_kwargs), dict(text_kwargs)
    for key in list(kwargs):
        if key.startswith("text_") and key != "text_kwargs":
            text_kwargs[key[5:]] = kwargs.pop(key)
        elif key.startswith("image_") and key not in ("image_kwargs", "image_model", "image_pre_norm"):
            image_kwargs[key[6:]] = kwargs.pop(key)
    if quick_gelu:
        image_kwargs["act_layer"] = text_kwargs["act_layer"] = "quick_gelu"
    for key, value in (("img_size", img_size), ("in_chans", in_chans)):
        if value is not None:
            image_kwargs[key] = value
    if drop_path_rate:
        image_kwargs["drop_path_rate"] = drop_path_rate
    if dynamic_img_size:
        image_kwargs["dynamic_img_size"] = True
    return CLIP(embed_dim, image_model, image_kwargs, text_kwargs=text_kwargs, **kwargs)


def checkpoint_filter_fn(state_dict: dict, model: CLIP) -> dict:
    """An open_clip or a transformers ``CLIPModel`` state dict is renamed to vitlab's modules; vitlab's own passes
    as it is."""
    if is_hf_clip_state_dict(state_dict):
        return convert_hf_clip_state_dict(state_dict)
    return convert_openclip_state_dict(state_dict) if is_openclip_state_dict(state_dict) else state_dict


# transformers' CLIPTextConfig defaults (openai/clip-vit-base-patch32), for keys a config.json leaves out
HF_CLIP_TEXT_DEFAULTS = dict(vocab_size=49408, hidden_size=512, intermediate_size=2048, num_hidden_layers=12,
                             num_attention_heads=8, max_position_embeddings=77, hidden_act="quick_gelu",
                             layer_norm_eps=1e-5, eos_token_id=49407)


def hf_eos_at_largest_id(eos_token_id: int, vocab_size: int) -> bool:
    """Whether vitlab's text tower, which pools at the largest token id, pools where transformers does for this
    ``eos_token_id``: at the vocabulary's last id (Radford et al., 2021's tokenizer puts end-of-text there), or
    for ``eos_token_id == 2`` (configs before transformers PR #24773, which pool at the largest id too)."""
    return eos_token_id in (2, vocab_size - 1)


def check_hf_config(model: CLIP, cfg: dict, source: str) -> None:
    """``ValueError`` (one line: the field, the checkpoint's value, this model's) unless a transformers
    ``CLIPConfig`` dict describes ``model``'s function beyond its tensors' shapes. The image tower (a ViT):
    activation, LayerNorm eps, heads and [CLS] pooling (:func:`vitlab.models.clip_vit.hf_clip_vision_differences`).
    The text tower: CLIP's pre-norm blocks, activation, eps and heads, and the end-of-text token it pools at:
    transformers pools at the first ``eos_token_id`` (or, for ``eos_token_id == 2``, its configs before
    transformers PR #24773, at the largest id), vitlab at the largest id, which is the same token only when
    ``eos_token_id`` is the vocabulary's last (Radford et al., 2021's tokenizer puts end-of-text there)."""
    trunk, text = model.visual.trunk, model.text
    bad = (hf_clip_vision_differences(trunk, cfg.get("vision_config") or {})
           if isinstance(trunk, VisionTransformer) else [f"vision_config.model_type 'clip_vision_model' (this model "
                                                         f"{type(trunk).__name__})"])
    t = {**HF_CLIP_TEXT_DEFAULTS, **(cfg.get("text_config") or {})}
    if text.style != "clip" or any(b.post_norm for b in text.blocks):
        mine = repr(text.style) if text.style != "clip" else "post-norm blocks"
        bad.append(f"text tower 'clip' with pre-norm blocks (this model {mine})")
    else:
        bad += hf_clip_tower_differences(text, t, "text_config.")
    if not hf_eos_at_largest_id(t["eos_token_id"], text.vocab_size):
        bad.append(f"text_config.eos_token_id {t['eos_token_id']} (this model pools at the largest id, "
                   f"{text.vocab_size - 1})")
    if bad:
        # the way out: OpenAI's weights (QuickGELU in both towers) fit the registered models with quick_gelu=True;
        # any other config.json builds its own model
        hint = ("create it with quick_gelu=True (OpenAI's weights), or " if all("hidden_act 'quick_gelu'" in b
                                                                               for b in bad) else "")
        raise ValueError(f"{source}: another CLIP architecture: {', '.join(bad)}; {hint}build the model its "
                         f"config.json describes with vitlab.clip.hf.clip_from_hf({source!r})")


def read_checkpoint(self: CLIP, path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """A checkpoint file, or a transformers ``CLIPModel.save_pretrained`` directory (its tensors by their Hugging
    Face names, renamed by :func:`checkpoint_filter_fn`) whose ``config.json`` describes this model's function
    (:func:`check_hf_config`: what the weights cannot tell, such as QuickGELU from GELU or the heads' split)."""
    if not Path(path).is_dir():
        return read_state_dict(path)
    check_hf_config(self, read_hf_config(path, architectures=CLIP_ARCHITECTURES), str(path))
    return read_hf_state_dict(path)


CLIP.checkpoint_filter_fn = staticmethod(checkpoint_filter_fn)
CLIP.check_hf_config = check_hf_config
CLIP.read_checkpoint = read_checkpoint


def clip_from_openclip(checkpoint: str | dict, quick_gelu: bool = False) -> CLIP:
    """A vitlab CLIP with the architecture and weights of an open_clip ViT CLIP checkpoint (a file or a state
    dict). ``quick_gelu``: the activation of OpenAI's weights (open_clip's ``*-quickgelu`` models)."""
    sd = read_state_dict(checkpoint) if not isinstance(checkpoint, dict) else checkpoint
    cfg = openclip_config(sd)
    model = build_clip(cfg["embed_dim"], "vit_base_patch16_224", {**clip_vit_kwargs(), **cfg["image_kwargs"]},
                       cfg["text_kwargs"], quick_gelu=quick_gelu)
    return load_state_dict(model, sd, source=checkpoint if isinstance(checkpoint, str) else "open_clip state dict")


def clip_for_task(model_name: str, img_size: int, in_chans: int, vocab_size: int | None = None,
                  context_length: int | None = None, joint_dim: int = 64, **model_kwargs) -> CLIP:
    """The CLIP a training run builds: a registered ``clip_*`` model, or any other registered image model (built
    with ``model_kwargs``, its ``embed_dim`` included) as the image tower (its pooled features, no pre-norm) beside
    the tiny CLIP text tower, both projected to ``joint_dim`` (the run's ``embed_dim`` option). ``vocab_size`` /
    ``context_length`` size the text tower for the run's tokenizer."""
    text = {k: v for k, v in (("vocab_size", vocab_size), ("context_length", context_length)) if v is not None}
    if get_model_config(model_name).family == "clip":
        text_kw = {f"text_{k}": v for k, v in text.items()}
        return create_model(model_name, img_size=img_size, in_chans=in_chans, **text_kw, **model_kwargs)
    drop_path = model_kwargs.pop("drop_path_rate", 0.0)
    return build_clip(joint_dim, model_name, model_kwargs, {**PICO_TEXT, **text}, image_pre_norm=False,
                      img_size=img_size, in_chans=in_chans, drop_path_rate=drop_path)
