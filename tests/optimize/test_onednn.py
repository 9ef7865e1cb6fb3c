"""vitlab.optimize.onednn: the swap modules compute exactly what nn.Linear (+ activation) computes, keep the state
dict, and run oneDNN's kernel only where it is the same function."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from vitlab.layers.mlp import Mlp
from vitlab.optimize import onednn
from vitlab.optimize.onednn import OneDNNLinear, cpu_fp32_inference, onednn_linear_available, swap_linears


def test_onednn_is_available_where_torch_has_mkldnn():
    assert onednn_linear_available() == (torch.backends.mkldnn.is_available() and onednn.os.environ.get(
        "VITLAB_ONEDNN", "1") != "0")


def _reference(layer: nn.Linear, x: torch.Tensor, act: nn.Module | None) -> torch.Tensor:
    y = F.linear(x, layer.weight, layer.bias)
    return y if act is None else act(y)


@pytest.mark.parametrize("shape", [(7, 16), (2, 9, 16), (2, 3, 5, 16), (0, 16), (2, 0, 16)])
@pytest.mark.parametrize("bias", [True, False])
def test_swap_equals_nn_linear_in_inference(shape, bias):
    torch.manual_seed(0)
    ref = nn.Linear(16, 24, bias=bias)
    layer = OneDNNLinear.from_linear(ref)
    assert layer.weight is ref.weight  # shared, not copied
    x = torch.randn(shape)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), _reference(ref, x, None), atol=1e-5, rtol=1e-5)
    for xs in (torch.randn(*shape[:-1], 32)[..., ::2], x.transpose(0, -2) if len(shape) > 2 else x):
        with torch.no_grad():  # strided inputs: every other channel, swapped token axes
            torch.testing.assert_close(layer(xs), _reference(ref, xs, None), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("act", [nn.GELU(), nn.GELU(approximate="tanh"), nn.ReLU(), nn.SiLU(), nn.Hardswish(),
                                 None])
def test_epilogue_equals_act_of_linear(act):
    torch.manual_seed(0)
    ref = nn.Linear(32, 48)
    layer = OneDNNLinear.from_linear(ref, act)
    x = torch.randn(4, 10, 32) * 3  # wide enough to reach every branch of the activations
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), _reference(ref, x, act), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer(x), _reference(ref, x, act))  # autograd on: ATen's ops


def test_unfusable_activation_is_refused():
    with pytest.raises(ValueError, match="cannot fuse"):
        OneDNNLinear.from_linear(nn.Linear(4, 4), nn.Tanh())


def test_trains_like_nn_linear_and_keeps_its_state_dict():
    torch.manual_seed(0)
    ref = nn.Linear(8, 4)
    ours = OneDNNLinear.from_linear(nn.Linear(8, 4), nn.GELU())
    assert ours.state_dict().keys() == ref.state_dict().keys()
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(3, 8)
    ours(x).square().sum().backward()
    F.gelu(ref(x)).square().sum().backward()
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad)
    torch.testing.assert_close(ours.bias.grad, ref.bias.grad)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
def test_kernel_runs_only_where_it_computes_the_same_function(monkeypatch):
    calls = []
    real = torch.ops.mkldnn._linear_pointwise

    class Spy:
        def __call__(self, *a):
            calls.append(1)
            return real(*a)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", Spy())
    layer, x = OneDNNLinear.from_linear(nn.Linear(8, 4)), torch.randn(3, 8)
    with torch.no_grad():
        layer(x)
    assert calls == [1]
    layer(x)  # autograd on and the weight requires grad: ATen
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        layer(x)  # the kernel would not cast
    with torch.no_grad():
        layer(x[0])  # 1-D input
    assert calls == [1]
    layer.requires_grad_(False)
    layer(x)  # autograd on, but nothing asks for a gradient: the kernel
    assert calls == [1, 1]


def test_swap_linears_folds_the_mlp_activation_and_keeps_keys():
    torch.manual_seed(0)
    model = nn.Sequential(Mlp(16, 64), nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4)))
    keys = list(model.state_dict())
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        ref = model(x)
    n = swap_linears(model)
    assert n == 4 and list(model.state_dict()) == keys
    assert model[0].fc1.act is not None and isinstance(model[0].act, nn.Identity)
    assert model[1][0].attr == "relu" and isinstance(model[1][1], nn.Identity)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref, atol=1e-5, rtol=1e-5)


def test_swap_leaves_hooked_layers_alone():
    mlp = Mlp(8, 16)
    mlp.act.register_forward_hook(lambda *a: None)
    swap_linears(mlp)
    assert type(mlp.act) is nn.GELU and mlp.fc1.act is None  # fc1 swapped, its activation kept apart


def test_no_swap_when_switched_off(monkeypatch):
    monkeypatch.setenv("VITLAB_ONEDNN", "0")
    onednn_linear_available.cache_clear()
    try:
        mlp = Mlp(8, 16)
        assert swap_linears(mlp) == 0 and type(mlp.fc1) is nn.Linear
    finally:
        monkeypatch.undo()
        onednn_linear_available.cache_clear()


@pytest.mark.filterwarnings("ignore:`torch.jit.trace:FutureWarning")
def test_tracers_record_portable_aten_ops():
    mlp = Mlp(16, 32).eval()
    swap_linears(mlp)
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        traced = torch.jit.trace(mlp, x)
        torch.testing.assert_close(traced(x), mlp(x), atol=1e-5, rtol=1e-5)
    assert "mkldnn" not in str(traced.graph)


def test_fullgraph_compile_traces_aten():
    torch._dynamo.reset()
    ref = nn.Linear(8, 4)
    layer, x = OneDNNLinear.from_linear(ref, nn.GELU()), torch.randn(3, 8)
    with torch.no_grad():
        out = torch.compile(layer, fullgraph=True, backend="eager")(x)
    torch.testing.assert_close(out, F.gelu(F.linear(x, ref.weight, ref.bias)))


def test_cpu_fp32_inference_conditions():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    x = torch.randn(3, 8)
    assert not cpu_fp32_inference(x)  # autograd on
    with torch.no_grad():
        assert cpu_fp32_inference(x)
        assert not cpu_fp32_inference(x.double())
        with FlopCounterMode(display=False):
            assert not cpu_fp32_inference(x)
        with FakeTensorMode() as mode:
            assert not cpu_fp32_inference(mode.from_tensor(x))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not cpu_fp32_inference(x)
