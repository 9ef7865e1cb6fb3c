"""Dense prediction over Vision Transformer backbones: segmentation and monocular depth (seed 001, section 21.4)."""

from vitlab.dense import metrics

__all__ = ["metrics"]
