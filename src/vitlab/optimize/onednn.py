"""oneDNN linear layers, applied from outside a model by module swaps (``optimize(model, backend="onednn")``).

Eager ``nn.Linear`` on the CPU computes fp32 products with BLAS (MKL in the official wheels) after copying the
bias into the output, and the activation is one more pass over memory. oneDNN's matmul -- the
``mkldnn._linear_pointwise`` kernel that Inductor's CPU passes emit -- adds the bias and applies GELU, ReLU,
SiLU or Hardswish inside the GEMM's epilogue. Whether that is faster depends on the machine (faster on the
AVX-512 machine of ``docs/benchmarks.md``, slower on AVX2), which is why :func:`vitlab.optimize` times it
before it picks it. It computes the same function (max |diff| ~1e-6 in fp32, from the summation order).

:func:`swap_linears` replaces every plain ``nn.Linear`` by :class:`OneDNNLinear` (same parameters, same state
dict) and folds the activation of an ``Mlp`` (``fc1 -> act -> fc2``) and of ``nn.Sequential(Linear, act)``
runs into the linear's epilogue. The models themselves stay plain PyTorch: nothing here is inside a model's
forward until a swap puts it there.

:class:`OneDNNLinear` keeps a cheap guard so that it stays correct wherever it ends up: the oneDNN kernel runs
only for plain fp32 CPU tensors when no gradient is asked for (autograd off, or neither input nor weight
requires grad), no CPU autocast and outside ``torch.compile`` / ``jit.trace``
tracing (they record ATen's portable ``linear``; Inductor fuses by itself); anything else takes
``F.linear`` (+ the activation). ``VITLAB_ONEDNN=0`` switches the kernel off.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd import forward_ad

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
    environment does not switch it off (``VITLAB_ONEDNN=0``)."""
    if os.environ.get("VITLAB_ONEDNN", "1") == "0" or not torch.backends.mkldnn.is_available():
        return False
    try:
        x, w, b = torch.randn(3, 4), torch.randn(5, 4), torch.randn(5)
        with torch.no_grad():
            out = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
        return torch.allclose(out, F.linear(x, w, b), atol=1e-5)
    except (AttributeError, RuntimeError):
        return False


@functools.cache
def graph_op():
    """``torch.ops.vitlab.onednn_linear(x, weight, bias, attr, algorithm)``: oneDNN's fused linear as a custom op
    that ``torch.compile`` keeps as one opaque call (Inductor fuses the rest of the graph around it, and lowers
    nothing of it). Registered on first use, not at import."""

    @torch.library.custom_op("vitlab::onednn_linear", mutates_args=())
    def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, attr: str,
                      algorithm: str) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, attr, [], algorithm)

    @onednn_linear.register_fake
    def _(x, weight, bias, attr, algorithm):
        return x.new_empty((*x.shape[:-1], weight.shape[0]))

    return torch.ops.vitlab.onednn_linear.default


def _cpu_autocast() -> bool:
    try:
        return torch.is_autocast_enabled("cpu")
    except TypeError:  # torch < 2.4 takes no device
        return torch.is_autocast_cpu_enabled()


def cpu_fp32_inference(x: torch.Tensor) -> bool:
    """True when ``x`` is a plain fp32 CPU tensor in eager inference: autograd off (forward AD too), no CPU
    autocast, no ``torch.compile`` / ``torch.jit.trace`` tracing, no tensor subclass or functorch wrapper
    (``FakeTensor``, ``vmap``) and no dispatch mode (``FlopCounterMode`` must see ATen's ops to count them).
    Where this holds, inference-only kernels may replace ATen's ops without changing the function."""
    if torch.is_grad_enabled() or type(x) is not torch.Tensor or not x.is_cpu or x.dtype != torch.float32:
        return False
    if torch.compiler.is_compiling() or torch.jit.is_tracing():  # first: Dynamo must not trace the C queries
        return False
    if torch._C._len_torch_dispatch_stack() or torch._C._functorch.is_functorch_wrapped_tensor(x):
        return False
    return forward_ad._current_level < 0 and not _cpu_autocast()


def fusable(act: nn.Module | None) -> bool:
    """No activation, or one oneDNN applies in the GEMM's epilogue (and no hook that fusing would skip)."""
    return act is None or (type(act) in _EPILOGUES and not act._forward_hooks and not act._forward_pre_hooks)


