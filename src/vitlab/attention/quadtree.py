"""QuadTree attention, variant B (Tang, Zhang, Zhu, Tan, "QuadTree Attention for Vision Transformers", ICLR
2022; row "QuadTree" of Table IV in the LITv2 supplementary).

Queries, keys and values are built into pyramids of ``num_levels`` levels (each coarser level halves H and W:
queries and keys by 2x2 average pooling, values by a learned "value branch" GroupNorm-GELU-conv2x2/2-
GroupNorm-GELU-conv1x1). At the coarsest level every query attends to all keys; each query keeps the ``topk``
keys with the highest scores. At the next finer level the four children of a query attend only to the 4 x topk
children of their parent's selected keys, and so on down to full resolution (cost ``O(N topk)`` instead of
``O(N^2)``). Variant B keeps the message of every level: the output is ``sum_l w_l * up(m_l + LePE_l(v_l))``
with softmax weights w over levels, nearest-neighbour upsampling, and a locally-enhanced positional term (3x3
depth-wise convolution of the level's values), then a linear projection.

Defaults (the authors' settings for a 1/16-scale map, their PVTv2-based QuadTree-B stage 3): ``num_levels=2``
(their ``sr_ratio=2``), ``topk=8``, LePE on, GELU in the value branch: 5.33 M parameters. MACs: Table IV gives
613.3 M, which counts the two GroupNorms (~0.9 M, fvcore) but not the fine-level gather kernels (their custom
CUDA ops, 9.6 M); we count the fine level (it is a matmul / SDPA here) and not norms: 621.9 M (+1.4%).

Any H, W: the grid is zero-padded up to a multiple of ``2^(num_levels-1)``; padded positions are excluded from
pooling averages and masked out as keys, and cropped from the output. Tokens are handled in a Z-order (Morton)
layout per level, so the four children of coarse token p are tokens 4p..4p+3 of the next level. The tokens
must be exactly the H x W grid: prefix tokens are refused with a ValueError.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from vitlab.attention._registry import register_attention
from vitlab.layers.helpers import check_heads


def _to_z(t: torch.Tensor, heads: int, fine: int) -> torch.Tensor:
    """(B, C, Hc*2^m, Wc*2^m) grid -> (B, heads, L, C/heads) tokens in Z-order below the Hc x Wc cells."""
    B, C, H, W = t.shape
    m = fine.bit_length() - 1  # fine = 2^m
    Hc, Wc = H // fine, W // fine
    t = t.reshape(B, heads, C // heads, Hc, *([2] * m), Wc, *([2] * m))
    order = [0, 1, 3, 4 + m]
    for j in range(m):
        order += [4 + j, 5 + m + j]
    return t.permute(*order, 2).reshape(B, heads, -1, C // heads)


def _from_z(t: torch.Tensor, hw_coarse: tuple[int, int], fine: int) -> torch.Tensor:
    """Inverse of :func:`_to_z`, returning channels last: (B, heads, L, d) -> (B, Hc*2^m, Wc*2^m, heads*d)."""
    B, heads, L, d = t.shape
    m = fine.bit_length() - 1
    Hc, Wc = hw_coarse
    t = t.reshape(B, heads, Hc, Wc, *([2] * (2 * m)), d)
    order = [0, 2] + [4 + 2 * j for j in range(m)] + [3] + [5 + 2 * j for j in range(m)] + [1, 4 + 2 * m]
    return t.permute(*order).reshape(B, Hc * fine, Wc * fine, heads * d)


def _gather_children(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Children of selected parents. t (B, h, 4P, d) at the finer level, idx (B, h, Q, K) parent indices in
    [0, P): returns (B, h, Q, 4K, d), the 4 children of each of the K parents."""
    B, h, L, d = t.shape
    Q, K = idx.shape[-2:]
    P = L // 4
    # A parent's children are contiguous in Z-order, so each selection is one row of 4d values: index_select
    # copies whole rows (on the CPU 1.4x faster than gather with an expanded index in fp32, 8x in bf16).
    rows = (idx + torch.arange(B * h, device=idx.device).view(B, h, 1, 1) * P).reshape(-1)  # (B*h*Q*K,)
    return t.reshape(B * h * P, 4 * d).index_select(0, rows).view(B, h, Q, 4 * K, d)


