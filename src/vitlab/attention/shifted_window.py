"""Shifted window attention (Liu et al., "Swin Transformer: Hierarchical Vision Transformer using Shifted
Windows", ICCV 2021, SW-MSA; row "Shifted Window" of Table IV in the LITv2 supplementary).

Window attention (see :mod:`vitlab.attention.local_window`) on a map rolled by ``-shift_size`` along both
axes, rolled back afterwards, so that windows straddle the borders of the unshifted partition. The roll wraps
the far rows / columns into the last windows; Swin's attention mask (applied here as the ``attn_mask`` of
``scaled_dot_product_attention``) stops attention between the up to four regions that the wrap glued into one
window, so no token attends to a token that was not near it.

Defaults, Swin's setting for 1/16-scale maps: ``window_size=7``, ``shift_size=3`` (= ws // 2),
``rel_pos_bias=True`` (Swin's learned bias table, 2,028 parameters at 12 heads; ``False`` drops it). At dim
768 / 12 heads / 14x14: 2.36 M parameters, 477.2 M MACs (Table IV: 2.36 M, 477.2 M).

Any H x W: padding to a multiple of the window happens before the roll (as in Swin) and the padded keys are
masked as well. An axis no longer than one window is not shifted (Swin disables the shift when the map fits
in a window). No prefix (class) tokens: a ValueError is raised when N != H*W.
"""

from __future__ import annotations

from vitlab.attention._registry import register_attention
from vitlab.attention.local_window import _WindowAttentionBase


@register_attention("shifted_window")
class ShiftedWindowAttention(_WindowAttentionBase):
    _name = "shifted_window"

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = True, attn_drop: float = 0.0,
                 proj_drop: float = 0.0, window_size=7, shift_size=3,
                 rel_pos_bias: bool = True):
        super().__init__(dim, num_heads, qkv_bias, attn_drop, proj_drop, window_size=window_size,
                         shift_size=shift_size, rel_pos_bias=rel_pos_bias)
