"""Layer rewrites: the same function through other kernels, applied from outside a model by
:func:`vitlab.optimize` (backend ``"rewrite"``, and under every other backend but ``"none"``).

The models compute one plain arithmetic on every device (a patch embedding is a strided ``nn.Conv2d``, as in
ViT, Dosovitskiy et al., 2021, Section 3.1); the kernels that run it fastest depend on the machine, so each
rewrite here is an in-place class swap (parameters, buffers, state-dict keys and hooks stay) that
:func:`vitlab.optimize` keeps only where it measures faster than eager:

* :class:`PatchGemmConv2d` (the ``proj`` of a :class:`~vitlab.layers.PatchEmbed`): the non-overlapping p x p
  convolution as one GEMM. The image is cut into patches in the kernel's (c, p1, p2) order, one copy, and
  multiplied by the reshaped kernel; the result is the convolution's (B, D, H', W') as a channels-last view,
  which the patch embedding flattens to tokens without another copy. cuDNN and oneDNN run this convolution
  with layout conversions (NCHW <-> NHWC) around an implicit GEMM.
* :class:`Fp32WindowHiLo` (CPU only): HiLo (Pan et al., NeurIPS 2022) with its Hi-Fi window attention in
  fp32 for bf16 / fp16 inputs. On the CPU, ``scaled_dot_product_attention`` of the s x s = 4-token windows has
  no reduced-precision fast path; the cast rides on the window-partition copy and the output projection runs
  in the input's dtype again. Reduced-precision results differ from eager's by rounding only.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from vitlab.attention.hilo import HiLo
from vitlab.layers.patch_embed import PatchEmbed

__all__ = ["Fp32WindowHiLo", "PatchGemmConv2d", "rewrite"]


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype autocast computes a matmul of ``x`` in (``x.dtype`` when autocast is off or would not cast)."""
    dev = x.device.type
    try:
        if torch.is_autocast_enabled(dev) and x.is_floating_point() and x.dtype != torch.float64:
            return torch.get_autocast_dtype(dev)
    except (TypeError, AttributeError, RuntimeError):  # a device type autocast does not know
        pass
    return x.dtype


class PatchGemmConv2d(nn.Conv2d):
    """A non-overlapping ``p x p`` convolution (kernel = stride, no padding, dilation 1, one group) computed as
    one patch GEMM; made by :func:`rewrite`, never built directly. Returns the convolution's (B, D, H', W')
    with channels-last strides."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, C, H, W = x.shape
        ph, pw = self.kernel_size
        h, w = H // ph, W // pw  # as the convolution: a remainder smaller than the kernel is not covered
        # cast before the patch copy, as autocast would before the GEMM: one copy less
        x = x[:, :, :h * ph, :w * pw].to(_compute_dtype(x))
        x = x.reshape(B, C, h, ph, w, pw).permute(0, 2, 4, 1, 3, 5).reshape(B, h, w, C * ph * pw)
        return F.linear(x, self.weight.flatten(1), self.bias).permute(0, 3, 1, 2)


def _is_patch_conv(m: nn.Module) -> bool:
    return (type(m) is nn.Conv2d and m.kernel_size == m.stride and m.padding == (0, 0) and m.dilation == (1, 1)
            and m.groups == 1 and m.padding_mode == "zeros")


class Fp32WindowHiLo(HiLo):
    """:class:`~vitlab.attention.hilo.HiLo` whose Hi-Fi window attention runs in fp32 (see the module
    docstring); made by :func:`rewrite`, never built directly."""

    window_dtype = torch.float32


def rewrite(model: nn.Module, device: torch.device) -> int:
    """Apply the rewrites of this module that suit ``device`` to ``model`` (itself included), in place; returns
    how many modules changed. Only exact classes are swapped (a user's subclass is left alone)."""
    n = 0
    for m in model.modules():
        if isinstance(m, PatchEmbed) and _is_patch_conv(m.proj):
            m.proj.__class__ = PatchGemmConv2d
            n += 1
        elif type(m) is HiLo and device.type == "cpu":
            m.__class__ = Fp32WindowHiLo
            n += 1
    return n
