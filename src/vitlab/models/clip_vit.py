"""CLIP's ViT image tower (Radford et al., 2021, "Learning Transferable Visual Models From Natural Language
Supervision", Sec. 2.4): the plain ViT with an extra LayerNorm on the embedded tokens before the first block
(the pre-norm), no bias in the patch projection, LayerNorm eps 1e-5 and, for OpenAI's weights, QuickGELU. It is
CLIP's image tower and the image tower of vision-language models built on CLIP (LLaVA, Liu et al., 2023), so it
lives here, below the packages that use it.

transformers' ``CLIPVisionModel`` (saved by ``save_pretrained``) computes the same function; its key names map to
this ViT's (timm's) names by :func:`convert_hf_clip_vision_state_dict`:

=====================================================  =====================================================
transformers (``vision_model.`` optional)              vitlab
=====================================================  =====================================================
``embeddings.patch_embedding.weight``                  ``patch_embed.proj.weight``
``embeddings.class_embedding`` (D,)                    ``cls_token`` (1, 1, D)
``embeddings.position_embedding.weight`` (N, D)        ``pos_embed`` (1, N, D)
``pre_layrnorm``                                       ``pos_drop.norm`` (the pre-norm, after the dropout)
``encoder.layers.i.layer_norm1`` / ``layer_norm2``     ``blocks.i.norm1`` / ``norm2``
``encoder.layers.i.self_attn.{q,k,v}_proj``            ``blocks.i.attn.qkv`` (rows q, k, v)
``encoder.layers.i.self_attn.out_proj``                ``blocks.i.attn.proj``
``encoder.layers.i.mlp.fc1`` / ``fc2``                 ``blocks.i.mlp.fc1`` / ``fc2``
``post_layernorm``                                     ``norm``
=====================================================  =====================================================

With ``num_classes=0`` the ViT's output is ``CLIPVisionModel``'s ``pooler_output`` (the post-LayerNorm [CLS]
token), and ``forward_intermediates`` gives its ``hidden_states[i + 1]`` (the tokens after block i).

OpenAI's four image towers are registered under timm's names (``vit_base_patch32_clip_quickgelu_224``,
``vit_base_patch16_clip_quickgelu_224``, ``vit_large_patch14_clip_quickgelu_224`` and
``vit_large_patch14_clip_quickgelu_336``, the last LLaVA-1.5's tower; Radford et al., 2021, Table 20), pooled
features by default (``num_classes=0``). ``create_model(name, checkpoint_path=...)`` loads a transformers
``CLIPVisionModel`` / ``CLIPVisionModelWithProjection`` / ``CLIPModel`` directory (its image tower; the projection
is CLIP's, not the ViT's) or a timm state dict of the same tower (timm's ``norm_pre`` is the pre-norm). A
directory's ``config.json`` must describe the tower's function beyond its tensors' shapes (activation, LayerNorm eps,
heads, [CLS] pooling: :func:`hf_clip_vision_differences`, which vitlab's CLIP and LLaVA readers use too).
"""

from __future__ import annotations

import math
import re
from functools import partial
from pathlib import Path

import torch
import torch.nn as nn

from vitlab.convert import config_differences, read_hf_config, read_hf_state_dict, read_state_dict
from vitlab.layers import Mlp, PatchEmbed, get_act_layer, get_norm_layer
from vitlab.models.vision_transformer import VisionTransformer
from vitlab.models.vision_transformer import checkpoint_filter_fn as vit_checkpoint_filter_fn
from vitlab.registry import ModelConfig, register_model

OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)  # CLIP's image normalisation (open_clip's OPENAI_DATASET_*)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)

# transformers' activation names -> vitlab's (``gelu_new`` and ``gelu_pytorch_tanh`` are both the tanh form)
HF_ACTS = {"quick_gelu": "quick_gelu", "gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
           "relu": "relu", "silu": "silu", "swish": "silu"}
# transformers' CLIPVisionConfig defaults (openai/clip-vit-base-patch32), for keys a config.json leaves out
HF_CLIP_VISION_DEFAULTS = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                               num_channels=3, image_size=224, patch_size=32, hidden_act="quick_gelu",
                               layer_norm_eps=1e-5)
