"""HiLo with vitlab's compiled CPU attention kernels, applied from outside the model (``vitlab.optimize``,
backend ``"kernels"``).

:func:`swap_hilo` turns every :class:`vitlab.attention.hilo.HiLo` of a model into a :class:`KernelHiLo`: the
same module (parameters, buffers, state-dict keys, hooks) with the two attention cores replaced, in fp32 CPU
inference, by the kernels of :mod:`vitlab.optimize.kernels`:

* Hi-Fi: :func:`~vitlab.optimize.kernels.window_attention` reads the s x s windows in place from the projected
  map and writes raster order (no window-partition / reverse copies, no padding or mask for cut windows);
* Lo-Fi (AVX-512 only, where it is faster than SDPA): :func:`~vitlab.optimize.kernels.lofi_attention` runs every
  query against the few pooled keys, reading k and v as strided views of the ``l_kv`` projection.

In eval-mode fp32 inference the forward also writes each output projection (``h_proj``, ``l_proj``) by one
``addmm`` straight into its channel slice of the output, instead of projecting into a temporary and copying it.
Everything else (projections, pooling, the Table III ``pooled_queries`` branch) is the parent's code. Any
call the kernels do not take falls back to the parent, i.e. to SDPA: autograd (an input or a parameter that
requires grad with grad mode on), another dtype or device, autocast, attention dropout in training,
TorchScript tracing, and head widths or windows outside the kernels' range. Under ``torch.compile`` the kernels
are opaque operators of the graph (registered with their shapes), so Inductor compiles everything around them.
The function is the same (``F.scaled_dot_product_attention`` within ~1e-6 in fp32).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from vitlab.attention.hilo import HiLo
from vitlab.optimize import kernels
from vitlab.optimize.rewrite import Fp32WindowHiLo

__all__ = ["KernelHiLo", "hilo_modules", "swap_hilo"]


def _plain_fp32_cpu(*tensors: torch.Tensor) -> bool:
    """Tensors the kernels take: fp32 CPU tensors with contiguous channels, outside autograd, autocast and
    TorchScript tracing. (Under torch.compile the kernels are traced as the opaque operators they are.)"""
    if torch.jit.is_scripting() or torch.jit.is_tracing() or torch.is_autocast_enabled("cpu"):
        return False
    if not kernels.isa_code() and not kernels.available():  # e.g. a pickled KernelHiLo in a new process
        return False
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and not t.requires_grad and t.stride(-1) == 1
               for t in tensors)


# Whether the Lo-Fi kernel beats SDPA, by ISA path (benchmarks/hilo_cpu.py, docs/benchmarks.md): with AVX-512
# it is faster; on the AVX2 path ATen's SDPA (MKL GEMMs) is, so Lo-Fi keeps SDPA there.
_LOFI = {512: True, 2: False, 0: False}


class KernelHiLo(Fp32WindowHiLo):
    """:class:`HiLo` whose attention cores run vitlab's compiled CPU kernels in fp32 inference (see the module
    docstring; another dtype takes :class:`~vitlab.optimize.rewrite.Fp32WindowHiLo`'s path); made by
    :func:`swap_hilo`, never built directly."""

    def _dropout(self) -> bool:
        return self.training and self.attn_drop > 0

    def hifi(self, qkv: torch.Tensor, H: int, W: int) -> torch.Tensor:
        if kernels.window_supported(self.head_dim, self.ws) and not self._dropout() and _plain_fp32_cpu(qkv):
            # raster (B, H, W, h_dim), which HiLo.place_hifi copies as it is
            o = torch.ops.vitlab_kernels.window_attention(qkv, self.ws, self.h_heads, self.head_dim**-0.5,
                                                          kernels.isa_code())
            return self.h_proj(o)
        return super().hifi(qkv, H, W)

    def _fast(self, x: torch.Tensor, *more: torch.Tensor) -> bool:
        """Whether this call may take the kernels: fp32 CPU inference (see the module docstring)."""
        return (not self._dropout() and _plain_fp32_cpu(x, *more)
                and not (torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters())))

    def _lofi_attention(self, x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """Lo-Fi attention before ``l_proj``: x (B, H, W, C), projected queries q (B, H, W, l_dim) -> (B*N, l_dim),
        by the kernel where it is faster than SDPA (``_LOFI``), else by SDPA as :meth:`HiLo.lofi`."""
        s, heads, d = self.ws, self.l_heads, self.head_dim
        B, H, W, C = x.shape
        M = (-(-H // s)) * (-(-W // s))  # keys of the (ceil-mode) pooled map
        if s > 1:  # as HiLo.lofi: pool, then project k and v
            kv_in = F.avg_pool2d(x.permute(0, 3, 1, 2), s, s, ceil_mode=True).flatten(2).transpose(1, 2)
        else:
            kv_in = x.reshape(B, H * W, C)
        kv = self.l_kv(kv_in).reshape(B, M, 2, heads, d).permute(2, 0, 3, 1, 4)
        q = q.reshape(B, H * W, heads, d).transpose(1, 2)
        if _LOFI[kernels.isa_code()] and kernels.lofi_supported(d, M):
            k, v = kv.unbind(0)  # strided views of the projection: the kernel reads them in place
            o = torch.ops.vitlab_kernels.lofi_attention(q, k, v, d**-0.5, kernels.isa_code())
        else:
            k, v = kv.contiguous().unbind(0)
            o = F.scaled_dot_product_attention(q, k, v)
        return o.transpose(1, 2).reshape(B * H * W, self.l_dim)  # both lay o out as (B, N, heads, d): free

    def lofi(self, x: torch.Tensor, q: torch.Tensor | None = None) -> torch.Tensor:
        if self.pooled_queries or not self._fast(x, *(() if q is None else (q,))):
            return super().lofi(x, q)
        B, H, W, _ = x.shape
        o = self._lofi_attention(x, self.l_q(x) if q is None else q)
        return self.l_proj(o).reshape(B, H, W, self.l_dim)

    def forward_grid(self, x: torch.Tensor, H: int, W: int) -> torch.Tensor:
        # Both branches in fp32 inference: as HiLo.forward, with each output projection written by one addmm
        # straight into its channel slice of the output (no projected temporaries, no slice copies).
        if (self.training or self.pooled_queries or not self.l_heads or not self.h_heads or self.h_proj.bias is None
                or torch.compiler.is_compiling() or not kernels.window_supported(self.head_dim, self.ws)
                or not self._fast(x)):
            return super().forward_grid(x, H, W)
        B, N, C = x.shape
        x = x.reshape(B, H, W, C)
        w = torch.cat((self.h_qkv.weight, self.l_q.weight))  # one projection for Hi-Fi q, k, v and Lo-Fi q
        b = None if self.h_qkv.bias is None else torch.cat((self.h_qkv.bias, self.l_q.bias))
        y = F.linear(x, w, b)  # (B, H, W, 3 h_dim + l_dim)
        hq, hd = 3 * self.h_dim, self.h_dim
        out = x.new_empty(B * N, C)
        hi = torch.ops.vitlab_kernels.window_attention(y[..., :hq], self.ws, self.h_heads, self.head_dim**-0.5,
                                                       kernels.isa_code())  # (B, H, W, h_dim) raster
        torch.addmm(self.h_proj.bias, hi.view(B * N, hd), self.h_proj.weight.t(), out=out[:, :hd])
        lo = self._lofi_attention(x, y[..., hq:])
        torch.addmm(self.l_proj.bias, lo, self.l_proj.weight.t(), out=out[:, hd:])
        return out.view(B, N, C)


def hilo_modules(model: nn.Module) -> list[HiLo]:
    """The modules of ``model`` (itself included) that :func:`swap_hilo` swaps: plain :class:`HiLo` or its
    rewrite :class:`~vitlab.optimize.rewrite.Fp32WindowHiLo`, no other subclass (KernelHiLo, a user's)."""
    return [m for m in model.modules() if type(m) in (HiLo, Fp32WindowHiLo)]


def swap_hilo(model: nn.Module) -> int:
    """Make every :class:`HiLo` in ``model`` (the model itself included) a :class:`KernelHiLo`, in place.

    The modules keep their parameters, buffers, state-dict keys and hooks (only their class changes), and
    compute the same function; subclasses of HiLo other than KernelHiLo are left alone. Returns how many
    modules were swapped: 0 when the kernels are not available on this machine (``kernels.status()`` says
    why), in which case nothing changes. A model without HiLo never builds or loads the kernels."""
    targets = hilo_modules(model)
    if not targets or not kernels.available():
        return 0
    for m in targets:
        m.__class__ = KernelHiLo
    return len(targets)
