"""Large-kernel attention of the Visual Attention Network (Guo, Lu, Liu, Cheng, Hu, "Visual Attention
Network", arXiv:2202.09741, 2022; row "VAN" of Table IV in the LITv2 supplementary).

VAN's spatial attention unit: ``proj_2(LKA(GELU(proj_1(x)))) + x`` with 1x1 convolutions proj_1 / proj_2 and
the large-kernel attention ``LKA(u) = u * conv1x1(dwconv7x7_dilation3(dwconv5x5(u)))``: VAN's decomposition of
a 21x21 kernel into a depth-wise, a depth-wise dilated and a point-wise convolution (exact receptive field 5 +
6*3 = 23), whose output gates the input element-wise. No softmax, no heads (``num_heads``, ``qkv_bias`` and
``attn_drop`` are accepted for the common signature and unused). The unit keeps VAN's own shortcut
(``shortcut=True``, the authors' module); pass ``shortcut=False`` inside a block that already adds the
residual.

Convolutional, so the tokens must be exactly the H x W grid: prefix (class) tokens are refused with a
ValueError. At dim 768 / 14x14: 1.83 M parameters, 358.0 M MACs, as Table IV.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from vitlab.attention._registry import attention_weights_error, register_attention


class LKA(nn.Module):
    """Large-kernel attention: the gate ``conv1(conv_spatial(conv0(u)))`` multiplies u."""

    def __init__(self, dim: int, kernel_size: int = 5, dilated_kernel_size: int = 7, dilation: int = 3):
        super().__init__()
        self.conv0 = nn.Conv2d(dim, dim, kernel_size, padding=kernel_size // 2, groups=dim)
        self.conv_spatial = nn.Conv2d(dim, dim, dilated_kernel_size, groups=dim, dilation=dilation,
                                      padding=dilation * (dilated_kernel_size // 2))
        self.conv1 = nn.Conv2d(dim, dim, 1)

    def forward(self, u: torch.Tensor) -> torch.Tensor:  # (B, C, H, W)
        return u * self.conv1(self.conv_spatial(self.conv0(u)))


@register_attention("van")
class VANAttention(nn.Module):
    has_attention_weights = False  # no softmax over keys: return_attn=True raises a ValueError
    prefix_tokens = False  # a grid mechanism: x must hold exactly the H*W grid tokens

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = True, attn_drop: float = 0.0,
                 proj_drop: float = 0.0, kernel_size: int = 5, dilated_kernel_size: int = 7,
                 dilation: int = 3, shortcut: bool = True):
        super().__init__()
        self.proj_1 = nn.Conv2d(dim, dim, 1)
        self.act = nn.GELU()
        self.spatial_gating_unit = LKA(dim, kernel_size, dilated_kernel_size, dilation)
        self.proj_2 = nn.Conv2d(dim, dim, 1)
        self.shortcut = shortcut
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor, hw: tuple[int, int], return_attn: bool = False) -> torch.Tensor:
        if return_attn:
            raise attention_weights_error(self)
        B, N, C = x.shape
        H, W = hw
        if N != H * W:
            raise ValueError(f"van takes exactly the {H}x{W} grid tokens (no prefix tokens), got N={N}")
        x = x.view(B, H, W, C).permute(0, 3, 1, 2)  # (B, C, H, W) as a channels-last view: no copy
        y = self.proj_2(self.spatial_gating_unit(self.act(self.proj_1(x))))
        if self.shortcut:
            y = y + x
        return self.proj_drop(y.permute(0, 2, 3, 1).reshape(B, N, C))  # (B, N, C); a view when channels-last