# transformers' class names and model_type of a CLIP, of its image tower alone, and of either (a directory holding
# a CLIP image tower)
CLIP_ARCHITECTURES = ("CLIPModel", "clip")
CLIP_VISION_ARCHITECTURES = ("CLIPVisionModel", "CLIPVisionModelWithProjection", "clip_vision_model")
HF_CLIP_ARCHITECTURES = CLIP_ARCHITECTURES + CLIP_VISION_ARCHITECTURES
_LAYER = [("layer_norm1.", "norm1."), ("layer_norm2.", "norm2."), ("self_attn.out_proj.", "attn.proj."),
          ("mlp.fc1.", "mlp.fc1."), ("mlp.fc2.", "mlp.fc2.")]


class PreNorm(nn.Module):
    """The position-embedding dropout of a ViT followed by CLIP's pre-norm (swapped in for ``pos_drop``)."""

    def __init__(self, drop: nn.Module, dim: int, norm_layer="layernorm_eps5"):
        super().__init__()
        self.drop = drop
        self.norm = get_norm_layer(norm_layer)(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.drop(x))


def hf_act(name: str) -> str:
    """vitlab's name of a transformers activation (``hidden_act``)."""
    if name not in HF_ACTS:
        raise ValueError(f"unsupported activation hidden_act={name!r}; supported: {', '.join(sorted(HF_ACTS))}")
    return HF_ACTS[name]


def hf_layernorm(eps: float):
    """vitlab's norm for a transformers ``layer_norm_eps``: the registered name where one exists."""
    return {1e-5: "layernorm_eps5", 1e-6: "layernorm"}.get(eps) or partial(nn.LayerNorm, eps=eps)


def hf_mlp_ratio(cfg: dict) -> float:
    """``intermediate_size / hidden_size`` of a transformers config, as the ``mlp_ratio`` whose MLP width
    ``int(hidden_size * mlp_ratio)`` is ``intermediate_size``: the quotient, raised by the least that undoes a
    product's round-off below the whole number (56 * (115 / 56) is 114.99999999999999 in floating point)."""
    hidden, inner = cfg["hidden_size"], cfg["intermediate_size"]
    ratio = inner / hidden
    while int(hidden * ratio) < inner:
        ratio = math.nextafter(ratio, math.inf)
    return ratio


def hf_act_name(act: nn.Module) -> str:
    """transformers' name of an activation module (``QuickGELU()`` -> ``'quick_gelu'``), else its repr."""
    r = repr(act)
    return next((k for k, v in HF_ACTS.items() if repr(get_act_layer(v)()) == r), r)


def hf_act_pair(name: str, act: nn.Module | None, mine: str | None = None) -> tuple[str, str, bool]:
    """A transformers activation ``name`` and the module ``act`` as a :func:`vitlab.convert.config_differences`
    entry: both named as transformers names them (``mine`` for a model without such a module), compared as
    modules, so two names of one function agree and GELU differs from its tanh form. An activation vitlab does not
    have is a difference, named as the checkpoint names it."""
    try:
        theirs = repr(get_act_layer(hf_act(name))())
    except ValueError:
        theirs = None
    return (name, hf_act_name(act) if act is not None else mine, act is not None and theirs == repr(act))


def hf_clip_tower_differences(tower: nn.Module, config: dict, prefix: str) -> list[str]:
    """What a transformers CLIP tower config (a dict, defaults filled in) says that the shapes of ``tower``'s
    tensors cannot show, as ``"{prefix}field theirs (this model ours)"`` for each field that differs:
    ``hidden_act`` (:func:`hf_act_pair`), ``layer_norm_eps`` (every LayerNorm of the tower: transformers uses one
    eps throughout; a tower of several is shown with the list of them) and ``num_attention_heads`` (the heads split
    the same fused qkv projection differently). ``tower`` holds pre-norm blocks (:class:`vitlab.attention.Block`)
    as ``blocks``: CLIP's image tower or its text tower, or BLIP's image tower."""
    block = tower.blocks[0]
    # CLIP's MLP is fc1, the activation, fc2; another feed-forward (SwiGLU) is named by its class
    act = block.mlp.act if isinstance(block.mlp, Mlp) else None
    eps = sorted({m.eps for m in tower.modules() if isinstance(m, nn.LayerNorm)})
    # one eps throughout agrees within float rounding; several never match transformers' one
    eps_pair = (config["layer_norm_eps"], eps[0]) if len(eps) == 1 else (config["layer_norm_eps"], eps, False)
    return config_differences({"hidden_act": hf_act_pair(config["hidden_act"], act, type(block.mlp).__name__),
                               "layer_norm_eps": eps_pair,
                               "num_attention_heads": (config["num_attention_heads"], block.attn.num_heads)}, prefix)


