"""LayerScale (Touvron et al., 2021, CaiT): a learnable per-channel scale on each residual branch, initialised
small (e.g. 1e-5) so deep models start close to the identity."""

from __future__ import annotations

import torch
import torch.nn as nn


class LayerScale(nn.Module):
    def __init__(self, dim: int, init_values: float = 1e-5):
        super().__init__()
        self.gamma = nn.Parameter(init_values * torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class LayerScale2d(nn.Module):
    """LayerScale on (B, C, H, W) maps: a per-channel scale ``gamma`` (C,)."""

    def __init__(self, dim: int, init_values: float = 1e-5):
        super().__init__()
        self.gamma = nn.Parameter(init_values * torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma.view(1, -1, 1, 1)
