"""Self-supervised pre-training (seed 001, section 21.3): MAE, SimCLR, MoCo v3, DINO and the DINOv2 objective on
vitlab backbones, their losses (:mod:`vitlab.ssl.losses`), the ``vitlab pretrain`` tasks and frozen-feature
evaluation (linear probe, k-NN: :mod:`vitlab.ssl.probe`).

    import vitlab.ssl
    ssl = vitlab.ssl.create("mae", "vit_pico_patch8_32", decoder_dim=64, decoder_depth=2, decoder_heads=4)
    out = ssl(images)                       # {'loss': ..., 'pred': ..., 'mask': ...}
    ssl = vitlab.ssl.create("dino", "vit_pico_patch8_32", out_dim=1024)
    out = ssl([global1, global2, local1, local2])
    ssl.after_step(step, total_steps, steps_per_epoch)   # after each optimiser step: EMA teacher, schedules
"""

from __future__ import annotations

import inspect

import torch.nn as nn

from vitlab.ssl import losses
from vitlab.ssl.mae import MAE
from vitlab.ssl.methods import DINO, METHODS, DINOv2, MoCoV3, SimCLR

ALL_METHODS = {"mae": MAE, **METHODS}


def create_backbone(method: str, name: str, **kwargs) -> nn.Module:
    """A registered model without classifier (``num_classes=0``) for ``method``; DINO and DINOv2 get a model that
    takes the local crops' size too (``dynamic_img_size=True``) when its family has that option."""
    import vitlab

    kwargs = {"num_classes": 0, **kwargs}
    if method in ("dino", "dinov2") and "dynamic_img_size" not in kwargs:
        try:
            return vitlab.create_model(name, dynamic_img_size=True, **kwargs)
        except (TypeError, ValueError):  # PVT and LITv2 take any size already; Swin takes one size
            pass
    return vitlab.create_model(name, **kwargs)


def create(method: str, backbone: str | nn.Module, backbone_kwargs: dict | None = None, **kwargs) -> nn.Module:
    """The self-supervised module of ``method`` ('mae', 'simclr', 'mocov3', 'dino', 'dinov2') around ``backbone``
    (a registered model name, built headless with ``backbone_kwargs``, or a module). ``kwargs`` are the method's
    options (e.g. ``mask_ratio=0.75`` for MAE, ``out_dim`` for DINO). Its ``forward(batch)`` returns a dict with
    ``loss``; its ``model`` attribute is the backbone."""
    if method not in ALL_METHODS:
        raise ValueError(f"unknown self-supervised method {method!r}; choose from {', '.join(ALL_METHODS)}")
    cls = ALL_METHODS[method]
    allowed = set(inspect.signature(cls.__init__).parameters) - {"self", "backbone", "kwargs"}
    if cls is DINOv2:
        allowed |= set(inspect.signature(DINO.__init__).parameters) - {"self", "backbone"}
    unknown = sorted(set(kwargs) - allowed)
    if unknown:
        raise ValueError(f"unknown option(s) for {method}: {', '.join(unknown)}; it takes {', '.join(sorted(allowed))}")
    if isinstance(backbone, str):
        backbone = create_backbone(method, backbone, **(backbone_kwargs or {}))
    return cls(backbone, **kwargs)


__all__ = ["ALL_METHODS", "DINO", "DINOv2", "MAE", "MoCoV3", "SimCLR", "create", "create_backbone", "losses"]