@register_attention("quadtree")
class QuadTreeAttention(nn.Module):
    prefix_tokens = False  # a grid mechanism: x must hold exactly the H*W grid tokens

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = True, attn_drop: float = 0.0,
                 proj_drop: float = 0.0, num_levels: int = 2, topk: int = 8, lepe: bool = True):
        super().__init__()
        if num_levels < 2:
            raise ValueError(f"quadtree attention needs num_levels >= 2, got {num_levels}")
        self.num_heads = num_heads
        self.head_dim = check_heads(dim, num_heads)
        self.scale = self.head_dim**-0.5
        self.num_levels = num_levels
        self.topk = topk
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)  # = the authors' three 1x1 convolutions
        self.value_branches = nn.ModuleList(
            nn.Sequential(nn.GroupNorm(1, dim), nn.GELU(), nn.Conv2d(dim, dim, 2, stride=2),
                          nn.GroupNorm(1, dim), nn.GELU(), nn.Conv2d(dim, dim, 1))
            for _ in range(num_levels - 1))
        self.lepe = nn.ModuleList(nn.Conv2d(dim, dim, 3, padding=1, groups=dim) for _ in range(num_levels)) \
            if lepe else None
        self.level_weight = nn.Parameter(torch.zeros(num_levels))  # softmax -> equal weights at init
        self.attn_drop = attn_drop
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor, hw: tuple[int, int]) -> torch.Tensor:
        B, N, C = x.shape
        H, W = hw
        if N != H * W:
            raise ValueError(f"quadtree takes exactly the {H}x{W} grid tokens (no prefix tokens), got N={N}")
        nh, f = self.num_heads, 2 ** (self.num_levels - 1)
        Hp, Wp = -(-H // f) * f, -(-W // f) * f  # padded to a multiple of 2^(levels-1)
        grid = self.qkv(x).view(B, H, W, 3 * C).permute(0, 3, 1, 2)  # (B, 3C, H, W), channels-last view
        valid = None
        if (Hp, Wp) != (H, W):
            grid = F.pad(grid, (0, Wp - W, 0, Hp - H))
            valid = F.pad(x.new_ones(1, 1, H, W), (0, Wp - W, 0, Hp - H))  # (1, 1, Hp, Wp)
        q, k, v = grid.split(C, dim=1)  # (B, C, Hp, Wp) each

        # pyramids, finest (level 0) to coarsest (level L-1)
        qs, ks, vs, valids = [q], [k], [v], [valid]
        for branch in self.value_branches:
            q, k = F.avg_pool2d(q, 2), F.avg_pool2d(k, 2)
            if valid is not None:  # mean over the valid children only
                frac = F.avg_pool2d(valid, 2)
                q, k = q / frac.clamp_min(1e-6), k / frac.clamp_min(1e-6)
                valid = (frac > 0).to(frac.dtype)
            v = branch(v)
            qs.append(q), ks.append(k), vs.append(v), valids.append(valid)

        Hc, Wc = Hp // f, Wp // f
        L = self.num_levels
        neg = torch.finfo(x.dtype).min
        # level i in Z-order: (B, heads, L_i, d) each, L_i = Hc*Wc*4^(L-1-i); validity (L_i,) or None
        zs = [tuple(_to_z(t, nh, 2 ** (L - 1 - i)) for t in (qs[i], ks[i], vs[i])) for i in range(L)]
        zvalid = [None if m is None else _to_z(m, 1, 2 ** (L - 1 - i)).reshape(-1).bool()
                  for i, m in enumerate(valids)]
        drop = self.attn_drop if self.training else 0.0

        # coarsest level: full attention; keep each query's top-k keys
        qc, kc, vc = zs[L - 1]
        logits = (qc * self.scale) @ kc.transpose(-2, -1)  # (B, heads, Lc, Lc)
        if zvalid[L - 1] is not None:
            logits = logits.masked_fill(~zvalid[L - 1], neg)
        attn = logits.softmax(dim=-1)
        messages = [F.dropout(attn, drop, self.training) @ vc]  # (B, heads, Lc, d)
        idx = logits.topk(min(self.topk, logits.shape[-1]), dim=-1).indices  # (B, heads, Lc, K)

        # finer levels: the 4 children of each query attend to the children of the parent's top-k keys
        for i in range(L - 2, -1, -1):
            qf, kf, vf = zs[i]
            P, K, d = idx.shape[-2], idx.shape[-1], self.head_dim
            qg = qf.view(B, nh, P, 4, d)  # children of parent p: (B, heads, P, 4, d)
            kg, vg = _gather_children(kf, idx), _gather_children(vf, idx)  # (B, heads, P, 4K, d)
            cand_valid = None
            if zvalid[i] is not None:
                cand_valid = zvalid[i].view(-1, 4)[idx].reshape(B, nh, P, 1, 4 * K)  # (B, heads, P, 1, 4K)
            if i == 0:  # last level: no selection needed, plain softmax attention per parent group
                mask = None if cand_valid is None else cand_valid.flatten(1, 2)
                msg = F.scaled_dot_product_attention(qg.flatten(1, 2), kg.flatten(1, 2), vg.flatten(1, 2),
                                                     attn_mask=mask, dropout_p=drop)  # (B, heads*P, 4, d)
            else:
                logits = (qg * self.scale) @ kg.transpose(-2, -1)  # (B, heads, P, 4, 4K)
                if cand_valid is not None:
                    logits = logits.masked_fill(~cand_valid, neg)
                attn = logits.softmax(dim=-1)
                msg = F.dropout(attn, drop, self.training) @ vg  # (B, heads, P, 4, d)
                # child positions of the candidates, then each query's own top-k among them
                cand = (idx.unsqueeze(-1) * 4 + torch.arange(4, device=idx.device)).flatten(-2)  # (B,h,P,4K)
                sel = logits.topk(min(self.topk, 4 * K), dim=-1).indices  # (B, heads, P, 4, K')
                idx = cand.unsqueeze(3).expand(-1, -1, -1, 4, -1).gather(-1, sel).flatten(2, 3)  # (B,h,4P,K')
            messages.append(msg.reshape(B, nh, -1, d))  # (B, heads, L_i, d)

        # merge levels coarse to fine: weighted (message + LePE), nearest upsampling = repeat in Z-order
        w = self.level_weight.softmax(0)
        out = None
        for j, msg in enumerate(messages):  # j = 0 is the coarsest level
            lvl = L - 1 - j
            if self.lepe is not None:
                msg = msg + _to_z(self.lepe[lvl](vs[lvl]), nh, 2**j)
            msg = msg * w[lvl]
            out = msg if out is None else (out.unsqueeze(3) + msg.view(*out.shape[:3], 4, -1)).flatten(2, 3)
        out = _from_z(out, (Hc, Wc), f)  # (B, Hp, Wp, C)
        if (Hp, Wp) != (H, W):
            out = out[:, :H, :W]
        return self.proj_drop(self.proj(out.reshape(B, N, C)))
