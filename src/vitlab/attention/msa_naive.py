"""Multi-head self-attention with an explicit softmax, registered as ``msa_naive`` (Vaswani et al., "Attention
Is All You Need", NeurIPS 2017; ViT, Dosovitskiy et al., ICLR 2021; row "MSA" of Table IV in the LITv2
supplementary, whose benchmark ran this un-fused form).

``softmax(q k^T / sqrt(d)) v`` is materialised as an (N, N) matrix per head, as the paper's baseline was
written, instead of calling the fused ``scaled_dot_product_attention`` of ``msa``. Same parameters and state
dict keys as ``msa`` (``qkv``, ``proj``), so the two load each other's weights and agree to rounding; it
exists to measure what fusion buys. At dim 768 / 12 heads / 14x14: 2.36 M parameters, 521.4 M MACs.
Global over all tokens: prefix (class) tokens are allowed and ``hw`` is not needed.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from vitlab.attention._registry import register_attention
from vitlab.layers.helpers import check_heads


@register_attention("msa_naive")
class NaiveAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = True, attn_drop: float = 0.0,
                 proj_drop: float = 0.0):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = check_heads(dim, num_heads)
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor, hw: tuple[int, int] | None = None, return_attn: bool = False):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # (B, heads, N, d) each
        attn = (q * self.scale) @ k.transpose(-2, -1)  # (B, heads, N, N)
        attn = F.softmax(attn, dim=-1)
        x = self.attn_drop(attn) @ v  # (B, heads, N, d)
        x = self.proj_drop(self.proj(x.transpose(1, 2).reshape(B, N, C)))
        return (x, attn) if return_attn else x
