"""Deformable attention, DAT (Xia, Pan, Song, Li, Huang, "Vision Transformer with Deformable Attention",
CVPR 2022; row "DAT" of Table IV in the LITv2 supplementary).

Queries come from every token. Keys and values come from ``Hk x Wk`` points (a uniform grid of stride
``stride``) that are moved by learned, data-dependent offsets: per group of channels, a small offset network
(depthwise ``ksize`` x ``ksize`` conv, LayerNorm, GELU, 1x1 conv to 2 channels) reads the queries and predicts
one (dy, dx) per reference point, bounded by ``tanh * offset_range_factor`` key-grid steps; the input map is
sampled there with bilinear interpolation (``grid_sample``) and projected to keys and values. A relative
position bias, a learned ``(heads, 2 q_h - 1, 2 q_w - 1)`` table, is read at the continuous query-to-key
displacement (bilinear again) and added to the attention logits, here as the float ``attn_mask`` of
``scaled_dot_product_attention``. Parameter names follow the official code (``proj_q``, ``proj_k``,
``proj_v``, ``proj_out``, ``conv_offset``, ``rpe_table``); the projections are ``nn.Linear`` on tokens, not
1x1 convolutions on maps (a checkpoint needs its 1x1 kernels squeezed).

Defaults, DAT-T's setting for 1/16-scale maps (stage 3): ``n_groups=None`` -> one offset group per 4 heads
(DAT-T/S/B all use 4 heads a group: 3 groups at 12 heads; the largest divisor of the heads not above
heads // 4 otherwise),
``ksize=5``, ``stride=1`` (Hk x Wk = H x W), ``offset_range_factor=2``, ``use_pe=True``, ``q_size=(14, 14)``
(the size the bias table is built for: a 27 x 27 table; any other map reads it at rescaled displacements).
At dim 768 / 12 heads / 14x14: 2.38 M parameters, 525.5 M MACs (Table IV: 2.38 M, 528.7 M, -0.6%: the table's
counter also counts the offset network's LayerNorm / GELU and the sampling, vitlab.profile counts only
linear / conv / attention).

Deviation from the official code: reference points sit at the centres of the stride x stride cells (for
stride 1 exactly on the pixels); DAT's code places them half a key-grid step off (``linspace(0.5, Hk - 0.5)``
normalised by ``Hk - 1``), which puts the last row and column of points outside the map.

Any H x W (no padding needed). No prefix (class) tokens: a ValueError is raised when N != H*W.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange
from torch.nn.init import trunc_normal_

from vitlab.attention._registry import register_attention
from vitlab.attention._window import attend, grid_size
from vitlab.layers.helpers import check_heads, to_2tuple


class _ChannelLayerNorm(nn.Module):
    """LayerNorm over the channels of a (B, C, H, W) map (DAT's LayerNormProxy)."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


def _norm_coords(n: int, step: float, offset: float, size: int, dtype, device) -> torch.Tensor:
    """Pixel coordinates ``offset + step * i`` (i < n), normalised (align_corners=True) over ``size``."""
    return (torch.arange(n, dtype=dtype, device=device) * step + offset) * (2.0 / max(size - 1, 1)) - 1.0


@register_attention("dat")
class DeformableAttention(nn.Module):
    prefix_tokens = False  # a grid mechanism: x must hold exactly the H*W grid tokens
    has_attention_weights = True  # return_attn=True: (B, heads, N, Hk * Wk) over the sampled points
    attention_kind = "deformable"

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = True, attn_drop: float = 0.0,
                 proj_drop: float = 0.0, n_groups: int | None = None, ksize: int = 5, stride: int = 1,
                 offset_range_factor: float = 2.0, use_pe: bool = True, q_size=(14, 14)):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = check_heads(dim, num_heads)
        if n_groups is None:  # DAT's models use one offset group per 4 heads (DAT-T: 12 heads / 3 groups)
            n_groups = max(1, num_heads // 4)
            while num_heads % n_groups:
                n_groups -= 1
        if num_heads % n_groups:
            raise ValueError(f"num_heads {num_heads} is not divisible by n_groups {n_groups}")
        self.n_groups = n_groups
        self.n_group_channels = dim // n_groups
        self.n_group_heads = num_heads // n_groups
        self.stride = stride
        self.offset_range_factor = offset_range_factor
        cg = self.n_group_channels
        self.proj_q = nn.Linear(dim, dim, bias=qkv_bias)
        self.conv_offset = nn.Sequential(
            nn.Conv2d(cg, cg, ksize, stride, ksize // 2 if ksize != stride else 0, groups=cg),
            _ChannelLayerNorm(cg),
            nn.GELU(),
            nn.Conv2d(cg, 2, 1, bias=False),  # (dy, dx) per reference point
        )
        self.proj_k = nn.Linear(dim, dim, bias=qkv_bias)
        self.proj_v = nn.Linear(dim, dim, bias=qkv_bias)
        self.attn_drop = attn_drop
        self.proj_out = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        if use_pe:
            qh, qw = to_2tuple(q_size)
            self.rpe_table = nn.Parameter(torch.zeros(num_heads, 2 * qh - 1, 2 * qw - 1))
            trunc_normal_(self.rpe_table, std=0.01)
        else:
            self.rpe_table = None

    def forward(self, x: torch.Tensor, hw: tuple[int, int] | None = None, return_attn: bool = False):
        """``return_attn``: also the weights (B, heads, N, Hk * Wk) over the sampled key points, bias included."""
        H, W = grid_size(x, hw, "dat")
        B, N, C = x.shape
        G, dt, dev = self.n_groups, x.dtype, x.device
        q = self.proj_q(x)  # (B, N, C)
        offset = self.conv_offset(rearrange(q, "b (h w) (g c) -> (b g) c h w", h=H, g=G))  # (BG, 2, Hk, Wk)
        Hk, Wk = offset.shape[-2:]
        if self.offset_range_factor > 0:  # at most offset_range_factor key-grid steps (normalised units)
            rng = torch.tensor([1.0 / max(Hk - 1, 1), 1.0 / max(Wk - 1, 1)], dtype=dt, device=dev)
            offset = offset.tanh() * (rng * self.offset_range_factor).view(1, 2, 1, 1)
        s = self.stride
        ref_y = _norm_coords(Hk, s, (s - 1) / 2, H, dt, dev)  # centres of the stride x stride cells
        ref_x = _norm_coords(Wk, s, (s - 1) / 2, W, dt, dev)
        ref = torch.stack(torch.meshgrid(ref_y, ref_x, indexing="ij"), -1)  # (Hk, Wk, 2) as (y, x)
        pos = offset.permute(0, 2, 3, 1) + ref  # (BG, Hk, Wk, 2) sampling points, (y, x)
        x_map = rearrange(x, "b (h w) (g c) -> (b g) c h w", h=H, g=G)  # (BG, Cg, H, W)
        sampled = F.grid_sample(x_map, pos.flip(-1), mode="bilinear", align_corners=True)  # (BG, Cg, Hk, Wk)
        sampled = rearrange(sampled, "(b g) c hk wk -> b (hk wk) (g c)", g=G)  # (B, Ns, C)
        Ns = Hk * Wk
        q = q.reshape(B, N, self.num_heads, self.head_dim).transpose(1, 2)  # (B, heads, N, d)
        k = self.proj_k(sampled).reshape(B, Ns, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.proj_v(sampled).reshape(B, Ns, self.num_heads, self.head_dim).transpose(1, 2)
        bias = None
        if self.rpe_table is not None:
            qy, qx = _norm_coords(H, 1, 0, H, dt, dev), _norm_coords(W, 1, 0, W, dt, dev)
            q_grid = torch.stack(torch.meshgrid(qy, qx, indexing="ij"), -1).reshape(1, N, 1, 2)  # (y, x)
            disp = (q_grid - pos.reshape(B * G, 1, Ns, 2)) * 0.5  # (BG, N, Ns, 2), in the table's [-1, 1]
            th, tw = self.rpe_table.shape[-2:]
            table = self.rpe_table.to(dt).reshape(1, G, self.n_group_heads, th, tw)
            table = table.expand(B, -1, -1, -1, -1).reshape(B * G, self.n_group_heads, th, tw)  # per image
            bias = F.grid_sample(table, disp.flip(-1), mode="bilinear", align_corners=True)  # (BG, hg, N, Ns)
            bias = bias.reshape(B, self.num_heads, N, Ns)
        drop = self.attn_drop if self.training else 0.0
        o, attn = attend(q, k, v, bias, drop, return_attn)  # (B, heads, N, d)
        out = self.proj_drop(self.proj_out(o.transpose(1, 2).reshape(B, N, C)))
        return (out, attn) if return_attn else out
