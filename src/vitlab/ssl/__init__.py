"""Self-supervised pre-training: MAE (He et al., 2022), SimCLR (Chen et al., 2020), MoCo v3 (Chen, Xie, He, 2021),
DINO (Caron et al., 2021) and the DINOv2 objective (Oquab et al., 2023) on vitlab backbones, their losses
(:mod:`vitlab.ssl.losses`), the ``vitlab pretrain`` tasks and frozen-feature evaluation (linear probe, k-NN:
:mod:`vitlab.ssl.probe`). Methods live in an open registry (:mod:`vitlab.ssl.base`):

    import vitlab.ssl
    vitlab.ssl.list_methods()               # ['mae', 'simclr', 'mocov3', 'dino', 'dinov2', ...plugins]
    ssl = vitlab.ssl.create("mae", "vit_pico_patch8_32", decoder_dim=64, decoder_depth=2, decoder_heads=4)
    out = ssl([images])                     # {'loss': ..., 'pred': ..., 'mask': ...}
    ssl = vitlab.ssl.create("dino", "vit_pico_patch8_32", out_dim=1024)
    out = ssl([global1, global2, local1, local2])
    ssl.before_optimizer_step()             # between backward and the optimiser step: DINO's freeze_last_layer
    ssl.after_step(step, total_steps, steps_per_epoch)   # after each optimiser step: EMA teacher, schedules

    @vitlab.ssl.register_method("mine")     # a new method: cls(backbone, **options), forward(views) -> {'loss'}
    class Mine(vitlab.ssl.SSLMethod):
        views = vitlab.ssl.ViewSpec(global_views=2)
"""

from __future__ import annotations

from vitlab.ssl import losses
from vitlab.ssl.base import (
    SSLMethod,
    ViewSpec,
    create,
    create_backbone,
    default_local_crop_size,
    list_methods,
    method_class,
    method_options,
    method_parameters,
    register_method,
)
from vitlab.ssl.mae import MAE
from vitlab.ssl.methods import DINO, DINOv2, MoCoV3, SimCLR

__all__ = ["DINO", "MAE", "DINOv2", "MoCoV3", "SSLMethod", "SimCLR", "ViewSpec", "create", "create_backbone",
           "default_local_crop_size", "list_methods", "losses", "method_class", "method_options", "method_parameters",
           "register_method"]
