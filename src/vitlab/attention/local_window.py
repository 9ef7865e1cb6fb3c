"""Local window attention (Liu et al., "Swin Transformer: Hierarchical Vision Transformer using Shifted
Windows", ICCV 2021, W-MSA; row "Local Window" of Table IV in the LITv2 supplementary).
Also the base of ``shifted_window``.

The map is cut into non-overlapping ``window_size`` x ``window_size`` windows and multi-head self-attention
runs inside each window only: cost ``O(N ws^2 d)`` instead of ``O(N^2 d)``. With ``shift_size > 0`` (see
:mod:`vitlab.attention.shifted_window`) the windows are displaced by ``shift_size`` (a cyclic roll of the map,
Swin's SW-MSA) and a mask stops a window from mixing tokens that were not neighbours before the roll.

Defaults, Swin's setting for 1/16-scale maps (Swin-T/S/B stage 3): ``window_size=7``, ``rel_pos_bias=True``
(a learned (2ws-1)^2 x heads table, Swin's default; 2,028 parameters at 12 heads, which Table IV's 2.36 M
rounds away). At dim 768 / 12 heads / 14x14: 2.36 M parameters, 477.2 M MACs (Table IV: 2.36 M, 477.2 M).

Any H x W: the projected q / k / v map is zero-padded to a multiple of the window and the padded keys are
masked, so the output is what attention over the cropped border windows gives (Swin's code lets padded
tokens be attended to). A map no larger than one window along both axes is a single window: global
attention, equal to ``msa``. No prefix (class) tokens: a ValueError is raised when N != H*W.

Fast path: windows are folded next to the heads, ``(B, nW * heads, L, d)``, into
``scaled_dot_product_attention``; masks (padding, shift regions, position bias) are one ``(nW * heads, L, L)``
tensor shared by the batch, and none at all is passed when there is nothing to mask.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.nn.init import trunc_normal_

from vitlab.attention._registry import register_attention
from vitlab.attention._window import (
    additive,
    attend,
    expand_heads,
    grid_size,
    pad_to_multiple,
    partition,
    partition_qkv,
    relative_position_index,
    reverse,
    stitch_windows,
    window_positions,
)
from vitlab.layers.helpers import check_heads, to_2tuple


def _region(idx: torch.Tensor, size: int, ws: int, shift: int) -> torch.Tensor:
    """Swin's region label of each row (or column) of the rolled map: 0 untouched, 1 / 2 either side of the
    seam that the cyclic roll created inside the last window."""
    if shift == 0:
        return torch.zeros_like(idx)
    return (idx >= size - ws).long() + (idx >= size - shift).long()


class _WindowAttentionBase(nn.Module):
    """Window attention, optionally on a rolled map (``shift_size``). ``window_size`` and ``shift_size`` are an
    int or a (height, width) pair (Swin clamps its window to a smaller stage grid, which can make it oblong).
    Parameter names follow Swin / timm (``qkv``, ``proj``, ``relative_position_bias_table``), so Swin's
    checkpoints load as they are."""

    prefix_tokens = False  # a grid mechanism: x must hold exactly the H*W grid tokens
    has_attention_weights = True  # return_attn=True: dense (B, heads, N, N), 0 outside each query's window
    attention_kind = "window"
    _name = "window attention"

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = True, attn_drop: float = 0.0,
                 proj_drop: float = 0.0, window_size=7, shift_size=0, rel_pos_bias: bool = True):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = check_heads(dim, num_heads)
        (wh, ww), (sh, sw) = to_2tuple(window_size), to_2tuple(shift_size)
        if min(wh, ww) < 1 or not (0 <= sh < wh and 0 <= sw < ww):
            raise ValueError(f"need window_size >= 1 and 0 <= shift_size < window_size, got {window_size}, "
                             f"{shift_size}")
        self.window_size = window_size if isinstance(window_size, int) else (wh, ww)
        self.shift_size = shift_size if isinstance(shift_size, int) else (sh, sw)
        self._window, self._shift = (wh, ww), (sh, sw)
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = attn_drop
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        if rel_pos_bias:
            table = torch.zeros((2 * wh - 1) * (2 * ww - 1), num_heads)  # ((2wh-1)(2ww-1), heads)
            self.relative_position_bias_table = nn.Parameter(table)
            trunc_normal_(self.relative_position_bias_table, std=0.02)
            # derived from the window alone: not saved (timm drops it from its checkpoints too)
            self.register_buffer("relative_position_index", relative_position_index(wh, ww), persistent=False)
        else:
            self.relative_position_bias_table = None
        self._mask_cache: dict = {}

    def _structure_mask(self, H: int, W: int, sh: int, sw: int, device) -> torch.Tensor | None:
        """(nW, 1, L, L) bool "may attend" mask in the rolled, padded frame; None when nothing is masked."""
        wh, ww = self._window
        Hp, Wp = H + (-H) % wh, W + (-W) % ww
        if Hp == H and Wp == W and sh == 0 and sw == 0:
            return None
        key = (H, W, sh, sw, str(device))
        if key not in self._mask_cache:
            rows, cols = torch.arange(Hp, device=device), torch.arange(Wp, device=device)
            # a rolled position r holds the padded-map position (r + shift) % size: real if that is < H (or W)
            valid = (((rows + sh) % Hp) < H)[:, None] & (((cols + sw) % Wp) < W)[None, :]  # (Hp, Wp)
            region = _region(rows, Hp, wh, sh)[:, None] * 3 + _region(cols, Wp, ww, sw)[None, :]  # (Hp, Wp)
            valid_w = partition(valid[None, :, :, None], wh, ww, 1)[0, :, :, 0]  # (nW, L)
            region_w = partition(region[None, :, :, None], wh, ww, 1)[0, :, :, 0]  # (nW, L)
            allowed = (region_w[:, :, None] == region_w[:, None, :]) & valid_w[:, None, :]  # (nW, L, L)
            # a padded query whose region holds only padding keeps itself, so no softmax row is empty (NaN);
            # for real queries this changes nothing (they are valid keys of their own region)
            allowed |= torch.eye(wh * ww, dtype=torch.bool, device=device)
            self._mask_cache = {key: allowed[:, None]}  # keep one size only
        return self._mask_cache[key]

    def relative_position_bias(self) -> torch.Tensor:
        """(heads, L, L) bias B[i, j] = table[offset(i, j)] of the L = wh * ww positions of a window."""
        L = self._window[0] * self._window[1]
        bias = self.relative_position_bias_table[self.relative_position_index.reshape(-1)]  # (L*L, heads)
        return bias.t().reshape(self.num_heads, L, L)

    def _attn_mask(self, H: int, W: int, sh: int, sw: int, dtype, device) -> torch.Tensor | None:
        """(1, nW * heads, L, L) mask for the ``(B, nW * heads, L, d)`` layout (bool, or float with the bias);
        4-D, so that SDPA's fused CPU kernel takes it (see :func:`~vitlab.attention._window.expand_heads`)."""
        (wh, ww), L = self._window, self._window[0] * self._window[1]
        nW = -(-H // wh) * -(-W // ww)
        allowed = self._structure_mask(H, W, sh, sw, device)  # (nW, 1, L, L) or None
        if self.relative_position_bias_table is None:
            return None if allowed is None else expand_heads(allowed, self.num_heads)
        bias = self.relative_position_bias().to(dtype)[None]  # (1, heads, L, L)
        if allowed is not None:
            bias = bias + additive(allowed, dtype)  # (nW, heads, L, L)
        return bias.expand(nW, -1, -1, -1).reshape(1, nW * self.num_heads, L, L)

    def forward(self, x: torch.Tensor, hw: tuple[int, int] | None = None, return_attn: bool = False):
        """``return_attn``: also the weights, per-window softmax (bias and masks included) stitched into a dense
        (B, heads, N, N) map over the grid whose entries outside a query's window are 0."""
        H, W = grid_size(x, hw, self._name)
        B, N, C = x.shape
        (wh, ww), (sh, sw) = self._window, self._shift
        # shifting an axis that fits in one window would only wrap the map onto itself: skip it (as Swin does)
        sh = sh if H > wh else 0
        sw = sw if W > ww else 0
        qkv = pad_to_multiple(self.qkv(x).reshape(B, H, W, 3 * C), wh, ww)  # (B, Hp, Wp, 3C)
        Hp, Wp = qkv.shape[1:3]
        if sh or sw:
            qkv = torch.roll(qkv, shifts=(-sh, -sw), dims=(1, 2))
        q, k, v = partition_qkv(qkv, wh, ww, self.num_heads)  # (B, nW * heads, wh*ww, d)
        mask = self._attn_mask(H, W, sh, sw, q.dtype, x.device)
        drop = self.attn_drop if self.training else 0.0
        o, attn = attend(q, k, v, mask, drop, return_attn)  # (B, nW * heads, L, d)
        if return_attn:
            attn = stitch_windows(attn, window_positions(H, W, (wh, ww), (sh, sw), x.device), self.num_heads, N)
        o = reverse(o, wh, ww, Hp, Wp, self.num_heads)  # (B, Hp, Wp, C)
        if sh or sw:
            o = torch.roll(o, shifts=(sh, sw), dims=(1, 2))
        if Hp != H or Wp != W:
            o = o[:, :H, :W]
        out = self.proj_drop(self.proj(o.reshape(B, N, C)))
        return (out, attn) if return_attn else out


@register_attention("local_window")
class LocalWindowAttention(_WindowAttentionBase):
    _name = "local_window"

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = True, attn_drop: float = 0.0,
                 proj_drop: float = 0.0, window_size=7, rel_pos_bias: bool = True):
        super().__init__(dim, num_heads, qkv_bias, attn_drop, proj_drop, window_size=window_size,
                         shift_size=0, rel_pos_bias=rel_pos_bias)
