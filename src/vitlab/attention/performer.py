"""Performer attention, FAVOR+ (Choromanski et al., "Rethinking Attention with Performers", ICLR 2021; row
"Performer" of Table IV in the LITv2 supplementary).

The softmax kernel ``exp(q.k / sqrt(d))`` is approximated by positive random features, ``phi(x) = m^-1/2 exp(W
x - |x|^2 / 2)`` with ``x = x_raw / d^(1/4)`` and W (m x d) *orthogonal* random Gaussian rows (blocks of an
orthogonal matrix, rescaled to chi-distributed norms), so that ``E[phi(q).phi(k)] = exp(q.k / sqrt(d))``.
Attention becomes linear in the number of tokens: ``out = phi(Q) (phi(K)^T V) / (phi(Q) phi(K)^T 1)``. The
features are a buffer (not learned); call :meth:`PerformerAttention.redraw_features` to resample them (the
paper redraws them during training).

Default m = 256 features per head (the authors' setting, as in Table IV): at dim 768 / 12 heads / 14x14 this
is 2.36 M parameters and 617 M MACs (the projections, 2 x 38.5 M for W q and W k, 2 x 38.5 M for the two
linear attention products). Global over all tokens: prefix (class) tokens are allowed.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from vitlab.attention._registry import attention_weights_error, register_attention
from vitlab.layers.helpers import check_heads


def orthogonal_gaussian(num_features: int, dim: int,
                        generator: torch.Generator | None = None) -> torch.Tensor:
    """(num_features, dim) rows drawn from N(0, I) but mutually orthogonal inside each block of ``dim`` rows.

    Each block is the Q of a QR decomposition of a Gaussian matrix; the rows are then rescaled to the norms of
    independent Gaussian vectors, so every row is marginally N(0, I) (FAVOR+'s "regularised" ORFs)."""
    blocks = []
    for _ in range((num_features + dim - 1) // dim):
        q, _ = torch.linalg.qr(torch.randn(dim, dim, generator=generator))
        blocks.append(q.T)
    w = torch.cat(blocks)[:num_features]  # (m, d), unit rows
    norms = torch.randn(num_features, dim, generator=generator).norm(dim=1, keepdim=True)  # chi(d)
    return w * norms


def favor_features(x: torch.Tensor, w: torch.Tensor, is_query: bool, eps: float = 1e-6) -> torch.Tensor:
    """Positive random features of ``x`` (B, heads, N, d) for W (m, d): (B, heads, N, m).

    A maximum is subtracted inside the exponential for stability: per row for queries (it cancels between
    numerator and normaliser), one shared value per (batch, head) for keys (so it cancels as well)."""
    d, m = x.shape[-1], w.shape[0]
    x = x * d**-0.25  # so that phi(q).phi(k) estimates exp(q.k / sqrt(d))
    proj = x @ w.T  # (B, heads, N, m)
    sq = 0.5 * (x * x).sum(dim=-1, keepdim=True)  # (B, heads, N, 1)
    if is_query:
        shift = proj.amax(dim=-1, keepdim=True).detach()
    else:
        shift = proj.amax(dim=(-2, -1), keepdim=True).detach()
    return (torch.exp(proj - sq - shift) + eps) * m**-0.5


def favor_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """FAVOR+ estimate of ``softmax(q k^T / sqrt(d)) v`` for (B, heads, N, d) inputs and features W (m, d)."""
    qf = favor_features(q, w, is_query=True)  # (B, heads, N, m)
    kf = favor_features(k, w, is_query=False)  # (B, heads, N, m)
    kv = kf.transpose(-2, -1) @ v  # (B, heads, m, d)
    denom = qf @ kf.sum(dim=-2).unsqueeze(-1)  # (B, heads, N, 1)
    return (qf @ kv) / denom


@register_attention("performer")
class PerformerAttention(nn.Module):
    has_attention_weights = False  # no softmax over keys: return_attn=True raises a ValueError
    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = True, attn_drop: float = 0.0,
                 proj_drop: float = 0.0, num_features: int = 256):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = check_heads(dim, num_heads)
        self.num_features = num_features
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = attn_drop  # no attention matrix is formed; kept for the common signature
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        self.register_buffer("features", torch.empty(num_features, self.head_dim), persistent=True)
        self.redraw_features()

    @torch.no_grad()
    def redraw_features(self, generator: torch.Generator | None = None) -> None:
        """Draw a fresh orthogonal random feature matrix (m, d), shared by all heads."""
        if self.features.is_meta:  # shape-only instance (FLOP counting): nothing to draw
            return
        w = orthogonal_gaussian(self.num_features, self.head_dim, generator)  # drawn on CPU (QR), then moved
        self.features.copy_(w.to(self.features.device, self.features.dtype))

    def forward(self, x: torch.Tensor, hw: tuple[int, int] | None = None, return_attn: bool = False) -> torch.Tensor:
        if return_attn:
            raise attention_weights_error(self)
        B, N, C = x.shape
        if hw is not None and hw[0] * hw[1] > N:
            raise ValueError(f"{N} tokens cannot hold a {hw[0]}x{hw[1]} grid")
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # (B, heads, N, d)
        x = favor_attention(q, k, v, self.features.to(q.dtype))  # (B, heads, N, d)
        return self.proj_drop(self.proj(x.transpose(1, 2).reshape(B, N, C)))
