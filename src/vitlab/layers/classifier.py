"""The classifier head shared by every model: a linear layer, or the identity when there are no classes (timm's
``num_classes=0`` gives the pooled features), and the check of a ``global_pool`` name against a model's list."""

from __future__ import annotations

import torch
import torch.nn as nn


def create_classifier(num_features: int, num_classes: int, device: torch.device | str | None = None) -> nn.Module:
    """``nn.Linear(num_features, num_classes)`` on ``device``, or ``Identity`` for ``num_classes <= 0``."""
    return nn.Linear(num_features, num_classes, device=device) if num_classes > 0 else nn.Identity()


def check_pool(pool_type: str, allowed: tuple[str, ...], model: str | None = None) -> str:
    """Return ``pool_type`` if it is one of ``allowed``, else raise one clear ``ValueError``."""
    if pool_type not in allowed:
        for_model = f" for {model}" if model else ""
        raise ValueError(f"unknown global_pool {pool_type!r}{for_model}; choose from {list(allowed)}")
    return pool_type
