"""The registered end-to-end dense configurations: a head over a backbone at the paper's input size, models of
the one registry with task ``segment`` (150 classes: ADE20K's) or ``depth``, so ``vitlab.create_model`` builds
them and ``vitlab models --task segment`` lists them. :mod:`vitlab.registry` imports this module on its first
listing or lookup. Keyword arguments override the configuration's :func:`vitlab.dense.create` arguments
(``num_classes``, ``img_size``, ``task``, ``head_kwargs`` ...); ``checkpoint_path`` loads ours or a Hugging Face
DPT state dict.

- DPT (Ranftl et al., 2021, "Vision Transformers for Dense Prediction", ICCV): DPT-Base (ViT-B/16) and DPT-Large
  (ViT-L/16) at 384, each with the segmentation and with the depth head.
- SETR (Zheng et al., 2021, CVPR): naive, PUP and MLA decoders over ViT-L/16 at 512.
- Segmenter (Strudel et al., 2021, ICCV): linear and mask-transformer decoders over ViT-S/16 and ViT-B/16 at 512.
- ViTDet (Li et al., 2022, ECCV): the simple feature pyramid over a windowed ViT-B/16 at 1024.
- ViT-Adapter (Chen et al., 2023, ICLR) over ViT-S/16 at 512.
- DINOv2's linear depth head (Oquab et al., 2024, TMLR) over ViT-S/16 at 448.
"""

from __future__ import annotations

from functools import partial

import torch.nn as nn

from vitlab.dense.model import DenseModel, create
from vitlab.registry import INCEPTION_MEAN, INCEPTION_STD, ModelConfig, register_model

_DPT = "Ranftl et al., Vision Transformers for Dense Prediction, ICCV 2021"
_SETR = "Zheng et al., Rethinking Semantic Segmentation from a Sequence-to-Sequence Perspective, CVPR 2021"
_SEG = "Strudel et al., Segmenter: Transformer for Semantic Segmentation, ICCV 2021"
_VITDET = "Li et al., Exploring Plain Vision Transformer Backbones for Object Detection, ECCV 2022"
_ADAPTER = "Chen et al., Vision Transformer Adapter for Dense Predictions, ICLR 2023"
_DINO2 = "Oquab et al., DINOv2: Learning Robust Visual Features without Supervision, TMLR 2024"
# Hugging Face's DPT configs use LayerNorm eps 1e-12 in the ViT (timm's is 1e-6): kept so HF weights predict alike
_HF_LN = {"norm_layer": partial(nn.LayerNorm, eps=1e-12)}
_DPT_LARGE = {"hidden": (256, 512, 1024, 1024)}


def _cfg(paper: str, size: int, task: str = "segment") -> ModelConfig:
    return ModelConfig(family="dense", task=task, paper=paper, input_size=(3, size, size), mean=INCEPTION_MEAN,
                       std=INCEPTION_STD, crop_pct=1.0, num_classes=150 if task == "segment" else 1)


def _dense(head: str, backbone: str, size: int, kwargs: dict, **spec) -> DenseModel:
    """:func:`create` with the configuration's arguments (``spec``, its input ``size``), overridden by ``kwargs``."""
    return create(head, backbone, **{"img_size": size, **spec, **kwargs})


@register_model(config=_cfg(_DPT, 384))
def dpt_vit_base_patch16_384(**kwargs) -> DenseModel:
    """DPT-Base: ViT-B/16 read at blocks 2, 5, 8, 11, reassembled and fused, the segmentation head."""
    return _dense("dpt", "vit_base_patch16_224", 384, kwargs, backbone_kwargs=_HF_LN)


@register_model(config=_cfg(_DPT, 384, task="depth"))
def dpt_vit_base_patch16_384_depth(**kwargs) -> DenseModel:
    """DPT-Base with the monocular depth head."""
    return _dense("dpt", "vit_base_patch16_224", 384, kwargs, task="depth", backbone_kwargs=_HF_LN)


@register_model(config=_cfg(_DPT, 384))
def dpt_vit_large_patch16_384(**kwargs) -> DenseModel:
    """DPT-Large: ViT-L/16 read at blocks 5, 11, 17, 23, the segmentation head."""
    return _dense("dpt", "vit_large_patch16_224", 384, kwargs, backbone_kwargs=_HF_LN, head_kwargs=_DPT_LARGE)


@register_model(config=_cfg(_DPT, 384, task="depth"))
def dpt_vit_large_patch16_384_depth(**kwargs) -> DenseModel:
    """DPT-Large with the monocular depth head."""
    return _dense("dpt", "vit_large_patch16_224", 384, kwargs, task="depth", backbone_kwargs=_HF_LN,
                  head_kwargs=_DPT_LARGE)


@register_model(config=_cfg(_SETR, 512))
def setr_naive_vit_large_patch16_512(**kwargs) -> DenseModel:
    """SETR-Naive over ViT-L/16: two 1x1 convs on the last block's map."""
    return _dense("setr_naive", "vit_large_patch16_224", 512, kwargs)


@register_model(config=_cfg(_SETR, 512))
def setr_pup_vit_large_patch16_512(**kwargs) -> DenseModel:
    """SETR-PUP over ViT-L/16: progressive 2x upsampling stages on the last block's map."""
    return _dense("setr_pup", "vit_large_patch16_224", 512, kwargs)


@register_model(config=_cfg(_SETR, 512))
def setr_mla_vit_large_patch16_512(**kwargs) -> DenseModel:
    """SETR-MLA over ViT-L/16: multi-level aggregation of four evenly spaced blocks."""
    return _dense("setr_mla", "vit_large_patch16_224", 512, kwargs)


@register_model(config=_cfg(_SEG, 512))
def segmenter_linear_vit_small_patch16_512(**kwargs) -> DenseModel:
    """Segmenter's linear decoder over ViT-S/16."""
    return _dense("segmenter_linear", "vit_small_patch16_224", 512, kwargs)


@register_model(config=_cfg(_SEG, 512))
def segmenter_mask_vit_small_patch16_512(**kwargs) -> DenseModel:
    """Segmenter's mask transformer over ViT-S/16."""
    return _dense("segmenter_mask", "vit_small_patch16_224", 512, kwargs)


@register_model(config=_cfg(_SEG, 512))
def segmenter_mask_vit_base_patch16_512(**kwargs) -> DenseModel:
    """Segmenter's mask transformer over ViT-B/16."""
    return _dense("segmenter_mask", "vit_base_patch16_224", 512, kwargs)


@register_model(config=_cfg(_VITDET, 1024))
def vitdet_sfp_vit_base_patch16_1024(**kwargs) -> DenseModel:
    """ViTDet: windowed ViT-B/16 (global blocks 2, 5, 8, 11), simple feature pyramid, semantic FPN head."""
    return _dense("vitdet_sfp", "vit_base_patch16_224", 1024, kwargs)


@register_model(config=_cfg(_ADAPTER, 512))
def vit_adapter_vit_small_patch16_512(**kwargs) -> DenseModel:
    """ViT-Adapter around ViT-S/16 (four interactions), semantic FPN head over its pyramid."""
    return _dense("vit_adapter", "vit_small_patch16_224", 512, kwargs)


@register_model(config=_cfg(_DINO2, 448, task="depth"))
def linear_depth_vit_small_patch16_448(**kwargs) -> DenseModel:
    """DINOv2's linear depth head ([CLS] + patch tokens of the last block, 256 bins) over ViT-S/16."""
    return _dense("linear_depth", "vit_small_patch16_224", 448, kwargs, task="depth")
