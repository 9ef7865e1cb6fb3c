"""Turning a token sequence into one vector: the CLS token
('token'), the mean or max of the patch tokens ('avg', 'max'), or a learned attention pooling ('attn':
softmax over a linear score per token, then the weighted sum).

Token reduction (vitlab.tome, vitlab.prune) leaves tokens that stand for several patches; given their ``size``
(B, N, 1) the pools weight each token by it -- the mean of the merged tokens is then the mean over the patches,
as ToMe's authors pool their MAE models ("global average pool proportional to token size"), and the attention
pool adds ``log size`` to its scores as ToMe's proportional attention does (Bolya et al. 2023, Eq. 1)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

POOL_TYPES = ("token", "avg", "max", "attn", "")


class AttentionPool(nn.Module):
    """``sum_i softmax(w . x_i) x_i`` over the tokens: a learned weighted average (one score per token)."""

    def __init__(self, dim: int):
        super().__init__()
        self.attention = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor, size: torch.Tensor | None = None) -> torch.Tensor:  # (B, N, C) -> (B, C)
        scores = self.attention(x)  # (B, N, 1)
        if size is not None:
            scores = scores + size.log()
        return (F.softmax(scores, dim=1) * x).sum(dim=1)


def check_pool_type(pool_type: str, has_class_token: bool) -> str:
    if pool_type not in POOL_TYPES:
        raise ValueError(f"unknown global_pool {pool_type!r}; choose from {list(POOL_TYPES)}")
    if pool_type == "token" and not has_class_token:
        raise ValueError("global_pool='token' needs a class token; use 'avg', 'max' or 'attn'")
    return pool_type


def pool_tokens(x: torch.Tensor, pool_type: str, num_prefix_tokens: int, attn_pool: nn.Module | None = None,
                size: torch.Tensor | None = None):
    """Pool (B, N, C) tokens; the statistics pools see only the patch tokens (prefix tokens excluded). ``size``
    (B, N, 1): how many patches each token stands for (None: one each); 'max' ignores it."""
    if pool_type == "token":
        return x[:, 0]
    patches = x[:, num_prefix_tokens:]
    size = None if size is None else size[:, num_prefix_tokens:]
    if pool_type == "avg":
        return patches.mean(dim=1) if size is None else (patches * size).sum(dim=1) / size.sum(dim=1)
    if pool_type == "max":
        return patches.amax(dim=1)
    if pool_type == "attn":
        return attn_pool(patches, size)
    return x
