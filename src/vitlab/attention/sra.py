"""Spatial-reduction attention, SRA (Wang et al., "Pyramid Vision Transformer: A Versatile Backbone for Dense
Prediction without Convolutions", ICCV 2021; row "SRA" of Table IV in the LITv2 supplementary).

Queries come from every token; keys and values from a map shrunk by ``sr_ratio`` in each direction by a
strided ``sr_ratio`` x ``sr_ratio`` convolution followed by LayerNorm, so attention costs ``N^2 d / R^2``.
Parameter names follow PVT (``q``, ``kv``, ``sr``, ``norm``, ``proj``).

Defaults, PVT's setting for 1/16-scale maps (PVT stage 3): ``sr_ratio=2``. At dim 768 / 12 heads / 14x14:
4.72 M parameters (the reduction conv alone holds R^2 C^2 = 2.36 M), 419.4 M MACs (Table IV: 4.72 M,
419.6 M; the 0.2 M difference is the LayerNorm, which the table's counter (fvcore) counts and
vitlab.profile does not). ``sr_ratio=1`` is plain MSA with separate q / kv projections.

Any H x W: when R does not divide H or W the map is zero-padded on the bottom / right before the reduction,
so every token reaches some key (PVT's code silently drops the remainder rows / columns). Prefix (class)
tokens are allowed: they are queries like every token and, un-reduced, extra keys / values next to the
reduced grid (PVT v1 carries its class token this way through the kv projection).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from vitlab.attention._registry import register_attention
from vitlab.attention._window import attend
from vitlab.layers.helpers import check_heads


@register_attention("sra")
class SpatialReductionAttention(nn.Module):
    has_attention_weights = True  # return_attn=True: (B, heads, N, prefix + ceil(H/R) ceil(W/R))
    attention_kind = "spatial_reduction"

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = True, attn_drop: float = 0.0,
                 proj_drop: float = 0.0, sr_ratio: int = 2):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = check_heads(dim, num_heads)
        if sr_ratio < 1:
            raise ValueError(f"sr_ratio must be >= 1, got {sr_ratio}")
        self.sr_ratio = sr_ratio
        self.q = nn.Linear(dim, dim, bias=qkv_bias)
        self.kv = nn.Linear(dim, dim * 2, bias=qkv_bias)
        if sr_ratio > 1:
            self.sr = nn.Conv2d(dim, dim, kernel_size=sr_ratio, stride=sr_ratio)
            self.norm = nn.LayerNorm(dim)
        self.attn_drop = attn_drop
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor, hw: tuple[int, int] | None = None, return_attn: bool = False):
        """``return_attn``: also the weights over the prefix tokens and the reduced grid."""
        B, N, C = x.shape
        q = self.q(x).reshape(B, N, self.num_heads, self.head_dim).transpose(1, 2)  # (B, heads, N, d)
        kv_in = x
        if self.sr_ratio > 1:
            if hw is None:
                raise ValueError("sra with sr_ratio > 1 needs the grid size: call forward(x, hw=(H, W))")
            H, W = hw  # not int(): that would fix a symbolic (torch.export) size to the traced one
            n_prefix = N - H * W
            if n_prefix < 0:
                raise ValueError(f"{N} tokens cannot hold a {H}x{W} grid")
            R = self.sr_ratio
            grid = x[:, n_prefix:].transpose(1, 2).reshape(B, C, H, W)  # (B, C, H, W)
            if H % R or W % R:
                grid = F.pad(grid, (0, (-W) % R, 0, (-H) % R))
            red = self.norm(self.sr(grid).flatten(2).transpose(1, 2))  # (B, M = ceil(H/R) ceil(W/R), C)
            kv_in = torch.cat((x[:, :n_prefix], red), dim=1) if n_prefix else red
        M = kv_in.shape[1]
        k, v = self.kv(kv_in).reshape(B, M, 2, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        drop = self.attn_drop if self.training else 0.0
        o, attn = attend(q, k, v, None, drop, return_attn)  # (B, heads, N, d)
        out = self.proj_drop(self.proj(o.transpose(1, 2).reshape(B, N, C)))
        return (out, attn) if return_attn else out
