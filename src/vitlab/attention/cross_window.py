"""Cross-shaped window attention with locally-enhanced positional encoding, CSWin (Dong et al., "CSWin
Transformer: A General Vision Transformer Backbone with Cross-Shaped Windows", CVPR 2022; row "Cross Window"
of Table IV in the LITv2 supplementary).

One qkv projection; the channels (and heads) are split in two halves. The first half attends inside vertical
stripes (full height, ``split_size`` columns wide), the second inside horizontal stripes (``split_size`` rows,
full width), so each token sees a cross-shaped region. LePE adds a depthwise 3x3 convolution of the values
(applied per stripe, zero-padded at its edges, as in the official code) to each branch's attention output.
The halves are concatenated and projected. Names follow the official code (``qkv``, ``attns.{0,1}.get_v``,
``proj``).

Defaults, CSWin's setting for 1/16-scale maps (CSWin-T/S/B stage 3): ``split_size=7``. At dim 768 / 12 heads /
14x14: 2.37 M parameters, 493.3 M MACs (Table IV: 2.37 M, 493.3 M). Unlike CSWin's last stage (a map equal to
the stripe width switches to one full-attention branch) the two branches are always kept; on such a map each
branch is global attention over its half of the heads.

Any H x W: each branch pads only the axis it cuts (the projected q / k / v, so padded values are zero as the
LePE convolution's own padding) and masks the padded keys. No prefix (class) tokens: a ValueError is raised
when N != H*W.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from vitlab.attention._registry import register_attention
from vitlab.attention._window import (
    attend,
    expand_heads,
    grid_size,
    stitch_windows,
    valid_keys,
    window_positions,
)
from vitlab.layers.helpers import check_heads


class _LePE(nn.Module):
    """Holds one branch's depthwise 3x3 convolution on the values (official name: ``get_v``)."""

    def __init__(self, dim: int):
        super().__init__()
        self.get_v = nn.Conv2d(dim, dim, kernel_size=3, padding=1, groups=dim)


@register_attention("cross_window")
class CrossWindowAttention(nn.Module):
    prefix_tokens = False  # a grid mechanism: x must hold exactly the H*W grid tokens
    has_attention_weights = True  # return_attn=True: dense (B, heads, N, N), 0 outside each query's stripe
    attention_kind = "window"

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = True, attn_drop: float = 0.0,
                 proj_drop: float = 0.0, split_size: int = 7):
        super().__init__()
        self.head_dim = check_heads(dim, num_heads)
        if num_heads % 2:
            raise ValueError(f"cross_window splits the heads over two branches: num_heads {num_heads} is odd")
        self.num_heads = num_heads
        self.split_size = split_size
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attns = nn.ModuleList([_LePE(dim // 2), _LePE(dim // 2)])  # vertical, horizontal stripes
        self.attn_drop = attn_drop
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def _branch(self, qkv: torch.Tensor, lepe: nn.Conv2d, wh: int, ww: int, H: int, W: int, return_attn: bool):
        """qkv (B, H, W, 3, C/2) -> (B, H, W, C/2): attention inside wh x ww stripes plus LePE; with
        ``return_attn`` also the branch's weights stitched to (B, heads / 2, H*W, H*W)."""
        heads = self.num_heads // 2
        pb, pr = (-H) % wh, (-W) % ww
        if pb or pr:
            qkv = F.pad(qkv, (0, 0, 0, 0, 0, pr, 0, pb))  # zero q / k / v at padded positions
        Hp, Wp = H + pb, W + pr
        q, k, v = rearrange(qkv, "b (nh wh) (nw ww) three (h d) -> three b (nh nw h) (wh ww) d", wh=wh, ww=ww,
                            h=heads).unbind(0)  # (B, nS * heads, wh*ww, d)
        mask = valid_keys(H, W, wh, ww, qkv.device)  # (nS, 1, L) or None
        if mask is not None:
            mask = expand_heads(mask, heads)  # (1, nS * heads, 1, L)
        drop = self.attn_drop if self.training else 0.0
        o, attn = attend(q, k, v, mask, drop, return_attn)  # (B, nS * heads, L, d)
        if return_attn:
            attn = stitch_windows(attn, window_positions(H, W, (wh, ww), device=qkv.device), heads, H * W)
        nS = Hp // wh * (Wp // ww)
        v_img = rearrange(v, "b (n h) (wh ww) d -> (b n) (h d) wh ww", n=nS, wh=wh)  # per stripe, as official
        pe = rearrange(lepe(v_img), "(b n) (h d) wh ww -> b (n h) (wh ww) d", n=nS, h=heads)
        o = rearrange(o + pe, "b (nh nw h) (wh ww) d -> b (nh wh) (nw ww) (h d)", nh=Hp // wh, h=heads, wh=wh)
        return (o[:, :H, :W] if (pb or pr) else o), attn

    def forward(self, x: torch.Tensor, hw: tuple[int, int] | None = None, return_attn: bool = False):
        """``return_attn``: also the weights, the vertical-stripe heads then the horizontal ones, each stripe's
        softmax stitched into a dense (B, heads, N, N) map (0 outside the query's stripe)."""
        H, W = grid_size(x, hw, "cross_window")
        B, N, C = x.shape
        sp = self.split_size
        qkv = self.qkv(x).reshape(B, H, W, 3, C)
        half = C // 2
        x1, a1 = self._branch(qkv[..., :half], self.attns[0].get_v, H, sp, H, W, return_attn)  # vertical (H x sp)
        x2, a2 = self._branch(qkv[..., half:], self.attns[1].get_v, sp, W, H, W, return_attn)  # horizontal (sp x W)
        out = self.proj_drop(self.proj(torch.cat((x1, x2), dim=-1).reshape(B, N, C)))
        return (out, torch.cat((a1, a2), dim=1)) if return_attn else out
