"""Shared helpers of the windowed mechanisms (local / shifted window, HiLo's Hi-Fi, CSWin stripes, Focal):
grid checks, zero-padding to a multiple of the window, window partition / reverse with einops, the
relative-position index of Swin, the explicit attention that returns its weights, and the stitching of
per-window weights into one (N x N) map over the grid.

Layout convention: windows are folded next to the heads, ``(B, nW * heads, L, d)``, so a mask that varies
per window and per head, ``(nW * heads, L, S)``, broadcasts over the batch without being copied per image,
and ``scaled_dot_product_attention`` sees one ordinary 4-D problem. This module registers nothing (its name
starts with an underscore so it reads as private; the package auto-import still imports it harmlessly).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange


def grid_size(x: torch.Tensor, hw, name: str) -> tuple[int, int]:
    """(H, W) of ``hw``; ValueError unless x holds exactly the H*W grid tokens (no prefix tokens)."""
    if hw is None:
        raise ValueError(f"{name} needs the grid size: call forward(x, hw=(H, W))")
    H, W = hw  # not int(): that would fix a symbolic (torch.export) size to the traced one
    if x.dim() != 3 or x.shape[1] != H * W:
        raise ValueError(f"{name} attends over an H x W grid and takes no prefix (class) tokens: got "
                         f"{tuple(x.shape[1:2])} tokens for a {H}x{W} grid ({H * W} expected)")
    return H, W


def pad_to_multiple(x: torch.Tensor, mh: int, mw: int) -> torch.Tensor:
    """Zero-pad a (B, H, W, C) map on the bottom / right to multiples of (mh, mw); a no-op when aligned."""
    H, W = x.shape[1], x.shape[2]
    pb, pr = (-H) % mh, (-W) % mw
    if pb or pr:
        x = F.pad(x, (0, 0, 0, pr, 0, pb))
    return x


def partition(x: torch.Tensor, wh: int, ww: int, heads: int) -> torch.Tensor:
    """(B, Hp, Wp, heads * d) -> (B, nW * heads, wh * ww, d), windows in row-major order."""
    return rearrange(x, "b (nh wh) (nw ww) (h d) -> b (nh nw h) (wh ww) d", wh=wh, ww=ww, h=heads)


def partition_qkv(qkv: torch.Tensor, wh: int, ww: int, heads: int):
    """(B, Hp, Wp, 3 * heads * d) -> q, k, v each (B, nW * heads, wh * ww, d), one copy for all three."""
    t = rearrange(qkv, "b (nh wh) (nw ww) (three h d) -> three b (nh nw h) (wh ww) d", wh=wh, ww=ww, three=3,
                  h=heads)
    return t.unbind(0)


def reverse(x: torch.Tensor, wh: int, ww: int, hp: int, wp: int, heads: int) -> torch.Tensor:
    """(B, nW * heads, wh * ww, d) -> (B, Hp, Wp, heads * d); inverse of :func:`partition`."""
    return rearrange(x, "b (nh nw h) (wh ww) d -> b (nh wh) (nw ww) (h d)", nh=hp // wh, nw=wp // ww, h=heads,
                     wh=wh, ww=ww)


def valid_keys(H: int, W: int, wh: int, ww: int, device=None) -> torch.Tensor | None:
    """(nW, 1, wh * ww) bool, True where the window position lies inside the H x W map; None without padding.

    A window partition of the padded map always keeps at least one real token per window (padding is smaller
    than the window), so masking padded *keys* never leaves a query row without a key.
    """
    if H % wh == 0 and W % ww == 0:
        return None
    m = torch.ones(1, H, W, 1, dtype=torch.bool, device=device)
    m = pad_to_multiple(m, wh, ww)  # pads with False
    return partition(m, wh, ww, 1)[0].transpose(-1, -2)  # (nW, 1, L)


def expand_heads(mask: torch.Tensor, heads: int) -> torch.Tensor:
    """(nW, ..., L, S) per-window mask -> (1, nW * heads, L, S) matching the ``(B, nW * heads, L, d)`` layout.

    4-D with a batch dimension of 1 on purpose: ``scaled_dot_product_attention``'s fused CPU kernel takes a mask
    that broadcasts over the batch only in 4-D (a 3-D mask sends it to the unfused math path)."""
    nW = mask.shape[0]
    mask = mask.reshape(nW, -1, *mask.shape[-2:])  # (nW, 1 or heads, L or 1, S)
    return mask.expand(nW, heads, *mask.shape[-2:]).reshape(1, nW * heads, *mask.shape[-2:])


def additive(mask: torch.Tensor, dtype) -> torch.Tensor:
    """Bool "may attend" mask -> additive float mask (0 / -inf) of ``dtype``."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def relative_position_index(wh: int, ww: int) -> torch.Tensor:
    """Swin's (wh*ww, wh*ww) index into a ((2wh-1)(2ww-1), heads) bias table, for every query-key pair."""
    grid = torch.meshgrid(torch.arange(wh), torch.arange(ww), indexing="ij")
    coords = torch.stack(grid).flatten(1)  # (2, L)
    rel = coords[:, :, None] - coords[:, None, :]  # (2, L, L), in [-(w-1), w-1]
    return (rel[0] + wh - 1) * (2 * ww - 1) + (rel[1] + ww - 1)


