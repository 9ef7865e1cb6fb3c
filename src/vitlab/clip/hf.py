"""Hugging Face CLIP checkpoints (``transformers``' ``CLIPModel``, ``CLIPVisionModel``,
``CLIPVisionModelWithProjection`` saved by ``save_pretrained``) for vitlab's CLIP of Radford et al., 2021,
"Learning Transferable Visual Models From Natural Language Supervision".

The towers compute the same functions as vitlab's (Sec. 2.4 of the paper: a ViT with an extra LayerNorm on the
embedded tokens before the first block, ``pre_layrnorm``; a causal text transformer pooled at the end-of-text
token; both usually with QuickGELU, ``hidden_act='quick_gelu'``, the activation OpenAI trained with); only the names
and the fused attention projection differ:

=========================================================  ==============================================
transformers (``vision_model.`` / ``text_model.``)          vitlab (``visual.trunk.`` / ``text.``)
=========================================================  ==============================================
``embeddings.patch_embedding.weight``                      ``patch_embed.proj.weight`` (no bias)
``embeddings.class_embedding`` (D,)                        ``cls_token`` (1, 1, D)
``embeddings.position_embedding.weight`` (N, D)            ``pos_embed`` (1, N, D) / text ``pos_embed`` (N, D)
``embeddings.token_embedding.weight``                      ``token_embedding.weight``
``pre_layrnorm``                                           ``pos_drop.norm`` (CLIP's pre-norm)
``encoder.layers.i.layer_norm1`` / ``layer_norm2``         ``blocks.i.norm1`` / ``norm2``
``encoder.layers.i.self_attn.{q,k,v}_proj``                ``blocks.i.attn.qkv`` (rows q, k, v)
``encoder.layers.i.self_attn.out_proj``                    ``blocks.i.attn.proj``
``encoder.layers.i.mlp.fc1`` / ``fc2``                     ``blocks.i.mlp.fc1`` / ``fc2``
``post_layernorm`` / ``final_layer_norm``                  ``norm``
``visual_projection`` / ``text_projection``                ``visual.proj`` / ``text.proj``
``logit_scale`` ()                                         ``logit_scale`` (1,)
=========================================================  ==============================================

transformers 5 saves a bare ``CLIPVisionModel`` without the ``vision_model.`` prefix, earlier releases with it;
both load. ``CLIPVisionModel``'s output (``pooler_output``: the post-LayerNorm [CLS] token) is a vitlab ViT's
pooled features, so :func:`clip_vision_from_hf` gives that ViT (``num_classes=0``, the pre-norm swapped in), which
also serves as the image tower of other models (its ``forward_intermediates`` gives every block's tokens).

Text pooling: vitlab pools at the largest token id (the end-of-text token of CLIP's vocabulary);
transformers pools at the first ``eos_token_id`` (or the largest id when ``eos_token_id == 2``, its legacy
configs). A checkpoint whose end-of-text id is neither is refused rather than pooled elsewhere.
"""

from __future__ import annotations

import re
from functools import partial

import torch
import torch.nn as nn

from vitlab.clip.model import CLIP, OPENAI_MEAN, OPENAI_STD, ImageTower, PreNorm, build_clip, clip_vit_kwargs
from vitlab.convert import load_state_dict, read_hf_config, read_hf_state_dict
from vitlab.registry import ModelConfig, create_model

# transformers' activation names -> vitlab's (``gelu_new`` and ``gelu_pytorch_tanh`` are both the tanh form)
HF_ACTS = {"quick_gelu": "quick_gelu", "gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
_PAPER = "Radford et al., Learning Transferable Visual Models From Natural Language Supervision, ICML 2021"
CLIP_ARCHITECTURES = ("CLIPModel",)
CLIP_VISION_ARCHITECTURES = ("CLIPVisionModel", "CLIPVisionModelWithProjection")
# transformers' CLIPVisionConfig defaults (openai/clip-vit-base-patch32), for keys a config.json leaves out
_VISION_DEFAULTS = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                        num_channels=3, image_size=224, patch_size=32, hidden_act="quick_gelu", layer_norm_eps=1e-5)
_TEXT_DEFAULTS = dict(vocab_size=49408, hidden_size=512, intermediate_size=2048, num_hidden_layers=12,
                      num_attention_heads=8, max_position_embeddings=77, hidden_act="quick_gelu",
                      layer_norm_eps=1e-5, eos_token_id=49407)
