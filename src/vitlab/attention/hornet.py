"""Recursive gated convolution, gnConv (Rao, Zhao, Tang, Zhou, Lim, Lu, "HorNet: Efficient High-Order Spatial
Interactions with Recursive Gated Convolutions", NeurIPS 2022; row "HorNet" of Table IV in the LITv2 supplementary).

An n-th order spatial interaction built from convolutions and element-wise products: a 1x1 convolution maps x
to ``[p_0, q_0 .. q_{n-1}]`` with channel widths ``C_k = C / 2^(n-1-k)``; the q's go through one 7x7
depth-wise convolution (scaled by 1/3); then ``p_0 * q_0``, and recursively ``p_{k+1} = g_k(p_k) * q_{k+1}``
with 1x1 convolutions g_k raising the width; a final 1x1 convolution projects ``p_{n}``. No softmax, no heads
(``num_heads``, ``qkv_bias`` and ``attn_drop`` are accepted for the common signature and unused).

HorNet uses orders 2, 3, 4, 5 in its four stages; the 1/16-scale stage (the 14x14 maps of Table IV) has
**order 4**, the default here: 2.23 M parameters and 436.5 M MACs at dim 768, as Table IV (order 5 would give
2.24 M / 437.9 M). Convolutional, so the tokens must be exactly the H x W grid: prefix tokens are refused with a
ValueError.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from vitlab.attention._registry import attention_weights_error, register_attention


@register_attention("hornet")
class GnConv(nn.Module):
    has_attention_weights = False  # no softmax over keys: return_attn=True raises a ValueError
    prefix_tokens = False  # a grid mechanism: x must hold exactly the H*W grid tokens

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = True, attn_drop: float = 0.0,
                 proj_drop: float = 0.0, order: int = 4, kernel_size: int = 7, scale: float = 1.0 / 3.0):
        super().__init__()
        if order < 1 or dim % 2 ** (order - 1):
            raise ValueError(f"gnConv of order {order} needs dim divisible by {2 ** (order - 1)}, got {dim}")
        self.order = order
        self.dims = [dim // 2**i for i in range(order)][::-1]  # C/2^(n-1), ..., C/2, C
        self.proj_in = nn.Conv2d(dim, 2 * dim, 1)
        self.dwconv = nn.Conv2d(sum(self.dims), sum(self.dims), kernel_size, padding=kernel_size // 2,
                                groups=sum(self.dims))
        self.pws = nn.ModuleList(nn.Conv2d(self.dims[i], self.dims[i + 1], 1) for i in range(order - 1))
        self.proj_out = nn.Conv2d(dim, dim, 1)
        self.scale = scale
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor, hw: tuple[int, int], return_attn: bool = False) -> torch.Tensor:
        if return_attn:
            raise attention_weights_error(self)
        B, N, C = x.shape
        H, W = hw
        if N != H * W:
            raise ValueError(f"hornet takes exactly the {H}x{W} grid tokens (no prefix tokens), got N={N}")
        x = x.view(B, H, W, C).permute(0, 3, 1, 2)  # (B, C, H, W) as a channels-last view: no copy
        # p_0: (B, C_0, H, W); q: (B, sum_k C_k, H, W)
        p, q = self.proj_in(x).split((self.dims[0], sum(self.dims)), dim=1)
        gates = (self.dwconv(q) * self.scale).split(self.dims, dim=1)  # q_k: (B, C_k, H, W)
        p = p * gates[0]
        for k, pw in enumerate(self.pws):
            p = pw(p) * gates[k + 1]  # (B, C_{k+1}, H, W)
        y = self.proj_out(p)  # (B, C, H, W)
        return self.proj_drop(y.permute(0, 2, 3, 1).reshape(B, N, C))  # (B, N, C); a view when channels-last