def hf_clip_vision_differences(vit: VisionTransformer, vision_config: dict, prefix: str = "vision_config.",
                               pooled: bool = True) -> list[str]:
    """:func:`hf_clip_tower_differences` of a ViT as CLIP's image tower (``vision_config``: a transformers
    ``CLIPVisionConfig`` dict) and, with ``pooled`` (its pooled output is used: ``pooler_output``, CLIP's image
    embedding), its pooling, which for transformers is always the [CLS] token. A LLaVA, which reads the blocks'
    tokens, passes ``pooled=False``."""
    bad = hf_clip_tower_differences(vit, {**HF_CLIP_VISION_DEFAULTS, **vision_config}, prefix)
    if pooled and vit.global_pool != "token":
        bad.append(f"pooling 'token' (this model {vit.global_pool!r})")
    return bad


def clip_vit_kwargs() -> dict:
    """A vitlab ViT as CLIP's image tower: no bias in the patch projection, LayerNorm eps 1e-5, [CLS] pooling."""
    return {"norm_layer": "layernorm_eps5", "embed_layer": partial(PatchEmbed, bias=False), "global_pool": "token"}


def hf_clip_vision_kwargs(vision_config: dict) -> dict:
    """The ViT arguments of a transformers ``CLIPVisionConfig`` (a dict of ``config.json``)."""
    c = {**HF_CLIP_VISION_DEFAULTS, **vision_config}
    return {**clip_vit_kwargs(), "img_size": c["image_size"], "patch_size": c["patch_size"],
            "in_chans": c["num_channels"], "embed_dim": c["hidden_size"], "depth": c["num_hidden_layers"],
            "num_heads": c["num_attention_heads"], "mlp_ratio": hf_mlp_ratio(c), "act_layer": hf_act(c["hidden_act"]),
            "norm_layer": hf_layernorm(c["layer_norm_eps"])}


class CLIPVisionTransformer(VisionTransformer):
    """CLIP's image tower: a :class:`VisionTransformer` whose ``pos_drop`` is followed by the pre-norm
    (:class:`PreNorm`). It reads a transformers CLIP directory or a timm CLIP ViT state dict as well as its own."""

    def __init__(self, norm_layer="layernorm_eps5", act_layer="quick_gelu", **kwargs):
        super().__init__(norm_layer=norm_layer, act_layer=act_layer, **kwargs)
        self.pos_drop = PreNorm(self.pos_drop, self.embed_dim, norm_layer)

    def read_checkpoint(self, path) -> dict[str, torch.Tensor]:
        """A ``save_pretrained`` directory (every tensor, by transformers' names) or one weights file. A directory's
        ``config.json`` must describe a CLIP whose image tower computes this one's function (:meth:`check_config`):
        the weights cannot tell QuickGELU from GELU, the LayerNorm's eps or how the heads split the projection."""
        if not Path(path).is_dir():
            return read_state_dict(path)
        cfg = read_hf_config(path, HF_CLIP_ARCHITECTURES)
        if "vision_config" in cfg:  # a CLIPModel: the image tower's fields are under vision_config
            self.check_config(cfg["vision_config"], str(path))
        else:
            self.check_config(cfg, str(path), prefix="")
        return read_hf_state_dict(path)

    def check_config(self, vision_config: dict, source: str, prefix: str = "vision_config.") -> None:
        """``ValueError`` in one line (each field as ``prefix + name``, the checkpoint's value and this model's,
        and the arguments that build the checkpoint's tower) unless a transformers ``CLIPVisionConfig`` (a dict)
        describes this tower's function beyond its tensors' shapes (:func:`hf_clip_vision_differences`)."""
        vision = {**HF_CLIP_VISION_DEFAULTS, **vision_config}
        bad = hf_clip_vision_differences(self, vision, prefix)
        if bad:
            fix = {"act_layer": repr(HF_ACTS.get(vision["hidden_act"], vision["hidden_act"])),
                   "norm_layer": f"vitlab.models.hf_layernorm({vision['layer_norm_eps']:g})"}
            if any(b.startswith(f"{prefix}num_attention_heads ") for b in bad):
                fix["num_heads"] = vision["num_attention_heads"]
            if any(b.startswith("pooling ") for b in bad):
                fix["global_pool"] = "'token'"
            raise ValueError(f"{source}: its image tower uses {', '.join(bad)}: create it with "
                             f"{', '.join(f'{k}={v}' for k, v in fix.items())}")

    @staticmethod
    def checkpoint_filter_fn(state_dict: dict, model: VisionTransformer) -> dict:
        """transformers' names (:func:`convert_hf_clip_vision_state_dict`) or timm's (``norm_pre`` -> the
        pre-norm) -> ours, then the ViT's own adaptation (position embedding resampled to the model's grid)."""
        if is_hf_clip_state_dict(state_dict):
            state_dict = convert_hf_clip_vision_state_dict(state_dict)
        state_dict = {("pos_drop.norm." + k[len("norm_pre."):] if k.startswith("norm_pre.") else k): v
                      for k, v in state_dict.items()}
        return vit_checkpoint_filter_fn(state_dict, model)