_LAYER = [("layer_norm1.", "norm1."), ("layer_norm2.", "norm2."), ("self_attn.out_proj.", "attn.proj."),
          ("mlp.fc1.", "mlp.fc1."), ("mlp.fc2.", "mlp.fc2.")]


def hf_act(name: str) -> str:
    """vitlab's name of a transformers activation (``hidden_act``)."""
    if name not in HF_ACTS:
        raise ValueError(f"unsupported activation hidden_act={name!r}; supported: {', '.join(sorted(HF_ACTS))}")
    return HF_ACTS[name]


def hf_layernorm(eps: float):
    """vitlab's norm for a transformers ``layer_norm_eps``: the registered name where one exists."""
    return "layernorm_eps5" if eps == 1e-5 else partial(nn.LayerNorm, eps=eps)


def _mlp_ratio(cfg: dict) -> float:
    ratio = cfg["intermediate_size"] / cfg["hidden_size"]
    if int(cfg["hidden_size"] * ratio) != cfg["intermediate_size"]:
        raise ValueError(f"intermediate_size {cfg['intermediate_size']} is not a whole multiple of hidden_size "
                         f"{cfg['hidden_size']} that vitlab's MLP can express")
    return ratio


def clip_vision_kwargs(vision_config: dict) -> dict:
    """The :class:`vitlab.models.VisionTransformer` arguments of a transformers ``CLIPVisionConfig`` (a dict):
    CLIP's ViT (no patch-projection bias, [CLS] pooling) at the config's sizes, activation and LayerNorm eps."""
    c = {**_VISION_DEFAULTS, **vision_config}
    return {**clip_vit_kwargs(), "img_size": c["image_size"], "patch_size": c["patch_size"],
            "in_chans": c["num_channels"], "embed_dim": c["hidden_size"], "depth": c["num_hidden_layers"],
            "num_heads": c["num_attention_heads"], "mlp_ratio": _mlp_ratio(c), "act_layer": hf_act(c["hidden_act"]),
            "norm_layer": hf_layernorm(c["layer_norm_eps"])}


def clip_vision_trunk(vision_config: dict, **kwargs) -> nn.Module:
    """The ViT that computes transformers' ``CLIPVisionModel`` (``num_classes=0``: its pooled output is
    ``pooler_output``), with CLIP's pre-norm; ``kwargs`` override the ViT arguments (``drop_path_rate=0.1``)."""
    kw = {**clip_vision_kwargs(vision_config), **kwargs}
    trunk = create_model("vit_base_patch16_224", num_classes=0, **kw)
    trunk.pos_drop = PreNorm(trunk.pos_drop, trunk.embed_dim, kw["norm_layer"])
    return trunk


def clip_text_kwargs(text_config: dict) -> dict:
    """The :class:`vitlab.clip.TextTransformer` arguments of a transformers ``CLIPTextConfig`` (a dict)."""
    c = {**_TEXT_DEFAULTS, **text_config}
    if c["layer_norm_eps"] != 1e-5:
        raise ValueError(f"CLIP's text tower uses LayerNorm eps 1e-5; this config has {c['layer_norm_eps']}")
    if c["eos_token_id"] not in (2, c["vocab_size"] - 1):
        raise ValueError(f"the text tower pools at the largest token id, but this config's end-of-text token is "
                         f"{c['eos_token_id']} of a vocabulary of {c['vocab_size']}")
    return dict(vocab_size=c["vocab_size"], context_length=c["max_position_embeddings"], width=c["hidden_size"],
                depth=c["num_hidden_layers"], num_heads=c["num_attention_heads"], mlp_ratio=_mlp_ratio(c),
                act_layer=hf_act(c["hidden_act"]))


def _fuse_qkv(sd: dict, src: str, dst: str) -> dict:
    """``src``{q,k,v}_proj.{weight,bias} -> ``dst``qkv.{weight,bias}."""
    return {f"{dst}qkv.{p}": torch.cat([sd[f"{src}{x}_proj.{p}"] for x in "qkv"]) for p in ("weight", "bias")}


