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

from vitlab.attention._registry import register_attention
from vitlab.attention.msa import MultiHeadSelfAttention


@register_attention("msa_naive")
class NaiveAttention(MultiHeadSelfAttention):
    """``msa`` on its explicit softmax path (``fused_attn = False``): the same parameters, the (N, N) weights
    materialised."""

    fused_attn = False

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = True, attn_drop: float = 0.0,
                 proj_drop: float = 0.0):
        super().__init__(dim, num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop, proj_drop=proj_drop)
