"""Layer rewrites: the same function through other kernels, applied from outside a model by
:func:`vitlab.optimize` (backend ``"rewrite"``, and under every other backend but ``"none"``).

The models compute one plain arithmetic on every device (a patch embedding is a strided ``nn.Conv2d``, as in
ViT, Dosovitskiy et al., 2021, Section 3.1); the kernels that run it fastest depend on the machine, so each
rewrite here (:data:`REWRITES`, by name) is an in-place class swap (parameters, buffers, state-dict keys and hooks
stay) that :func:`vitlab.optimize.optimize` keeps only where it measures faster than eager, each on its own:

* :class:`PatchGemmConv2d` (the ``proj`` of a :class:`~vitlab.layers.PatchEmbed`): the non-overlapping p x p
  convolution as one GEMM. The image is cut into patches in the kernel's (c, p1, p2) order, one copy, and
  multiplied by the reshaped kernel; the result is the convolution's (B, D, H', W') as a channels-last view,
  which the patch embedding flattens to tokens without another copy. cuDNN and oneDNN run this convolution
  with layout conversions (NCHW <-> NHWC) around an implicit GEMM.
* :class:`Fp32WindowHiLo` (CPU only): HiLo (Pan et al., NeurIPS 2022) with its Hi-Fi window attention in
  fp32 for bf16 / fp16 inputs. On the CPU, ``scaled_dot_product_attention`` of the s x s = 4-token windows has
  no reduced-precision fast path; the cast rides on the window-partition copy and the output projection runs
  in the input's dtype again. Reduced-precision results differ from eager's by rounding only.
* ``talking_heads`` (:func:`vitlab.optimize.cait.fold_talking_heads`): CaiT's talking-heads attention (Touvron
  et al., ICCV 2021, Sec. 2) as one fused attention call over folded heads, without its N x N maps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from vitlab.attention.hilo import HiLo
from vitlab.layers.patch_embed import PatchEmbed
from vitlab.optimize.cait import fold_talking_heads

__all__ = ["REWRITES", "Fp32WindowHiLo", "PatchGemmConv2d", "rewrite"]


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


def _patch_gemm(model: nn.Module, device: torch.device) -> int:
    n = 0
    for m in model.modules():
        if isinstance(m, PatchEmbed) and _is_patch_conv(m.proj):
            m.proj.__class__ = PatchGemmConv2d
            n += 1
    return n


def _fp32_windows(model: nn.Module, device: torch.device) -> int:
    if device.type != "cpu":  # GPUs have reduced-precision attention kernels for any length
        return 0
    targets = [m for m in model.modules() if type(m) is HiLo]
    for m in targets:
        m.__class__ = Fp32WindowHiLo
    return len(targets)


# name -> fn(model, device) applying the rewrite in place and returning how many modules it changed
REWRITES: dict[str, Callable[[nn.Module, torch.device], int]] = {
    "patch_gemm": _patch_gemm,
    "fp32_windows": _fp32_windows,
    "talking_heads": lambda model, device: fold_talking_heads(model),
}


def rewrite(model: nn.Module, device: torch.device, names: Sequence[str] | None = None) -> int:
    """Apply the rewrites ``names`` of :data:`REWRITES` (default: all) that suit ``device`` to ``model`` (itself
    included), in place; returns how many modules changed. Only exact classes are swapped (a user's subclass is
    left alone)."""
    return sum(REWRITES[name](model, device) for name in (REWRITES if names is None else names))