def window_positions(H: int, W: int, window: tuple[int, int], shift: tuple[int, int] = (0, 0),
                     device=None) -> torch.Tensor:
    """(nW, L) raster index (row * W + col) in the H x W map of each token of each window, in the order the
    window attention sees them (padded to a multiple of the window, rolled by ``-shift``); -1 for padding."""
    (wh, ww), (sh, sw) = window, shift
    idx = torch.arange(H * W, device=device).reshape(1, H, W, 1) + 1  # +1: zero padding marks "no token" below
    idx = pad_to_multiple(idx, wh, ww)
    if sh or sw:
        idx = torch.roll(idx, shifts=(-sh, -sw), dims=(1, 2))
    return partition(idx, wh, ww, 1)[0, :, :, 0] - 1  # (nW, L)


def stitch_windows(attn: torch.Tensor, pos: torch.Tensor, heads: int, n: int) -> torch.Tensor:
    """Per-window weights (B, nW * heads, L, L) (windows outer, heads inner) -> dense (B, heads, n, n) over the
    map's raster order: entry (i, j) is the weight of query i on key j when both lie in one window, else 0 (the
    attention the window restriction imposes)."""
    B, L = attn.shape[0], attn.shape[-1]
    nW = pos.shape[0]
    a = attn.reshape(B, nW, heads, L, L)
    dev = pos.device
    w, i, j = torch.meshgrid(torch.arange(nW, device=dev), torch.arange(L, device=dev), torch.arange(L, device=dev),
                             indexing="ij")
    qi, kj = pos[w, i], pos[w, j]
    keep = (qi >= 0) & (kj >= 0)  # drop padded queries / keys
    w, i, j, qi, kj = w[keep], i[keep], j[keep], qi[keep], kj[keep]
    dense = attn.new_zeros(B, heads, n, n)
    dense[:, :, qi, kj] = a[:, w, :, i, j].permute(1, 2, 0)  # (B, heads, pairs)
    return dense


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, drop: float,
           return_attn: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(output, weights or None): the fused ``scaled_dot_product_attention``, or with ``return_attn`` the same
    function spelled out (:func:`explicit_attention`) so the weights can be returned."""
    if return_attn:
        return explicit_attention(q, k, v, mask, drop)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=drop), None


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, drop: float,
                       scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``scaled_dot_product_attention``'s function with its weights: (output, softmax weights before dropout).
    ``mask``: boolean (True = attend) or additive, broadcast to the logits."""
    logits = (q * (q.shape[-1] ** -0.5 if scale is None else scale)) @ k.transpose(-2, -1)
    if mask is not None and mask.dtype == torch.bool:
        logits = logits.masked_fill(~mask, float("-inf"))
    elif mask is not None:
        logits = logits + mask
    attn = logits.softmax(dim=-1)
    return F.dropout(attn, drop) @ v, attn
