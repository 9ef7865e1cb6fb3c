"""Linformer attention (Wang, Li, Khabsa, Fang, Ma, "Linformer: Self-Attention with Linear Complexity",
arXiv:2006.04768, 2020; row "Linformer" of Table IV in the LITv2 supplementary).

Keys and values are projected along the *sequence*: ``K' = E K`` and ``V' = F V`` with learned E, F of shape
(k, N) shared by all heads; then softmax attention of the N queries over the k projected tokens (through
``scaled_dot_product_attention``), cost ``O(N k d)``.

Projected length: **k = 256**, Linformer's default setting, which is what reproduces Table IV at 14x14 (196
tokens): E and F add 2 x 256 x 196 = 0.10 M parameters (2.46 M in all) and 2 x 38.5 M MACs, and attention over
256 projected tokens costs 2 x 38.5 M more, 616.5 M MACs in all (Table IV: 2.46 M, 616.6 M). k = 256 > N here,
so on ViT-B's 14x14 map Linformer is *more* expensive than MSA; it pays off only for N >> k.

E and F are learned for a fixed grid (``grid_size``, default 14x14) plus ``num_prefix_tokens`` (default 0)
prefix tokens. For another H x W the grid part of E and F (viewed as k maps of grid_size) is resampled
bilinearly and rescaled by ``N_0 / (H W)`` so every projected token stays a weighted sum of the same total
weight; any H, W works. The number of prefix tokens must match ``num_prefix_tokens`` (ValueError otherwise).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from vitlab.attention._registry import register_attention
from vitlab.attention._window import attend
from vitlab.layers.helpers import check_heads, to_2tuple


@register_attention("linformer")
class LinformerAttention(nn.Module):
    has_attention_weights = True  # return_attn=True: (B, heads, N, k) over the k projected tokens
    attention_kind = "projected"

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = True, attn_drop: float = 0.0,
                 proj_drop: float = 0.0, proj_len: int = 256, grid_size=(14, 14), num_prefix_tokens: int = 0):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = check_heads(dim, num_heads)
        self.grid_size = to_2tuple(grid_size)
        self.num_prefix_tokens = num_prefix_tokens
        seq_len = num_prefix_tokens + self.grid_size[0] * self.grid_size[1]
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        # E (keys) and F (values): (k, N_0), initialised like a nn.Linear(N_0, k) as in the reference code
        bound = 1 / math.sqrt(seq_len)
        self.proj_k = nn.Parameter(torch.empty(proj_len, seq_len).uniform_(-bound, bound))
        self.proj_v = nn.Parameter(torch.empty(proj_len, seq_len).uniform_(-bound, bound))
        self.attn_drop = attn_drop
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def _seq_proj(self, e: torch.Tensor, hw: tuple[int, int]) -> torch.Tensor:
        """E for an H x W grid: (k, prefix + H*W)."""
        if tuple(hw) == self.grid_size:
            return e
        P, (H0, W0), (H, W) = self.num_prefix_tokens, self.grid_size, hw
        grid = e[:, P:].reshape(1, -1, H0, W0)  # (1, k, H0, W0)
        grid = F.interpolate(grid, size=(H, W), mode="bilinear", align_corners=False) * (H0 * W0 / (H * W))
        return torch.cat([e[:, :P], grid.reshape(e.shape[0], H * W)], dim=1)

    def forward(self, x: torch.Tensor, hw: tuple[int, int], return_attn: bool = False):
        """``return_attn``: also the weights over the k projected keys."""
        B, N, C = x.shape
        H, W = hw
        if N != self.num_prefix_tokens + H * W:
            raise ValueError(f"linformer was built for {self.num_prefix_tokens} prefix tokens + an H x W "
                             f"grid; got N={N} for a {H}x{W} grid (set num_prefix_tokens)")
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # (B, heads, N, d)
        k = self._seq_proj(self.proj_k, hw).to(k.dtype) @ k  # (k, N) @ (B, heads, N, d) -> (B, heads, k, d)
        v = self._seq_proj(self.proj_v, hw).to(v.dtype) @ v
        drop = self.attn_drop if self.training else 0.0
        x, attn = attend(q, k, v, None, drop, return_attn)  # (B, heads, N, d)
        out = self.proj_drop(self.proj(x.transpose(1, 2).reshape(B, N, C)))
        return (out, attn) if return_attn else out
