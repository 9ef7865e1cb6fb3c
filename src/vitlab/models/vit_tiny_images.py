"""Vision Transformers for tiny images (Dosovitskiy et al., 2021, "An Image is Worth 16x16 Words"): the plain
ViT -- patch embedding -> [CLS] + learned position embedding -> pre-norm blocks -> norm -> [CLS] -> linear
head -- shrunk for images of 8 to 32 pixels, where a 16-pixel patch would leave a single token.

``vit_pico_patch8_32`` is the default model of ``vitlab train``: scikit-learn's 8x8 grayscale ``digits``, which
``vitlab.data`` upscales to 32x32, cut into 8x8 patches (2x2 original pixels each) gives a 4x4 grid (16 tokens +
[CLS]); width 64, depth 4, 4 heads, MLP ratio 2, average-pooled patch tokens (~0.14M parameters): small enough to
train to >= 98% test accuracy on two CPU cores in a few minutes. ``vit_pico_patch4_32`` is the same trunk with
4x4 patches for 32x32 RGB images (CIFAR-sized: an 8x8 grid, 64 tokens). ``vit_micro_patch2_28`` is a deeper
trunk for 28x28 grayscale images (MNIST, Fashion-MNIST) cut into 2x2 patches: a 14x14 grid, 196 tokens + [CLS] (as
many as a ViT at 224 px / 16), width 64, depth 12, 2 heads of 32, MLP ratio 2, average-pooled patch tokens as the
pico models (~0.41M parameters): the token count and depth that token merging and pruning (vitlab.tome,
vitlab.prune) act on, small enough to train on one CPU thread.
"""

from __future__ import annotations

from vitlab.models.vision_transformer import VisionTransformer
from vitlab.registry import INCEPTION_MEAN, INCEPTION_STD, ModelConfig, register_model

_PAPER = "Dosovitskiy et al., An Image is Worth 16x16 Words, ICLR 2021"

# Global average pooling of the patch tokens (with fc_norm, as timm's ``*_gap`` ViTs) instead of the class token:
# on ~1,300 training images it reaches a given accuracy in about half the epochs.
_PICO = dict(embed_dim=64, depth=4, num_heads=4, mlp_ratio=2.0, global_pool="avg")


def _build(patch: int, img: int, **kwargs) -> VisionTransformer:
    args = dict(img_size=img, patch_size=patch, **_PICO)
    args.update(kwargs)
    return VisionTransformer(**args)


@register_model(config=ModelConfig(
    family="vit", paper=_PAPER, input_size=(1, 32, 32), mean=INCEPTION_MEAN[:1], std=INCEPTION_STD[:1],
    crop_pct=1.0, num_classes=10, extra={"patch_size": 8}, smoke_kwargs={"depth": 2, "img_size": 16}))
def vit_pico_patch8_32(**kwargs) -> VisionTransformer:
    """ViT-pico/8 on 32x32 single-channel images (width 64, depth 4, 4 heads, MLP 128): 16 patch tokens."""
    kwargs.setdefault("in_chans", 1)
    kwargs.setdefault("num_classes", 10)
    return _build(8, kwargs.pop("img_size", 32), **kwargs)


@register_model(config=ModelConfig(
    family="vit", paper=_PAPER, input_size=(3, 32, 32), mean=INCEPTION_MEAN, std=INCEPTION_STD, crop_pct=1.0,
    num_classes=10, extra={"patch_size": 4}, smoke_kwargs={"depth": 2, "img_size": 16}))
def vit_pico_patch4_32(**kwargs) -> VisionTransformer:
    """ViT-pico/4 on 32x32 images (width 64, depth 4, 4 heads, MLP 128): 64 patch tokens."""
    kwargs.setdefault("num_classes", 10)
    return _build(4, kwargs.pop("img_size", 32), **kwargs)


@register_model(config=ModelConfig(
    family="vit", paper=_PAPER, input_size=(1, 28, 28), mean=INCEPTION_MEAN[:1], std=INCEPTION_STD[:1],
    crop_pct=1.0, num_classes=10, extra={"patch_size": 2}, smoke_kwargs={"depth": 2, "img_size": 8}))
def vit_micro_patch2_28(**kwargs) -> VisionTransformer:
    """ViT-micro/2 on 28x28 single-channel images (width 64, depth 12, 2 heads, MLP 128): 196 patch tokens + [CLS]."""
    micro = dict(in_chans=1, num_classes=10, depth=12, num_heads=2)  # the pico trunk, three times deeper
    return _build(2, kwargs.pop("img_size", 28), **{**micro, **kwargs})
