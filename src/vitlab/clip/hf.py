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
both load. The vision half of the map and CLIP's ViT itself are in :mod:`vitlab.models.clip_vit` (vision-language
models use that image tower too); ``CLIPVisionModel``'s output (``pooler_output``: the post-LayerNorm [CLS] token)
is that ViT's pooled features, so :func:`clip_vision_from_hf` gives the ViT (``num_classes=0``).

Text pooling: vitlab pools at the largest token id (the end-of-text token of CLIP's vocabulary);
transformers pools at the first ``eos_token_id`` (or the largest id when ``eos_token_id == 2``, its legacy
configs). A checkpoint whose end-of-text id is neither is refused rather than pooled elsewhere.
"""

from __future__ import annotations

import torch.nn as nn

from vitlab.clip.model import CLIP, HF_CLIP_TEXT_DEFAULTS, ImageTower, build_clip, hf_eos_at_largest_id
from vitlab.convert import load_state_dict, read_hf_config, read_hf_state_dict
from vitlab.models import (
    CLIP_ARCHITECTURES,
    CLIP_VISION_ARCHITECTURES,
    HF_CLIP_VISION_DEFAULTS,
    OPENAI_MEAN,
    OPENAI_STD,
    clip_vision_transformer,
    convert_hf_clip_state_dict,
    convert_hf_clip_vision_state_dict,
    hf_act,
    hf_clip_vision_kwargs,
    hf_mlp_ratio,
)
from vitlab.registry import ModelConfig

_PAPER = "Radford et al., Learning Transferable Visual Models From Natural Language Supervision, ICML 2021"


def clip_text_kwargs(text_config: dict) -> dict:
    """The :class:`vitlab.clip.TextTransformer` arguments of a transformers ``CLIPTextConfig`` (a dict)."""
    c = {**HF_CLIP_TEXT_DEFAULTS, **text_config}
    if not hf_eos_at_largest_id(c["eos_token_id"], c["vocab_size"]):
        raise ValueError(f"the text tower pools at the largest token id, but this config's end-of-text token is "
                         f"{c['eos_token_id']} of a vocabulary of {c['vocab_size']}")
    return dict(vocab_size=c["vocab_size"], context_length=c["max_position_embeddings"], width=c["hidden_size"],
                depth=c["num_hidden_layers"], num_heads=c["num_attention_heads"], mlp_ratio=hf_mlp_ratio(c),
                act_layer=hf_act(c["hidden_act"]), norm_eps=c["layer_norm_eps"])


def _pretrained_cfg(name: str, task: str, vision_config: dict) -> ModelConfig:
    c = {**HF_CLIP_VISION_DEFAULTS, **vision_config}
    return ModelConfig(name=name, family="clip", task=task, paper=_PAPER, mean=OPENAI_MEAN, std=OPENAI_STD,
                       crop_pct=1.0, num_classes=0, input_size=(c["num_channels"], c["image_size"], c["image_size"]))



def clip_from_hf(path: str) -> CLIP:
    """A vitlab :class:`CLIP` with the architecture (``config.json``) and weights of a transformers ``CLIPModel``
    directory. Image and text embeddings equal ``get_image_features`` / ``get_text_features``."""
    cfg = read_hf_config(path, architectures=CLIP_ARCHITECTURES)
    vision, text = cfg.get("vision_config", {}), cfg.get("text_config", {})
    image_kwargs = hf_clip_vision_kwargs(vision)
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
                           **hf_clip_vision_kwargs(cfg))
        model = load_state_dict(tower, {**{f"trunk.{k}": v for k, v in trunk_sd.items()},
                                        "proj.weight": sd["visual_projection.weight"]}, source=str(path))
    else:
        model = load_state_dict(clip_vision_transformer(cfg), trunk_sd, source=str(path))
    model.pretrained_cfg = _pretrained_cfg("clip_vision_hf", "contrastive", cfg)
    return model
