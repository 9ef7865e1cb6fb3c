"""HiLo attention (Pan, Cai, Zhuang, "Fast Vision Transformers with HiLo Attention", NeurIPS 2022; LITv2;
its supplementary: Section B for the cost, Table III for the pooled-queries variant, row "HiLo" of Table IV).

The heads are split in two groups with separate projections:

* Hi-Fi (high frequencies), ``num_heads - floor(alpha * num_heads)`` heads: ordinary self-attention inside
  non-overlapping s x s windows (fine local detail);
* Lo-Fi (low frequencies), ``floor(alpha * num_heads)`` heads: queries from every token of the full map,
  keys and values from the s x s average-pooled map (global context at 1/s^2 of the cost).

Each group has its own output projection (``h_proj``, ``l_proj``); the two outputs are concatenated along the
channels, Hi-Fi first, and there is no projection after the concatenation. This is the structure (and the
parameter names) of the official LITv2 code, so its weights load as they are.

Defaults are the authors' setting for 1/16-scale maps (LITv2 stage 3, Table IV): ``window_size=2``,
``alpha=0.9`` -> with 12 heads, 10 Lo-Fi and 2 Hi-Fi heads; at dim 768 / 14x14: 2.20 M parameters,
298.3 M MACs (Table IV: 2.20 M, 298.3 M). As in the official code, ``window_size=1`` turns every head into
Lo-Fi with un-pooled keys, i.e. standard multi-head self-attention (LITv2's last stage, alpha=1, s=1).

Any H x W: Hi-Fi pads the projected map to a multiple of s and masks the padded keys; the Lo-Fi pooling uses
``ceil_mode`` so a partial window at the border averages only its real tokens. No prefix (class) tokens:
a ValueError is raised when N != H*W.

Both attention cores run on ``F.scaled_dot_product_attention``. Fused inference kernels for them are applied
from outside, by :func:`vitlab.optimize.optimize`. ``forward(x, hw, return_attn=True)`` also returns the
attention weights of every head over the tokens (:meth:`HiLo.attention_weights`).

``pooled_queries=True`` is the Table III ablation: Lo-Fi queries come from the pooled map as well, its output
(projected at the pooled resolution) is resized back to H x W with bilinear interpolation.

:func:`hilo_flops` is the closed form of Section B, generalised from alpha = 1/2 to any split.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from vitlab.attention._registry import register_attention
from vitlab.attention._window import expand_heads, grid_size, pad_to_multiple, valid_keys
from vitlab.layers.helpers import check_heads


def hilo_flops(N: int, D: int, s: int, alpha: float = 0.5) -> float:
    """MACs of one HiLo layer by the LITv2 supplementary, Section B: N tokens, D channels, window s, Lo-Fi share alpha.

    Section B takes alpha = 1/2 and gets ``7/4 N D^2 + s^2 N D`` (Hi-Fi) plus
    ``(3/4 + 1/s^2) N D^2 + N^2 D / s^2`` (Lo-Fi). With D_l = alpha D Lo-Fi channels and D_h = D - D_l Hi-Fi
    channels the same three parts (projections, attention, output projection) read

    * Hi-Fi: ``3 N D D_h + 2 s^2 N D_h + N D_h^2``
    * Lo-Fi: ``N D D_l + 2 (N / s^2) D D_l + 2 N (N / s^2) D_l + N D_l^2``

    Exact for the module when s divides H and W and alpha * num_heads is an integer (use alpha = Lo-Fi heads
    / heads, e.g. 10/12 for the default 0.9 with 12 heads). For s = 1 the module makes every head Lo-Fi, which
    this formula gives with alpha = 1.
    """
    d_l = alpha * D
    d_h = D - d_l
    hifi = 3 * N * D * d_h + 2 * s**2 * N * d_h + N * d_h**2
    lofi = N * D * d_l + 2 * (N / s**2) * D * d_l + 2 * N * (N / s**2) * d_l + N * d_l**2
    return hifi + lofi


@register_attention("hilo")
class HiLo(nn.Module):
    has_attention_weights = True  # return_attn=True: (B, heads, N, N), Hi-Fi heads then Lo-Fi heads
    attention_kind = "hilo"
    prefix_tokens = False  # a grid mechanism: x must hold exactly the H*W grid tokens
    window_dtype: torch.dtype | None = None  # dtype of the Hi-Fi window attention (None: the input's)

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = True, attn_drop: float = 0.0,
                 proj_drop: float = 0.0, window_size: int = 2, alpha: float = 0.9,
                 pooled_queries: bool = False):
        super().__init__()
        self.head_dim = check_heads(dim, num_heads)
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must lie in [0, 1], got {alpha}")
        if window_size < 1:
            raise ValueError(f"window_size must be >= 1, got {window_size}")
        self.dim = dim
        self.ws = window_size
        self.l_heads = int(num_heads * alpha + 1e-6)  # floor (official int()); eps: 0.29 * 100
        if window_size == 1:  # s = 1: official code makes every head Lo-Fi (= MSA)
            self.l_heads = num_heads
        self.h_heads = num_heads - self.l_heads
        self.l_dim = self.l_heads * self.head_dim
        self.h_dim = self.h_heads * self.head_dim
        self.pooled_queries = pooled_queries
        self.attn_drop = attn_drop
        if self.l_heads > 0:
            self.l_q = nn.Linear(dim, self.l_dim, bias=qkv_bias)
            self.l_kv = nn.Linear(dim, self.l_dim * 2, bias=qkv_bias)
            self.l_proj = nn.Linear(self.l_dim, self.l_dim)
        if self.h_heads > 0:
            self.h_qkv = nn.Linear(dim, self.h_dim * 3, bias=qkv_bias)
            self.h_proj = nn.Linear(self.h_dim, self.h_dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def hifi(self, qkv: torch.Tensor, H: int, W: int) -> torch.Tensor:
        """Projected (B, H, W, 3 h_dim) -> attention inside s x s windows, projected by ``h_proj``.

        Returns the projected output of the padded (B, Hp = nh s, Wp = nw s) map as a strided
        (B, nh, s, nw, s, h_dim) view, which the caller writes into its slice of the output in one copy (no
        separate window-reverse copy)."""
        B, s, h, d = qkv.shape[0], self.ws, self.h_heads, self.head_dim
        qkv = pad_to_multiple(qkv, s, s)  # pad after projecting: (B, Hp, Wp, 3 h_dim)
        nh, nw = qkv.shape[1] // s, qkv.shape[2] // s
        # Window partition, one copy for q, k and v: (3, B, nh, nw, h, s, s, d) -> (3, B, nW * h, s*s, d), in
        # ``window_dtype`` (None: the input's) on the way (copy=True: ``to`` would return the strided view when
        # the dtype already matches); h_proj gets its own dtype back.
        dtype = qkv.dtype
        qkv = qkv.view(B, nh, s, nw, s, 3, h, d).permute(5, 0, 1, 3, 6, 2, 4, 7)
        qkv = qkv.to(self.window_dtype or dtype, memory_format=torch.contiguous_format, copy=True)
        q, k, v = qkv.view(3, B, nh * nw * h, s * s, d).unbind(0)
        mask = valid_keys(H, W, s, s, qkv.device)  # (nW, 1, s*s) or None when s divides H and W
        if mask is not None:
            mask = expand_heads(mask, h)  # (1, nW * h, 1, s*s)
        drop = self.attn_drop if self.training else 0.0
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=drop)  # (B, nW * h, s*s, d)
        # h_proj mixes channels only, so it runs in window order: (B, s*s, nW, h*d) tokens. SDPA on the CPU
        # returns o laid out as (B, s*s, nW * h, d), which makes this transpose + reshape free.
        o = self.h_proj(o.transpose(1, 2).reshape(B, s, s, nh, nw, h * d).to(dtype))  # (B, s, s, nh, nw, h_dim)
        return o.permute(0, 3, 1, 4, 2, 5)  # (B, nh, s, nw, s, h_dim) view

    def lofi(self, x: torch.Tensor, q: torch.Tensor | None = None) -> torch.Tensor:
        """(B, H, W, C) -> (B, H, W, l_dim): queries attend to the s x s average-pooled map.

        ``q``: the Lo-Fi queries (B, H, W, l_dim) when the caller projected them already (fused projection)."""
        B, H, W, C = x.shape
        s = self.ws
        if s > 1:
            # Pool first, then project k and v: s^2 times fewer MACs than projecting the full map.
            # channels-last view; ceil_mode: a border window averages only its real tokens (divisor = count)
            pooled = F.avg_pool2d(x.permute(0, 3, 1, 2), s, s, ceil_mode=True)  # (B, C, Hs, Ws)
            hs, ws = pooled.shape[-2:]
            kv_in = pooled.flatten(2).transpose(1, 2)  # (B, M = Hs*Ws, C)
        else:
            hs, ws = H, W
            kv_in = x.reshape(B, H * W, C)
        M = kv_in.shape[1]
        kv = self.l_kv(kv_in).reshape(B, M, 2, self.l_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        # k, v as contiguous (B, l_heads, M, d): one small copy (M = N / s^2 tokens) that makes SDPA's CPU kernel
        # over the M keys faster than on the strided view
        k, v = kv.contiguous().unbind(0)
        drop = self.attn_drop if self.training else 0.0
        if self.pooled_queries:  # Table III: M queries, output resized back to H x W
            q = self.l_q(kv_in).reshape(B, M, self.l_heads, self.head_dim).transpose(1, 2)  # (B, l, M, d)
            o = F.scaled_dot_product_attention(q, k, v, dropout_p=drop)  # (B, l_heads, M, d)
            o = self.l_proj(o.transpose(1, 2).reshape(B, M, self.l_dim))  # (B, M, l_dim)
            o = o.transpose(1, 2).reshape(B, self.l_dim, hs, ws)
            o = F.interpolate(o, size=(H, W), mode="bilinear", align_corners=False)  # (B, l_dim, H, W)
            return o.permute(0, 2, 3, 1)
        if q is None:
            q = self.l_q(x)
        q = q.reshape(B, H * W, self.l_heads, self.head_dim).transpose(1, 2)  # (B, l_heads, N, d), a view
        o = F.scaled_dot_product_attention(q, k, v, dropout_p=drop)  # (B, l_heads, N, d)
        return self.l_proj(o.transpose(1, 2).reshape(B, H, W, self.l_dim))

    def attention_weights(self, x: torch.Tensor, H: int, W: int) -> torch.Tensor:
        """x (B, H, W, C) -> the attention of every head over the H*W tokens, (B, heads, N, N), Hi-Fi heads first
        (their channel order): rows sum to 1 and each head's output before its projection is ``A @ v`` with v
        the per-token values (for Lo-Fi ``l_kv(x)``: pooling commutes with the linear projection).

        Hi-Fi weights are 0 outside the query's s x s window; a Lo-Fi head's weight on a pooled key is spread
        evenly over the real tokens that key averages; with ``pooled_queries`` a token's row is the bilinear
        mix of its pooled queries' rows (the output is resized that way)."""
        B, s, d = x.shape[0], self.ws, self.head_dim
        N = H * W
        maps = []
        if self.h_heads:
            h = self.h_heads
            qkv = pad_to_multiple(self.h_qkv(x), s, s)
            nh, nw = qkv.shape[1] // s, qkv.shape[2] // s
            q, k, _ = qkv.view(B, nh, s, nw, s, 3, h, d).permute(5, 0, 1, 3, 6, 2, 4, 7).unbind(0)  # (B,nh,nw,h,s,s,d)
            q, k = q.reshape(B, nh * nw, h, s * s, d), k.reshape(B, nh * nw, h, s * s, d)
            logits = (q * d**-0.5) @ k.transpose(-2, -1)  # (B, nW, h, L, L)
            mask = valid_keys(H, W, s, s, x.device)  # (nW, 1, L)
            if mask is not None:
                logits = logits.masked_fill(~mask[:, None], float("-inf"))
            pos = torch.arange(nh * s * nw * s, device=x.device).view(nh, s, nw, s).permute(0, 2, 1, 3)
            pos = pos.reshape(nh * nw, s * s)  # window w, slot i -> raster index in the padded map
            dense = logits.new_zeros(B, h, nh * s * nw * s, nh * s * nw * s)
            dense[:, :, pos[:, :, None], pos[:, None, :]] = logits.softmax(-1).transpose(1, 2)
            real = (torch.arange(H, device=x.device)[:, None] * (nw * s) + torch.arange(W, device=x.device)).flatten()
            maps.append(dense[:, :, real][:, :, :, real])
        if self.l_heads:
            h = self.l_heads
            pooled = F.avg_pool2d(x.permute(0, 3, 1, 2), s, s, ceil_mode=True) if s > 1 else x.permute(0, 3, 1, 2)
            hs, ws = pooled.shape[-2:]
            kv_in = pooled.flatten(2).transpose(1, 2)  # (B, M, C)
            k = self.l_kv(kv_in)[..., :self.l_dim].reshape(B, hs * ws, h, d).transpose(1, 2)  # (B, h, M, d)
            q_in = kv_in if self.pooled_queries else x.reshape(B, N, -1)
            q = self.l_q(q_in).reshape(B, q_in.shape[1], h, d).transpose(1, 2)
            a = ((q * d**-0.5) @ k.transpose(-2, -1)).softmax(-1)  # (B, h, Nq, M)
            if self.pooled_queries:  # each token's row: the bilinear mix of the pooled rows (sums to 1)
                eye = torch.eye(hs * ws, dtype=a.dtype, device=x.device).view(1, hs * ws, hs, ws)
                mix = F.interpolate(eye, size=(H, W), mode="bilinear", align_corners=False).reshape(hs * ws, N)
                a = mix.t() @ a  # (B, h, N, M)
            ys, xs = torch.arange(H, device=x.device) // s, torch.arange(W, device=x.device) // s
            key = (ys[:, None] * ws + xs).flatten()  # pooled key of each token
            count = torch.bincount(key, minlength=hs * ws).to(a.dtype)  # real tokens per pooled key
            maps.append(a[..., key] / count[key])
        return torch.cat(maps, dim=1)

    def forward(self, x: torch.Tensor, hw: tuple[int, int] | None = None, return_attn: bool = False):
        """x (B, N, C) tokens of the hw = (H, W) grid -> (B, N, C); with ``return_attn=True`` also the attention
        weights (B, heads, N, N) of :meth:`attention_weights`."""
        H, W = grid_size(x, hw, "hilo")
        out = self.forward_grid(x, H, W)
        if not return_attn:
            return out
        return out, self.attention_weights(x.reshape(x.shape[0], H, W, -1), H, W)

    def forward_grid(self, x: torch.Tensor, H: int, W: int) -> torch.Tensor:
        """x (B, N, C) tokens of an H x W grid -> (B, N, C): :meth:`forward` without the attention weights, the
        method a faster implementation of the same arithmetic overrides (:mod:`vitlab.optimize.hilo`)."""
        B, N, C = x.shape
        x = x.reshape(B, H, W, C)
        if self.l_heads == 0:
            return self.proj_drop(self.place_hifi(None, self.hifi(self.h_qkv(x), H, W), H, W).reshape(B, N, C))
        if self.h_heads == 0:
            return self.proj_drop(self.lofi(x).reshape(B, N, C))
        if self.pooled_queries:
            hi, lo = self.hifi(self.h_qkv(x), H, W), self.lofi(x)
        else:
            # One projection for everything computed from the full map, Hi-Fi q, k, v and Lo-Fi q: one large
            # GEMM (and, under autocast, one bf16 cast of x) instead of two. Same weights, same MACs.
            w = torch.cat((self.h_qkv.weight, self.l_q.weight))  # (3 h_dim + l_dim, C)
            b = None if self.h_qkv.bias is None else torch.cat((self.h_qkv.bias, self.l_q.bias))
            y = F.linear(x, w, b)  # (B, H, W, 3 h_dim + l_dim)
            hq = 3 * self.h_dim
            hi, lo = self.hifi(y[..., :hq], H, W), self.lofi(x, y[..., hq:])
        # Hi-Fi channels first, as LITv2. Filled slice by slice rather than torch.cat, whose last-dim kernel is
        # several times slower than a strided copy on the CPU (and the Hi-Fi slice takes its window reverse).
        out = lo.new_empty(B, H, W, C)
        out[..., self.h_dim:] = lo
        self.place_hifi(out[..., :self.h_dim], hi, H, W)
        return self.proj_drop(out.reshape(B, N, C))

    @staticmethod
    def place_hifi(dst: torch.Tensor | None, hi: torch.Tensor, H: int, W: int) -> torch.Tensor:
        """Copy :meth:`hifi`'s output, windowed (B, nh, s, nw, s, h_dim) or raster (B, H, W, h_dim), into ``dst``
        (B, H, W, h_dim), cropping any padding; a new tensor when ``dst`` is None. The Hi-Fi branch's output as a
        map, for a caller that records it (the Hi-Fi spectra of the LITv2 supplementary, Pan et al., 2022, Fig. II)."""
        if hi.dim() == 4:  # raster order (an optimized Hi-Fi core, vitlab.optimize)
            return hi if dst is None else dst.copy_(hi)
        B, nh, s, nw, _, c = hi.shape
        if nh * s != H or nw * s != W:  # padded: reverse the windows, then crop
            hi = hi.reshape(B, nh * s, nw * s, c)[:, :H, :W]
            return hi.contiguous() if dst is None else dst.copy_(hi)
        if dst is None:
            return hi.reshape(B, H, W, c)
        dst.view(B, nh, s, nw, s, c).copy_(hi)
        return dst
