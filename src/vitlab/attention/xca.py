"""Cross-covariance attention, XCA (El-Nouby, Touvron, Caron, Bojanowski, Douze, Joulin, Laptev, Neverova,
Synnaeve, Verbeek, Jegou, "XCiT: Cross-Covariance Image Transformers", NeurIPS 2021; row "XCA" of Table IV in
the LITv2 supplementary).

Attention runs over *channels* instead of tokens: per head, queries and keys are transposed to (d, N),
L2-normalised along the tokens, and the d x d cross-covariance ``softmax(tau * q_hat k_hat^T)`` (with a
learned temperature tau per head) mixes the value channels, ``out = A v^T``. Cost is linear in the number of
tokens, ``O(N d^2)`` per head. This is softmax attention with the d channels as the "sequence" and the N
tokens as the embedding; it is computed with two batched GEMMs on the token-major (N, d) layout rather than
through ``scaled_dot_product_attention``, which would need q, k and v transposed to (d, N) in memory (slow on
the CPU, in bf16 above all). At dim 768 / 12 heads / 14x14: 2.36 M parameters, 481.7 M MACs (MSA's
projections + 2 x 9.6 M). Global over all tokens: prefix (class) tokens are allowed.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from vitlab.attention._registry import register_attention
from vitlab.layers.helpers import check_heads


@register_attention("xca")
class XCA(nn.Module):
    has_attention_weights = True  # return_attn=True: the (B, heads, d, d) softmax over channels, not tokens
    attention_kind = "channels"

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = True, attn_drop: float = 0.0,
                 proj_drop: float = 0.0):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = check_heads(dim, num_heads)
        self.temperature = nn.Parameter(torch.ones(num_heads, 1, 1))  # tau, one per head (XCiT init: 1)
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = attn_drop
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor, hw: tuple[int, int] | None = None, return_attn: bool = False):
        """``return_attn``: also the cross-covariance weights (B, heads, d, d) (channels attend to channels)."""
        B, N, C = x.shape
        if hw is not None and hw[0] * hw[1] > N:
            raise ValueError(f"{N} tokens cannot hold a {hw[0]}x{hw[1]} grid")
        # (3, B, heads, N, d), made contiguous in one copy that keeps d innermost; the channel-as-sequence view
        # (d, N) is then a free transpose that the batched GEMMs take as is. (Permuting to (B, heads, d, N) in
        # memory is an element-wise transpose, and on the CPU in bf16 it cost more than the projections.)
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).contiguous()
        q, k, v = qkv.unbind(0)  # (B, heads, N, d)
        # XCiT L2-normalises every channel of q and k over the tokens; normalize(q)^T normalize(k) equals
        # q^T k / (|q| |k|^T), so the norms divide the d x d product (d^2 divisions instead of 2 N d, no copies).
        # clamp_min(1e-12) is F.normalize's eps.
        q_norm = torch.linalg.vector_norm(q, dim=-2).clamp_min(1e-12)  # (B, heads, d)
        k_norm = torch.linalg.vector_norm(k, dim=-2).clamp_min(1e-12)
        attn = q.transpose(-2, -1) @ k  # (B, heads, d, d) cross-covariance
        attn = attn / (q_norm.unsqueeze(-1) * k_norm.unsqueeze(-2)) * self.temperature
        weights = attn.softmax(dim=-1)
        attn = F.dropout(weights, self.attn_drop if self.training else 0.0)
        x = v @ attn.transpose(-2, -1).to(v.dtype)  # (B, heads, N, d): out = A v^T, token-major
        x = x.transpose(1, 2).reshape(B, N, C)  # (B, N, heads * d)
        out = self.proj_drop(self.proj(x))
        return (out, weights) if return_attn else out
