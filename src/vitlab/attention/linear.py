"""Linear attention with the ELU+1 feature map (Katharopoulos et al., "Transformers are RNNs: Fast
Autoregressive Transformers with Linear Attention", ICML 2020).

Softmax attention ``softmax(q k^T) v`` is replaced by a kernel ``phi(q) phi(k)^T`` with the positive feature
map ``phi(x) = elu(x) + 1``; associativity then gives ``phi(q) (phi(k)^T v)`` normalised by ``phi(q) sum_n
phi(k_n)``, linear in the number of tokens N (cost ``O(N d^2)`` per head instead of ``O(N^2 d)``). Global over
all tokens, so prefix (class) tokens are allowed. No row in LITv2's Table IV; at dim 768 / 12 heads / 14x14
it costs the MSA projections (462.4 M MACs) plus 2 x 9.6 M for the two d x d products.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from vitlab.attention._registry import attention_weights_error, register_attention
from vitlab.layers.helpers import check_heads


@register_attention("linear")
class LinearAttention(nn.Module):
    has_attention_weights = False  # no softmax over keys: return_attn=True raises a ValueError
    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = True, attn_drop: float = 0.0,
                 proj_drop: float = 0.0, eps: float = 1e-6):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = check_heads(dim, num_heads)
        self.eps = eps
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = attn_drop  # there is no attention matrix to drop from; kept for the common signature
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    @staticmethod
    def feature_map(x: torch.Tensor) -> torch.Tensor:
        return F.elu(x) + 1.0  # > 0, so the normaliser below never vanishes

    def forward(self, x: torch.Tensor, hw: tuple[int, int] | None = None, return_attn: bool = False) -> torch.Tensor:
        if return_attn:
            raise attention_weights_error(self)
        B, N, C = x.shape
        if hw is not None and hw[0] * hw[1] > N:
            raise ValueError(f"{N} tokens cannot hold a {hw[0]}x{hw[1]} grid")
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # (B, heads, N, d)
        q, k = self.feature_map(q), self.feature_map(k)
        kv = k.transpose(-2, -1) @ v  # (B, heads, d, d): sum_n phi(k_n) v_n^T
        k_sum = k.sum(dim=-2, keepdim=True)  # (B, heads, 1, d)
        denom = (q * k_sum).sum(dim=-1, keepdim=True)  # (B, heads, N, 1): phi(q_n) . sum_m phi(k_m)
        x = (q @ kv) / (denom + self.eps)  # (B, heads, N, d)
        return self.proj_drop(self.proj(x.transpose(1, 2).reshape(B, N, C)))
