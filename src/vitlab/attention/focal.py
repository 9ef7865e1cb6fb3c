"""Focal self-attention (Yang, Li, Zhang, Dai, Xiao, Yuan, Gao, "Focal Self-attention for Local-Global
Interactions in Vision Transformers", NeurIPS 2021; row "Focal" of Table IV in the LITv2 supplementary).

The queries of each ``window_size`` x ``window_size`` window attend to keys / values at two granularities:

* level 0, fine: the window's own tokens plus its surroundings within ``expand_size`` tokens, gathered as in
  the official code: four window-sized blocks displaced diagonally by ``expand_size`` (towards each corner),
  of which the positions outside the window are kept (4 (ws^2 - (ws - e)^2) = 132 keys for ws 7, e 3; the
  row and column through the window centre lie in two blocks and so appear twice, as in the official code);
* level 1, coarse: every window pooled to one token by a learned weighted sum over its positions (``fc``
  pooling, initialised to the mean), projected to keys / values, and the ``focal_window`` x ``focal_window``
  pooled windows around the query's window are attended to.

Relative position biases as in the official code: Swin's table inside the window
(``relative_position_bias_table``), a free (heads, ws^2, 132) bias to the surroundings
(``relative_position_bias_table_to_neighbors``) and a (heads, (ws + fw - 1)^2) table for query position ->
pooled window (``relative_position_bias_table_to_windows``). Everything goes through one
``scaled_dot_product_attention`` per forward, with biases and masks as one float ``attn_mask``
``(nW * heads, ws^2, ws^2 + 132 + fw^2)`` shared by the batch.

Defaults, Focal-T/S/B's setting for 1/16-scale maps (stage 3): ``window_size=7``, ``expand_size=3``,
``focal_level=2``, ``focal_window=3``, ``pool_method='fc'``. At dim 768 / 12 heads / 14x14: 2.44 M parameters,
524.5 M MACs (Table IV: 2.44 M, 526.9 M, -0.45%: the official code runs the full qkv projection on the pooled
tokens and drops the queries; we project the pooled tokens to keys and values only).

Deviations from the official code, both at the border of the map: surroundings and pooled windows outside
the map are masked (the official code gathers surroundings with ``torch.roll``, which wraps the opposite
border in, and gives out-of-map pooled windows a -100 bias); padding to a multiple of the window happens
after the qkv projection and padded keys are masked (the official code pads the input, so padded tokens
carry the qkv bias and are attended to). Pooled windows that contain padding pool it as zeros, as in the
official code. Only ``focal_level`` 1 or 2 (the levels all published models use at stage 3). No prefix (class)
tokens: a ValueError is raised when N != H*W.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange
from torch.nn.init import trunc_normal_

from vitlab.attention._registry import register_attention
from vitlab.attention._window import (
    attend,
    grid_size,
    pad_to_multiple,
    partition,
    partition_qkv,
    relative_position_index,
    reverse,
)
from vitlab.layers.helpers import check_heads


def _neighbour_slots(ws: int, e: int) -> torch.Tensor:
    """Flat indices into the 4 concatenated (ws*ws) diagonal blocks of the positions that lie outside the
    window, in the official order (block towards bottom-right, bottom-left, top-right, top-left)."""
    keep = [lambda i, j: i >= ws - e or j >= ws - e, lambda i, j: i >= ws - e or j < e,
            lambda i, j: i < e or j >= ws - e, lambda i, j: i < e or j < e]
    # plain Python so the index also builds under a meta-device context (nonzero has no meta kernel)
    slots = [b * ws * ws + i * ws + j
             for b, f in enumerate(keep) for i in range(ws) for j in range(ws) if f(i, j)]
    return torch.tensor(slots, dtype=torch.long)


# block displacements (dy, dx) matching _neighbour_slots: block content at window position p is map[p + d]
def _displacements(e: int):
    return [(e, e), (e, -e), (-e, e), (-e, -e)]


def _window_to_pooled_index(ws: int, fw: int) -> torch.Tensor:
    """(ws*ws, fw*fw) index into a (ws + fw - 1)^2 table: query position in the window -> pooled window."""
    qy, qx = torch.meshgrid(torch.arange(ws), torch.arange(ws), indexing="ij")
    ky, kx = torch.meshgrid(torch.arange(fw), torch.arange(fw), indexing="ij")
    dy = qy.flatten()[:, None] - ky.flatten()[None] + fw - 1  # (L, fw^2) in [0, ws + fw - 2]
    dx = qx.flatten()[:, None] - kx.flatten()[None] + fw - 1
    return dy * (ws + fw - 1) + dx


@register_attention("focal")
class FocalAttention(nn.Module):
    prefix_tokens = False  # a grid mechanism: x must hold exactly the H*W grid tokens
    has_attention_weights = True  # return_attn=True: (B, heads, N, S), each query over its window's S keys
    attention_kind = "focal"

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = True, attn_drop: float = 0.0,
                 proj_drop: float = 0.0, window_size: int = 7, expand_size: int = 3, focal_level: int = 2,
                 focal_window: int = 3, pool_method: str = "fc"):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = check_heads(dim, num_heads)
        if focal_level not in (1, 2):
            raise ValueError(f"focal supports focal_level 1 or 2, got {focal_level}")
        if pool_method not in ("fc", "mean"):
            raise ValueError(f"pool_method must be 'fc' or 'mean', got {pool_method!r}")
        if not 0 <= expand_size < window_size:
            raise ValueError(f"need 0 <= expand_size < window_size, got {expand_size}, {window_size}")
        ws, L = window_size, window_size**2
        self.window_size, self.expand_size = ws, expand_size
        self.focal_level, self.focal_window, self.pool_method = focal_level, focal_window, pool_method
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.relative_position_bias_table = nn.Parameter(torch.zeros((2 * ws - 1) ** 2, num_heads))
        trunc_normal_(self.relative_position_bias_table, std=0.02)
        self.register_buffer("relative_position_index", relative_position_index(ws, ws), persistent=False)
        if expand_size > 0:
            slots = _neighbour_slots(ws, expand_size)
            self.register_buffer("valid_ind_rolled", slots, persistent=False)
            to_neighbors = torch.zeros(1, num_heads, L, len(slots))  # a free bias per (head, query, slot)
            self.relative_position_bias_table_to_neighbors = nn.Parameter(to_neighbors)
            trunc_normal_(self.relative_position_bias_table_to_neighbors, std=0.02)
        if focal_level > 1:
            if pool_method == "fc":
                self.pool_layers = nn.ModuleList([nn.Linear(L, 1)])
                nn.init.constant_(self.pool_layers[0].weight, 1.0 / L)
                nn.init.zeros_(self.pool_layers[0].bias)
            table = torch.zeros(num_heads, (ws + focal_window - 1) ** 2)
            trunc_normal_(table, std=0.02)
            self.relative_position_bias_table_to_windows = nn.ParameterList([nn.Parameter(table)])
            self.register_buffer("relative_position_index_0", _window_to_pooled_index(ws, focal_window),
                                 persistent=False)
        self.attn_drop = attn_drop
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def _surroundings(self, t: torch.Tensor, heads: int) -> torch.Tensor:
        """(B, Hp, Wp, C') map -> (B, nW * heads, n_slots, C' / heads): each window's surrounding tokens."""
        e = self.expand_size
        ws = self.window_size
        Hp, Wp = t.shape[1:3]
        tp = F.pad(t, (0, 0, e, e, e, e))  # (B, Hp + 2e, Wp + 2e, C'), zeros outside the map (masked)
        blocks = [partition(tp[:, e + dy:e + dy + Hp, e + dx:e + dx + Wp], ws, ws, heads)
                  for dy, dx in _displacements(e)]  # 4 x (B, nW * heads, L, d)
        return torch.cat(blocks, dim=2).index_select(2, self.valid_ind_rolled)  # (B, nW * heads, slots, d)

    def _pooled_neighbourhood(self, t: torch.Tensor) -> torch.Tensor:
        """(B, nWh, nWw, C') pooled map -> (B, nWh, nWw, fw*fw, C'): the fw x fw pooled windows around."""
        fw, p = self.focal_window, self.focal_window // 2
        nWh, nWw = t.shape[1:3]
        tp = F.pad(t, (0, 0, p, fw - 1 - p, p, fw - 1 - p))
        return torch.stack([tp[:, a:a + nWh, b:b + nWw] for a in range(fw) for b in range(fw)], dim=3)

    def _mask(self, H: int, W: int, Hp: int, Wp: int, dtype, device) -> torch.Tensor:
        """(1, nW * heads, L, S) float mask: position biases, and -inf on keys outside the H x W map (4-D for
        SDPA's fused CPU kernel, see :func:`~vitlab.attention._window.expand_heads`)."""
        ws, h, L = self.window_size, self.num_heads, self.window_size**2
        real = torch.zeros(1, Hp, Wp, 1, dtype=torch.bool, device=device)
        real[:, :H, :W] = True
        valid = [partition(real, ws, ws, 1)[0, :, :, 0]]  # (nW, L) the window itself
        rpb = self.relative_position_bias_table[self.relative_position_index.reshape(-1)]  # (L*L, h)
        bias = [rpb.t().reshape(h, L, L)]
        if self.expand_size > 0:
            valid.append(self._surroundings(real, 1)[0, :, :, 0])  # (nW, slots)
            bias.append(self.relative_position_bias_table_to_neighbors[0])  # (h, L, slots)
        if self.focal_level > 1:
            cells = torch.ones(1, Hp // ws, Wp // ws, 1, dtype=torch.bool, device=device)
            valid.append(self._pooled_neighbourhood(cells)[0, :, :, :, 0].flatten(0, 1))  # (nW, fw^2)
            table = self.relative_position_bias_table_to_windows[0]
            bias.append(table[:, self.relative_position_index_0.reshape(-1)].reshape(h, L, -1))  # h, L, fw^2
        valid = torch.cat(valid, dim=1)  # (nW, S)
        bias = torch.cat(bias, dim=2).to(dtype)  # (h, L, S)
        neg = torch.zeros(valid.shape, dtype=dtype, device=device).masked_fill_(~valid, float("-inf"))
        mask = bias[None] + neg[:, None, None, :]  # (nW, h, L, S)
        return mask.reshape(1, -1, L, mask.shape[-1])

    def forward(self, x: torch.Tensor, hw: tuple[int, int] | None = None, return_attn: bool = False):
        """``return_attn``: also the weights (B, heads, N, S) of each query (raster order) over the S keys of its
        window: the window's own L tokens, its surroundings, then the pooled windows around (masked keys 0)."""
        H, W = grid_size(x, hw, "focal")
        B, N, C = x.shape
        ws, h = self.window_size, self.num_heads
        xm = x.reshape(B, H, W, C)
        qkv = pad_to_multiple(self.qkv(xm), ws, ws)  # (B, Hp, Wp, 3C), zeros (masked) past the map
        Hp, Wp = qkv.shape[1:3]
        q, k, v = partition_qkv(qkv, ws, ws, h)  # (B, nW * h, L, d)
        ks, vs = [k], [v]
        if self.expand_size > 0:
            ks.append(self._surroundings(qkv[..., C:2 * C], h))  # (B, nW * h, slots, d)
            vs.append(self._surroundings(qkv[..., 2 * C:], h))
        if self.focal_level > 1:
            win = rearrange(pad_to_multiple(xm, ws, ws), "b (nh wh) (nw ww) c -> b nh nw c (wh ww)", wh=ws,
                            ww=ws)  # (B, nWh, nWw, C, L)
            pooled = self.pool_layers[0](win)[..., 0] if self.pool_method == "fc" else win.mean(-1)
            kv = F.linear(pooled, self.qkv.weight[C:], None if self.qkv.bias is None else self.qkv.bias[C:])
            kv = self._pooled_neighbourhood(kv)  # (B, nWh, nWw, fw^2, 2C)
            kp, vp = rearrange(kv, "b nh nw j (two h d) -> two b (nh nw h) j d", two=2, h=h).unbind(0)
            ks.append(kp)
            vs.append(vp)
        k, v = torch.cat(ks, dim=2), torch.cat(vs, dim=2)  # (B, nW * h, S, d)
        mask = self._mask(H, W, Hp, Wp, q.dtype, x.device)  # (1, nW * h, L, S)
        drop = self.attn_drop if self.training else 0.0
        o, attn = attend(q, k, v, mask, drop, return_attn)  # (B, nW * h, L, d)
        if return_attn:
            attn = rearrange(attn, "b (nh nw h) (wh ww) s -> b h (nh wh) (nw ww) s", nh=Hp // ws, h=h, wh=ws)
            attn = attn[:, :, :H, :W].reshape(B, h, N, -1)
        o = reverse(o, ws, ws, Hp, Wp, h)  # (B, Hp, Wp, C)
        if Hp != H or Wp != W:
            o = o[:, :H, :W]
        out = self.proj_drop(self.proj(o.reshape(B, N, C)))
        return (out, attn) if return_attn else out
