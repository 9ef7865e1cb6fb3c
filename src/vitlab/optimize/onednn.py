"""Linear layers whose CPU inference runs oneDNN's matmul with the bias and activation in the GEMM's epilogue.

Eager ``nn.Linear`` on the CPU computes fp32 products with BLAS (MKL in the official wheels) after copying the
bias into the output, and the activation is one more pass over memory. oneDNN's matmul -- the
``mkldnn._linear_pointwise`` kernel that Inductor's CPU freezing pass emits -- adds the bias and applies GELU,
ReLU, SiLU or Hardswish inside the GEMM. On the ViTs' tall-skinny (tokens x channels) products it is 1.3-1.8x
faster in fp32 on the AVX-512 machine of ``docs/benchmarks.md``. It computes the same function (max |diff|
~1e-6 in fp32, from the summation order).

The fast path is taken only where it is that same function and nothing is lost: CPU fp32 tensors, autograd off
(the kernel has no backward), no CPU autocast (it would not cast), not while ``torch.compile``, ``torch.fx`` or
``torch.jit.trace`` (and so the TorchScript ONNX export) trace -- they record the portable ATen graph, and
Inductor fuses by itself -- no dispatch mode such as ``FlopCounterMode`` (it must see ATen's ops), no tensor
subclass or ``vmap``, and no hooks on the module. Everything else is plain ``F.linear``; bf16 products already
run on oneDNN in ATen. ``VITLAB_ONEDNN=0`` in the environment switches the fast path off.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd import forward_ad
from torch.fx import Proxy

# activation module type -> (oneDNN post-op name, algorithm of the module) for the fused epilogue
_EPILOGUES = {
    nn.GELU: lambda m: ("gelu", m.approximate),
    nn.ReLU: lambda m: ("relu", ""),
    nn.SiLU: lambda m: ("swish", ""),
    nn.Hardswish: lambda m: ("hardswish", ""),
}


@functools.cache
def onednn_linear_available() -> bool:
    """Whether this torch build has oneDNN's fused linear kernel (and it computes ``F.linear``) and the
    environment does not switch it off (``VITLAB_ONEDNN=0``: plain ATen everywhere, e.g. to compare with timm
    bit for bit)."""
    if os.environ.get("VITLAB_ONEDNN", "1") == "0" or not torch.backends.mkldnn.is_available():
        return False
    try:
        x, w, b = torch.randn(3, 4), torch.randn(5, 4), torch.randn(5)
        with torch.no_grad():
            out = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
        return torch.allclose(out, F.linear(x, w, b), atol=1e-5)
    except (AttributeError, RuntimeError):
        return False


def _cpu_autocast() -> bool:
    try:
        return torch.is_autocast_enabled("cpu")
    except TypeError:  # torch < 2.4 takes no device
        return torch.is_autocast_cpu_enabled()


def cpu_fp32_inference(x: torch.Tensor) -> bool:
    """True when ``x`` is a plain fp32 CPU tensor in eager inference: autograd off (forward AD too), no CPU
    autocast, no ``torch.compile``, ``torch.fx`` or ``torch.jit.trace`` tracing, no tensor subclass or functorch
    wrapper (``FakeTensor``, ``vmap``) and no dispatch mode (``FlopCounterMode`` must see ATen's ops to count
    them). Where this holds, inference-only kernels (oneDNN's fused linear, :mod:`vitlab.kernels`) may replace
    ATen's ops without changing the function."""
    # Cheapest tests first: training and GPU tensors leave after two or three attribute reads. An fx Proxy
    # (symbolic tracing) is not a Tensor; torch.compile and torch.jit.trace record portable ATen ops.
    if torch.is_grad_enabled() or type(x) is not torch.Tensor or not x.is_cpu or x.dtype != torch.float32:
        return False
    if torch.compiler.is_compiling() or torch.jit.is_tracing():  # first: Dynamo must not trace the C queries
        return False
    if torch._C._len_torch_dispatch_stack() or torch._C._functorch.is_functorch_wrapped_tensor(x):
        return False
    return forward_ad._current_level < 0 and not _cpu_autocast()


def use_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when ``F.linear(x, weight, ...)`` may run oneDNN's kernel (the module docstring gives the conditions)."""
    if isinstance(weight, Proxy) or weight.dtype != torch.float32 or not cpu_fp32_inference(x) or x.dim() < 2:
        return False
    return onednn_linear_available()


def _fusable(act: nn.Module | None) -> bool:
    """No activation, or one oneDNN applies in the GEMM's epilogue (and no hook that fusing would skip)."""
    return act is None or (type(act) in _EPILOGUES and not act._forward_hooks and not act._forward_pre_hooks)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           act: nn.Module | None = None) -> torch.Tensor:
    """``act(F.linear(x, weight, bias))``. Where :func:`use_onednn` allows it, the product runs on oneDNN with
    the activation in its epilogue when it has one (GELU, ReLU, SiLU, Hardswish); otherwise ATen's ops."""
    if not use_onednn(x, weight):
        x = F.linear(x, weight, bias)
        return x if act is None else act(x)
    fused = _fusable(act)
    attr, algorithm = _EPILOGUES[type(act)](act) if fused and act is not None else ("none", "")
    x = torch.ops.mkldnn._linear_pointwise(x, weight, bias, attr, [], algorithm)
    return x if fused else act(x)


def linear_act(layer: nn.Linear, x: torch.Tensor, act: nn.Module | None = None) -> torch.Tensor:
    """``act(layer(x))`` through :func:`linear` when ``layer`` is a plain linear without hooks; a wrapped or
    hooked layer is called as a module."""
    if type(layer) in (nn.Linear, Linear) and not layer._forward_hooks and not layer._forward_pre_hooks:
        return linear(x, layer.weight, layer.bias, act)
    x = layer(x)
    return x if act is None else act(x)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same state dict) whose CPU fp32 inference runs oneDNN's matmul."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
