"""Multi-head self-attention (Vaswani et al., 2017; ViT, Dosovitskiy et al., 2021), registered as ``msa``.

One fused qkv projection, then ``torch.nn.functional.scaled_dot_product_attention`` (flash / memory-efficient
kernels where available). ``forward(..., return_attn=True)`` takes the explicit softmax path and also returns
the attention weights, for attention maps and analysis. Options: qk-norm (Dehghani et al., 2023), a RoPE
hook that rotates queries and keys (Su et al., 2021), and masks for text: ``attn_mask`` (boolean, True = attend, or
additive; :func:`vitlab.layers.attention_mask`) and ``is_causal`` (a decoder's causal mask, SDPA's own flag).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from vitlab.attention._registry import register_attention
from vitlab.layers.helpers import check_heads
from vitlab.layers.mask import causal_mask
from vitlab.layers.pos_embed import apply_rope


@register_attention("msa")
class MultiHeadSelfAttention(nn.Module):
    fused_attn: bool = True  # class-wide switch: False forces the explicit softmax path (e.g. for comparison)

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = True, qk_norm: bool = False,
                 attn_drop: float = 0.0, proj_drop: float = 0.0,
                 norm_layer: Callable[..., nn.Module] = nn.LayerNorm):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = check_heads(dim, num_heads)
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.q_norm = norm_layer(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = norm_layer(self.head_dim) if qk_norm else nn.Identity()
        self.attn_drop = attn_drop
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor, hw: tuple[int, int] | None = None, rope=None, return_attn: bool = False,
                attn_mask: torch.Tensor | None = None, is_causal: bool = False):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # (B, heads, N, head_dim) each
        q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        drop = self.attn_drop if self.training else 0.0
        if is_causal and (attn_mask is not None or not (self.fused_attn and not return_attn)):
            # SDPA takes a mask or the causal flag, not both; the explicit path needs the mask itself
            causal = causal_mask(N, x.device)
            attn_mask, is_causal = (causal if attn_mask is None else attn_mask & causal), False
        if self.fused_attn and not return_attn:
            x = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=drop, is_causal=is_causal)
            attn = None
        else:
            attn = (q * self.scale) @ k.transpose(-2, -1)  # (B, heads, N, N)
            if attn_mask is not None:
                is_bool = attn_mask.dtype == torch.bool
                attn = attn.masked_fill(~attn_mask, float("-inf")) if is_bool else attn + attn_mask
            attn = attn.softmax(dim=-1)
            x = F.dropout(attn, drop) @ v
        x = self.proj_drop(self.proj(x.transpose(1, 2).reshape(B, N, C)))
        return (x, attn) if return_attn else x


Attention = MultiHeadSelfAttention  # timm's name
