"""The registered CLIP configurations (task ``contrastive``: image and text embeddings in one space): the ViT-B/32,
ViT-B/16 and ViT-L/14 models of Radford et al., 2021, "Learning Transferable Visual Models From Natural Language
Supervision" (open_clip's ``ViT-B-32``, ``ViT-B-16``, ``ViT-L-14``), and two tiny ones for tests and the offline
digits demo. :mod:`vitlab.registry` imports this module on its first listing or lookup, so
``vitlab.create_model("clip_vit_base_patch16")`` works after a bare ``import vitlab``.
"""

from __future__ import annotations

from vitlab.clip.model import CLIP, PICO_TEXT, build_clip, clip_vit_kwargs
from vitlab.models import OPENAI_MEAN, OPENAI_STD
from vitlab.registry import ModelConfig, register_model

_PAPER = "Radford et al., Learning Transferable Visual Models From Natural Language Supervision, ICML 2021"
_CLIP_TEXT = dict(vocab_size=49408, context_length=77, width=512, depth=12, num_heads=8)
_SMOKE = {"image_depth": 1, "text_depth": 1, "img_size": 32, "text_vocab_size": 512}


def _cfg(**kw) -> ModelConfig:
    base = dict(family="clip", task="contrastive", paper=_PAPER, mean=OPENAI_MEAN, std=OPENAI_STD, crop_pct=1.0,
                num_classes=0, smoke_kwargs=_SMOKE)
    return ModelConfig(**{**base, **kw})


@register_model(config=_cfg(published_params_m=149.62, extra={"openclip": "ViT-B-16"}))
def clip_vit_base_patch16(**kwargs) -> CLIP:
    """CLIP ViT-B/16: ViT-B/16 image tower, 12-layer width-512 text tower, 512-d embedding (open_clip ViT-B-16)."""
    return build_clip(512, "vit_base_patch16_224", clip_vit_kwargs(), _CLIP_TEXT, **kwargs)


@register_model(config=_cfg(published_params_m=151.28, smoke_kwargs={**_SMOKE, "img_size": 64},
                            extra={"openclip": "ViT-B-32"}))
def clip_vit_base_patch32(**kwargs) -> CLIP:
    """CLIP ViT-B/32 (open_clip ViT-B-32)."""
    return build_clip(512, "vit_base_patch32_224", clip_vit_kwargs(), _CLIP_TEXT, **kwargs)


@register_model(config=_cfg(published_params_m=427.62, smoke_kwargs={**_SMOKE, "img_size": 28},
                            extra={"openclip": "ViT-L-14"}))
def clip_vit_large_patch14(**kwargs) -> CLIP:
    """CLIP ViT-L/14: ViT-L with 14x14 patches, 12-layer width-768 text tower, 768-d embedding (open_clip ViT-L-14)."""
    return build_clip(768, "vit_large_patch16_224", {**clip_vit_kwargs(), "patch_size": 14},
                      {**_CLIP_TEXT, "width": 768, "num_heads": 12}, **kwargs)


# Tiny configurations for tests and the offline digits demo: vitlab's ViT-pico (32x32 grayscale digits, 8x8
# patches, average-pooled patch tokens as the pico classifier: on ~1,300 images it learns far faster than [CLS]
# pooling, which starts with nearly the same feature for every image) and the tiny text tower.
_PICO_IMAGE = {**clip_vit_kwargs(), "global_pool": "avg"}
_PICO_SMOKE = {"image_depth": 1, "text_depth": 1}


@register_model(config=_cfg(input_size=(1, 32, 32), mean=(0.5,), std=(0.5,), smoke_kwargs=_PICO_SMOKE))
def clip_vit_pico_patch8(**kwargs) -> CLIP:
    """A tiny CLIP: ViT-pico/8 image tower (pre-norm, average pooling), CLIP text tower of width 64, 64-d
    embedding."""
    return build_clip(64, "vit_pico_patch8_32", _PICO_IMAGE, PICO_TEXT, **kwargs)


@register_model(config=_cfg(input_size=(1, 32, 32), mean=(0.5,), std=(0.5,), smoke_kwargs=_PICO_SMOKE,
                            paper=_PAPER + "; text tower: Touvron et al., Llama 2, 2023"))
def clip_vit_pico_patch8_llama(**kwargs) -> CLIP:
    """A tiny CLIP whose text tower is Llama-style: 1-D RoPE, RMSNorm, SwiGLU, causal mask (Touvron et al., 2023)."""
    return build_clip(64, "vit_pico_patch8_32", _PICO_IMAGE, {**PICO_TEXT, "style": "llama"}, **kwargs)
