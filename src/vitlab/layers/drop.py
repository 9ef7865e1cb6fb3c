"""Stochastic depth (Huang et al., 2016, "Deep Networks with Stochastic Depth") in the per-sample 'row' mode
that ViT/DeiT and HaLViT use: each sample's residual branch is dropped with probability ``p`` and
the kept ones are scaled by ``1 / (1 - p)``, so the expectation is unchanged."""

from __future__ import annotations

import torch
import torch.nn as nn


def drop_path(x: torch.Tensor, p: float = 0.0, training: bool = False) -> torch.Tensor:
    if p == 0.0 or not training:
        return x
    keep = 1.0 - p
    mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)  # (B, 1, ..., 1): one draw per row
    return x * mask.div_(keep)


class DropPath(nn.Module):
    """Row-mode stochastic depth; identity in eval mode or when ``p == 0``."""

    def __init__(self, p: float = 0.0):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"drop path probability must be in [0, 1), got {p}")
        self.p = float(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return drop_path(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"


def drop_path_schedule(rate: float, depth: int) -> list[float]:
    """The linear schedule over depth: 0 for the first block up to ``rate`` for the last."""
    if depth == 1:
        return [0.0]
    return [rate * i / (depth - 1) for i in range(depth)]  # plain floats: works under a meta device too
