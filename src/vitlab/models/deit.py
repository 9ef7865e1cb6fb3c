"""DeiT (Touvron et al., 2021, "Training data-efficient image transformers & distillation through
attention"): the ViT architecture trained with the DeiT recipe, and the distilled variants that append a
distillation token with its own head. In training a distilled model returns ``(cls_logits, dist_logits)``;
in eval it returns their mean."""

from __future__ import annotations

from vitlab.models.vision_transformer import VisionTransformer, build_vit
from vitlab.registry import ModelConfig, register_model

_PAPER = "Touvron et al., Training data-efficient image transformers & distillation through attention, ICML 2021"


def _cfg(tag: str, params: float, gmacs: float, top1: float) -> ModelConfig:
    return ModelConfig(family="deit", paper=_PAPER, crop_pct=0.875, published_params_m=params,
                       published_gmacs=gmacs, published_top1=top1, hf_hub_id=f"timm/{tag}.fb_in1k",
                       extra={"patch_size": 16}, smoke_kwargs={"img_size": 32, "depth": 2})


@register_model(config=_cfg("deit_tiny_patch16_224", 5.72, 1.26, 72.2))
def deit_tiny_patch16_224(**kwargs) -> VisionTransformer:
    return build_vit("tiny", 16, **kwargs)


@register_model(config=_cfg("deit_small_patch16_224", 22.05, 4.61, 79.9))
def deit_small_patch16_224(**kwargs) -> VisionTransformer:
    return build_vit("small", 16, **kwargs)


@register_model(config=_cfg("deit_base_patch16_224", 86.57, 17.58, 81.8))
def deit_base_patch16_224(**kwargs) -> VisionTransformer:
    return build_vit("base", 16, **kwargs)


@register_model(config=_cfg("deit_tiny_distilled_patch16_224", 5.91, 1.27, 74.5))
def deit_tiny_distilled_patch16_224(**kwargs) -> VisionTransformer:
    return build_vit("tiny", 16, dist_token=True, **kwargs)


@register_model(config=_cfg("deit_small_distilled_patch16_224", 22.44, 4.63, 81.2))
def deit_small_distilled_patch16_224(**kwargs) -> VisionTransformer:
    return build_vit("small", 16, dist_token=True, **kwargs)


@register_model(config=_cfg("deit_base_distilled_patch16_224", 87.34, 17.68, 83.4))
def deit_base_distilled_patch16_224(**kwargs) -> VisionTransformer:
    return build_vit("base", 16, dist_token=True, **kwargs)
