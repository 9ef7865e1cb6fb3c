"""Normalisation layers: LayerNorm (Ba et al., 2016) and RMSNorm (Zhang & Sennrich, 2019; the Llama-2 norm:
``x / RMS(x) * gamma``), behind one factory so a model names its norm with a string."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

from vitlab.layers.helpers import by_name


class RMSNorm(nn.Module):
    """``x * rsqrt(mean(x**2) + eps) * weight`` over the last dimension (no mean subtraction, no bias)."""

    def __init__(self, dim: int, eps: float = 1e-6, affine: bool = True):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (self.dim,), self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


_NORMS: dict[str, Callable[..., nn.Module]] = {
    "layernorm": partial(nn.LayerNorm, eps=1e-6),
    "layernorm_eps5": partial(nn.LayerNorm, eps=1e-5),
    "rmsnorm": RMSNorm,
}


def get_norm_layer(norm: str | Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """A norm factory from a name ('layernorm', 'layernorm_eps5', 'rmsnorm') or a callable."""
    return by_name(_NORMS, norm, "norm layer")