def clip_vision_transformer(vision_config: dict | None = None, **kwargs) -> CLIPVisionTransformer:
    """CLIP's ViT image tower with its pre-norm, ``num_classes=0`` (pooled output: ``pooler_output``), sized by a
    transformers ``CLIPVisionConfig`` dict; ``kwargs`` override the ViT arguments (``drop_path_rate=0.1``)."""
    return CLIPVisionTransformer(**{**hf_clip_vision_kwargs(vision_config or {}), "num_classes": 0, **kwargs})


def _fuse_qkv(sd: dict, src: str, dst: str) -> dict:
    """``src``{q,k,v}_proj.{weight,bias} -> ``dst``qkv.{weight,bias}."""
    return {f"{dst}qkv.{p}": torch.cat([sd[f"{src}{x}_proj.{p}"] for x in "qkv"]) for p in ("weight", "bias")}


def convert_hf_clip_tower(sd: dict, src: str, dst: str, vision: bool = True) -> dict:
    """The tensors of one transformers CLIP tower (keys under ``src``: ``vision_model.`` or ``text_model.``) in
    vitlab's names under ``dst``; the text tower's position table stays (N, D) and its token embedding keeps its
    name."""
    out = {}
    for k, v in sd.items():
        if not k.startswith(src):
            continue
        rest = k[len(src):]
        m = re.match(r"encoder\.layers\.(\d+)\.(.*)", rest)
        if m:
            i, name = m.groups()
            if re.match(r"self_attn\.[qkv]_proj\.", name):
                if name == "self_attn.q_proj.weight":
                    out.update(_fuse_qkv(sd, f"{src}encoder.layers.{i}.self_attn.", f"{dst}blocks.{i}.attn."))
                continue
            for old, new in _LAYER:
                if name.startswith(old):
                    name = new + name[len(old):]
                    break
            out[f"{dst}blocks.{i}.{name}"] = v
        elif rest == "embeddings.class_embedding":
            out[dst + "cls_token"] = v.reshape(1, 1, -1)
        elif rest == "embeddings.patch_embedding.weight":
            out[dst + "patch_embed.proj.weight"] = v
        elif rest == "embeddings.position_embedding.weight":
            out[dst + "pos_embed"] = v[None] if vision else v
        elif rest == "embeddings.token_embedding.weight":
            out[dst + "token_embedding.weight"] = v
        elif rest.startswith("pre_layrnorm."):
            out[dst + "pos_drop.norm." + rest.split(".")[-1]] = v
        elif rest.startswith(("post_layernorm.", "final_layer_norm.")):
            out[dst + "norm." + rest.split(".")[-1]] = v
        elif rest != "embeddings.position_ids":  # a buffer older releases saved; anything else is left for the
            out[dst + rest] = v  # strict load to name
    return out