class OneDNNLinear(nn.Linear):
    """``act(nn.Linear(x))`` (same parameters, same state dict as the linear) whose CPU fp32 inference runs
    oneDNN's matmul with the bias and the activation (GELU, ReLU, SiLU, Hardswish, or none) in its epilogue.

    The activation module is held outside the module tree (no state-dict key): only parameter-free activations
    are fused. Build one with :meth:`from_linear`, which shares the linear's parameters."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, act: nn.Module | None = None,
                 device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._set_act(act)

    def _set_act(self, act: nn.Module | None) -> None:
        if not fusable(act):
            raise ValueError(f"cannot fuse {type(act).__name__} into oneDNN's epilogue")
        self.__dict__["act"] = act  # not a submodule: no state-dict key, nothing for hooks to miss
        self.in_graph = False  # True: torch.compile records oneDNN's op (as vitlab::onednn_linear), else ATen's
        self.attr, self.algorithm = _EPILOGUES[type(act)](act) if act is not None else ("none", "")

    @classmethod
    def from_linear(cls, linear: nn.Linear, act: nn.Module | None = None) -> OneDNNLinear:
        """A :class:`OneDNNLinear` sharing ``linear``'s weight and bias (no copy), in its training mode."""
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        m.in_features, m.out_features = linear.in_features, linear.out_features
        m.weight = linear.weight
        m.register_parameter("bias", linear.bias)
        m._set_act(act)
        return m.train(linear.training)

    def extra_repr(self) -> str:
        return super().extra_repr() + ("" if self.act is None else f", epilogue={self.attr}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # cheap guard: the kernel has no backward, does not autocast and is opaque to tracers
        if ((torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))
                or x.dtype != torch.float32 or not x.is_cpu or x.dim() < 2 or torch.jit.is_tracing()
                or _cpu_autocast()):
            return self._aten(x)
        if torch.compiler.is_compiling():
            if not self.in_graph:
                return self._aten(x)
            return torch.ops.vitlab.onednn_linear(x, self.weight, self.bias, self.attr, self.algorithm)
        if type(x) is not torch.Tensor:
            return self._aten(x)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, self.attr, [], self.algorithm)

    def record_in_graph(self, enable: bool = True) -> OneDNNLinear:
        """Under ``torch.compile``, record oneDNN's kernel as the opaque op ``vitlab::onednn_linear`` (Inductor
        fuses what surrounds it) instead of ATen's linear (Inductor's own GEMM choice)."""
        if enable:
            graph_op()
        self.in_graph = enable
        return self

    def _aten(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        return y if self.act is None else self.act(y)


def _swappable(m: nn.Module) -> bool:
    return type(m) is nn.Linear and not m._forward_hooks and not m._forward_pre_hooks and \
        m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"


def _mlp_types() -> tuple[type, ...]:
    from vitlab.layers.mlp import Mlp

    return (Mlp,)


def swap_linears(model: nn.Module) -> int:
    """Replace, in place, every plain fp32 CPU ``nn.Linear`` (no hooks) by a :class:`OneDNNLinear` sharing its
    parameters, folding the activation that follows it in an ``Mlp`` (``fc1 -> act``) or an ``nn.Sequential``
    into the epilogue (the activation becomes ``nn.Identity``). State-dict keys are unchanged.
    Returns the number of linears swapped (0 when oneDNN's kernel is unavailable)."""
    if not onednn_linear_available():
        return 0
    count = 0
    mlps = _mlp_types()
    for module in list(model.modules()):
        if isinstance(module, mlps) and _swappable(getattr(module, "fc1", None) or nn.Identity()) \
                and module.act is not None and fusable(module.act) and _no_hooks(module):
            module.fc1 = OneDNNLinear.from_linear(module.fc1, module.act)
            module.act = nn.Identity()
            count += 1
        elif isinstance(module, nn.Sequential) and not module._forward_hooks:
            names = list(module._modules)
            for a, b in zip(names, names[1:]):
                lin, act = module._modules[a], module._modules[b]
                if lin is not None and _swappable(lin) and act is not None and type(act) in _EPILOGUES \
                        and fusable(act):
                    module._modules[a] = OneDNNLinear.from_linear(lin, act)
                    module._modules[b] = nn.Identity()
                    count += 1
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if _swappable(child):
                setattr(parent, name, OneDNNLinear.from_linear(child))
                count += 1
    return count


def _no_hooks(m: nn.Module) -> bool:
    return not (m.fc1._forward_hooks or m.fc1._forward_pre_hooks or m.act._forward_hooks
                or m.act._forward_pre_hooks)