def _tower(sd: dict, src: str, dst: str, vision: bool) -> dict:
    """The tensors of one transformers tower (keys under ``src``) in vitlab's names under ``dst``."""
    out = {}
    for k, v in sd.items():
        if not k.startswith(src):
            continue
        rest = k[len(src):]
        m = re.match(r"encoder\.layers\.(\d+)\.(.*)", rest)
        if m:
            i, name = m.groups()
            if re.match(r"self_attn\.[qkv]_proj\.", name):
                if name.startswith("self_attn.q_proj.weight"):
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
        elif rest != "embeddings.position_ids":  # position_ids: a buffer older releases saved; anything else is
            out[dst + rest] = v  # left for the strict load to name
    return out


def is_hf_clip_state_dict(sd: dict) -> bool:
    """A transformers ``CLIPModel`` or ``CLIPVisionModel`` state dict (either prefix)."""
    return any(k in sd for k in ("vision_model.embeddings.class_embedding", "embeddings.class_embedding"))


def convert_hf_clip_vision_state_dict(sd: dict[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """The vision tower of a transformers CLIP state dict (the keys under ``prefix``, with or without
    ``vision_model.``) in the names of :func:`clip_vision_trunk`'s ViT. Other keys are left out."""
    src = prefix + "vision_model." if f"{prefix}vision_model.embeddings.class_embedding" in sd else prefix
    if f"{src}embeddings.class_embedding" not in sd:
        raise ValueError(f"no CLIP vision tower under {prefix or 'the top level'!r} of this state dict "
                         f"(no '{src}embeddings.class_embedding')")
    body = {k: v for k, v in sd.items() if k.startswith(src) and not k.startswith(src + "text_model.")}
    return _tower(body, src, "", vision=True)


def convert_hf_clip_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A transformers ``CLIPModel`` state dict in the names of vitlab's :class:`CLIP` (see the module table)."""
    if "vision_model.embeddings.class_embedding" not in sd or "text_model.embeddings.token_embedding.weight" not in sd:
        raise ValueError("not a transformers CLIPModel state dict (no 'vision_model.' and 'text_model.' towers)")
    out = {**_tower(sd, "vision_model.", "visual.trunk.", vision=True),
           **_tower(sd, "text_model.", "text.", vision=False)}
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


def _pretrained_cfg(name: str, task: str, vision_config: dict) -> ModelConfig:
    c = {**_VISION_DEFAULTS, **vision_config}
    return ModelConfig(name=name, family="clip", task=task, paper=_PAPER, mean=OPENAI_MEAN, std=OPENAI_STD,
                       crop_pct=1.0, num_classes=0, input_size=(c["num_channels"], c["image_size"], c["image_size"]))



def clip_from_hf(path: str) -> CLIP:
    """A vitlab :class:`CLIP` with the architecture (``config.json``) and weights of a transformers ``CLIPModel``
    directory. Image and text embeddings equal ``get_image_features`` / ``get_text_features``."""
    cfg = read_hf_config(path, architectures=CLIP_ARCHITECTURES)
    vision, text = cfg.get("vision_config", {}), cfg.get("text_config", {})
    image_kwargs = clip_vision_kwargs(vision)
    model = build_clip(cfg.get("projection_dim", 512), "vit_base_patch16_224", image_kwargs, clip_text_kwargs(text))
    model = load_state_dict(model, convert_hf_clip_state_dict(read_hf_state_dict(path)), source=str(path))
    model.pretrained_cfg = _pretrained_cfg("clip_hf", "contrastive", vision)
    return model


def clip_vision_from_hf(path: str) -> nn.Module:
    """The image tower of a transformers ``CLIPVisionModel`` directory as vitlab's ViT (its output is
    ``pooler_output``), or of a ``CLIPVisionModelWithProjection`` as an :class:`ImageTower` (output
    ``image_embeds``)."""
    cfg = read_hf_config(path, architectures=CLIP_VISION_ARCHITECTURES)
    sd = read_hf_state_dict(path)
    trunk_sd = convert_hf_clip_vision_state_dict(sd)
    if "visual_projection.weight" in sd:
        tower = ImageTower("vit_base_patch16_224", cfg.get("projection_dim", 512), pre_norm=True,
                           **clip_vision_kwargs(cfg))
        model = load_state_dict(tower, {**{f"trunk.{k}": v for k, v in trunk_sd.items()},
                                        "proj.weight": sd["visual_projection.weight"]}, source=str(path))
    else:
        model = load_state_dict(clip_vision_trunk(cfg), trunk_sd, source=str(path))
    model.pretrained_cfg = _pretrained_cfg("clip_vision_hf", "contrastive", cfg)
    return model