def convert_hf_clip_vision_state_dict(sd: dict[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """The vision tower of a transformers CLIP state dict (the keys under ``prefix``, with or without
    ``vision_model.``: transformers 5 saves a bare ``CLIPVisionModel`` without it) in the names of
    :func:`clip_vision_transformer`'s ViT. Other keys are left out."""
    src = prefix + "vision_model." if f"{prefix}vision_model.embeddings.class_embedding" in sd else prefix
    if f"{src}embeddings.class_embedding" not in sd:
        raise ValueError(f"no CLIP vision tower under {prefix or 'the top level'!r} of this state dict "
                         f"(no '{src}embeddings.class_embedding')")
    skip = tuple(src + k for k in ("text_model.", "visual_projection.", "text_projection.", "logit_scale"))
    return convert_hf_clip_tower({k: v for k, v in sd.items() if not k.startswith(skip)}, src, "")


def is_hf_clip_state_dict(sd: dict) -> bool:
    """A transformers ``CLIPModel`` or ``CLIPVisionModel`` state dict (either prefix)."""
    return any(k in sd for k in ("vision_model.embeddings.class_embedding", "embeddings.class_embedding"))


def convert_hf_clip_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A transformers ``CLIPModel`` state dict in the names of vitlab's ``vitlab.clip.CLIP`` (its image tower
    ``visual.trunk`` is this module's ViT; the text tower ``text``: the same layer names)."""
    if "vision_model.embeddings.class_embedding" not in sd or "text_model.embeddings.token_embedding.weight" not in sd:
        raise ValueError("not a transformers CLIPModel state dict (no 'vision_model.' and 'text_model.' towers)")
    out = {**convert_hf_clip_tower(sd, "vision_model.", "visual.trunk."),
           **convert_hf_clip_tower(sd, "text_model.", "text.", vision=False)}
    for k, v in sd.items():
        if k == "visual_projection.weight":
            out["visual.proj.weight"] = v
        elif k == "text_projection.weight":
            out["text.proj.weight"] = v
        elif k == "logit_scale":
            out[k] = v.reshape(1)
        elif not k.startswith(("vision_model.", "text_model.")):
            out[k] = v
    return out


# ---- OpenAI's image towers (Radford et al., 2021, Table 20), timm's names ----------------------------------------

_CLIP_PAPER = "Radford et al., Learning Transferable Visual Models From Natural Language Supervision, ICML 2021"


def _tower_cfg(size: int, patch: int) -> ModelConfig:
    return ModelConfig(family="vit", paper=_CLIP_PAPER, input_size=(3, size, size), mean=OPENAI_MEAN, std=OPENAI_STD,
                       crop_pct=1.0, num_classes=0, extra={"patch_size": patch},
                       smoke_kwargs={"img_size": 2 * patch, "depth": 2})


def _tower(size: int, patch: int, width: int, depth: int, heads: int, kwargs: dict) -> CLIPVisionTransformer:
    return clip_vision_transformer({"image_size": size, "patch_size": patch, "hidden_size": width,
                                    "intermediate_size": 4 * width, "num_hidden_layers": depth,
                                    "num_attention_heads": heads, "hidden_act": "quick_gelu"}, **kwargs)


@register_model(config=_tower_cfg(224, 32))
def vit_base_patch32_clip_quickgelu_224(**kwargs) -> CLIPVisionTransformer:
    """CLIP ViT-B/32's image tower (width 768, 12 blocks, QuickGELU)."""
    return _tower(224, 32, 768, 12, 12, kwargs)


@register_model(config=_tower_cfg(224, 16))
def vit_base_patch16_clip_quickgelu_224(**kwargs) -> CLIPVisionTransformer:
    """CLIP ViT-B/16's image tower (width 768, 12 blocks, QuickGELU)."""
    return _tower(224, 16, 768, 12, 12, kwargs)


@register_model(config=_tower_cfg(224, 14))
def vit_large_patch14_clip_quickgelu_224(**kwargs) -> CLIPVisionTransformer:
    """CLIP ViT-L/14's image tower (width 1024, 24 blocks, QuickGELU)."""
    return _tower(224, 14, 1024, 24, 16, kwargs)


@register_model(config=_tower_cfg(336, 14))
def vit_large_patch14_clip_quickgelu_336(**kwargs) -> CLIPVisionTransformer:
    """CLIP ViT-L/14 at 336 px (LLaVA-1.5's image tower)."""
    return _tower(336, 14, 1024, 24, 16, kwargs)
