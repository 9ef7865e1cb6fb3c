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
must be exactly the H x W grid: prefix tokens are refused with a ValueError. ``forward(x, hw,
return_attn=True)`` also returns the attention weights of every level (see :meth:`QuadTreeAttention.forward`).
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
    # copies whole rows, where gather with an expanded index reads element by element (slower on the CPU,
    # most of all in bf16).
    rows = (idx + torch.arange(B * h, device=idx.device).view(B, h, 1, 1) * P).reshape(-1)  # (B*h*Q*K,)
    return t.reshape(B * h * P, 4 * d).index_select(0, rows).view(B, h, Q, 4 * K, d)


def _z_to_raster(attn: torch.Tensor, hw_coarse: tuple[int, int], fine: int, crop: tuple[int, int]) -> torch.Tensor:
    """(B, heads, L, L) weights over a level's tokens in Z-order below ``hw_coarse`` cells of ``fine`` x ``fine``
    -> (B, heads, n, n) over the level's first ``crop`` = (h, w) rows and columns in raster order."""
    Hc, Wc = hw_coarse
    z = _to_z(torch.arange(Hc * fine * Wc * fine, device=attn.device).view(1, 1, Hc * fine, Wc * fine), 1, fine)
    z = z.reshape(-1)  # raster index of each Z-order token
    h, w = crop
    keep = ((z // (Wc * fine)) < h) & ((z % (Wc * fine)) < w)  # drop cells that hold only padding
    order = z[keep].argsort()  # Z positions of the kept cells, raster order
    zi = keep.nonzero().squeeze(1)[order]
    return attn[:, :, zi][:, :, :, zi]


@register_attention("quadtree")
class QuadTreeAttention(nn.Module):
    has_attention_weights = True  # return_attn=True: one (B, heads, N_l, N_l) map per level, finest first
    attention_kind = "quadtree"
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

    def forward(self, x: torch.Tensor, hw: tuple[int, int], return_attn: bool = False):
        """x (B, N, C) tokens of the hw = (H, W) grid -> (B, N, C). ``return_attn=True`` also returns the
        attention weights of every level, finest first: a list whose entry l is (B, heads, N_l, N_l) over the
        level's grid in raster order (level 0: the H x W tokens; level l: the ceil(H / 2^l) x ceil(W / 2^l)
        cells), 0 outside each query's candidates. Level l's message is ``A_l @ v_l`` with v_l the level's values
        (level 0: the projected values; coarser: the value branch's output)."""
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
        # level i in Z-order: (B, heads, L_i, d) each, L_i = Hc*Wc*4^(L-1-i); validity (L_i,) or None
        zs = [tuple(_to_z(t, nh, 2 ** (L - 1 - i)) for t in (qs[i], ks[i], vs[i])) for i in range(L)]
        zvalid = [None if m is None else _to_z(m, 1, 2 ** (L - 1 - i)).reshape(-1).bool()
                  for i, m in enumerate(valids)]
        drop = self.attn_drop if self.training else 0.0

        # coarsest level: full attention; keep each query's top-k keys
        qc, kc, vc = zs[L - 1]
        logits = (qc * self.scale) @ kc.transpose(-2, -1)  # (B, heads, Lc, Lc)
        if zvalid[L - 1] is not None:
            # the fill value of the logits' own dtype: under autocast they are bf16 / fp16 while x is fp32
            logits = logits.masked_fill(~zvalid[L - 1], torch.finfo(logits.dtype).min)
        attn = logits.softmax(dim=-1)
        weights = [attn]  # per level, coarsest first, Z-order; kept only for return_attn
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
            # child positions of the candidates at this level (Z-order)
            cand = (idx.unsqueeze(-1) * 4 + torch.arange(4, device=idx.device)).flatten(-2)  # (B, h, P, 4K)
            if i == 0 and not return_attn:  # last level: no selection, plain softmax attention per parent group
                mask = None if cand_valid is None else cand_valid.flatten(1, 2)
                msg = F.scaled_dot_product_attention(qg.flatten(1, 2), kg.flatten(1, 2), vg.flatten(1, 2),
                                                     attn_mask=mask, dropout_p=drop)  # (B, heads*P, 4, d)
            else:
                logits = (qg * self.scale) @ kg.transpose(-2, -1)  # (B, heads, P, 4, 4K)
                if cand_valid is not None:
                    logits = logits.masked_fill(~cand_valid, torch.finfo(logits.dtype).min)
                attn = logits.softmax(dim=-1)
                msg = F.dropout(attn, drop, self.training) @ vg  # (B, heads, P, 4, d)
                if return_attn:
                    dense = attn.new_zeros(B, nh, P, 4, 4 * P)
                    weights.append(dense.scatter_(-1, cand[:, :, :, None].expand_as(attn), attn).view(
                        B, nh, 4 * P, 4 * P))
                if i:  # each query's own top-k among its candidates selects the next level's parents
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
        out = self.proj_drop(self.proj(out.reshape(B, N, C)))
        if not return_attn:
            return out
        # weights[j] is level L - 1 - j, whose tokens lie in Z-order below 2^j x 2^j blocks of the coarse cells
        return out, [_z_to_raster(weights[L - 1 - lvl], (Hc, Wc), 2 ** (L - 1 - lvl),
                                  (-(-H // 2**lvl), -(-W // 2**lvl))) for lvl in range(L)]
