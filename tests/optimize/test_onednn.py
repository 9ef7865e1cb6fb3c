"""vitlab.layers.linear: the oneDNN inference path computes exactly what nn.Linear (+ activation) computes, and is
taken only where it may be."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from vitlab.layers import Linear, Mlp, cpu_fp32_inference, linear_act, onednn_linear_available, use_onednn

needs_onednn = pytest.mark.skipif(not onednn_linear_available(), reason="torch built without oneDNN")


def _reference(layer: nn.Linear, x: torch.Tensor, act: nn.Module | None) -> torch.Tensor:
    y = F.linear(x, layer.weight, layer.bias)
    return y if act is None else act(y)


@pytest.mark.parametrize("shape", [(7, 16), (2, 9, 16), (2, 3, 5, 16), (0, 16), (2, 0, 16)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_equals_nn_linear_in_inference(shape, bias):
    torch.manual_seed(0)
    layer = Linear(16, 24, bias=bias)
    x = torch.randn(shape)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), _reference(layer, x, None), atol=1e-5, rtol=1e-5)
    for xs in (torch.randn(*shape[:-1], 32)[..., ::2], x.transpose(0, -2) if len(shape) > 2 else x):
        with torch.no_grad():  # strided inputs: every other channel, swapped token axes
            torch.testing.assert_close(layer(xs), _reference(layer, xs, None), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("act", [nn.GELU(), nn.GELU(approximate="tanh"), nn.ReLU(), nn.SiLU(), nn.Hardswish(),
                                 nn.Tanh(), None])
def test_linear_act_equals_act_of_linear(act):
    torch.manual_seed(0)
    layer = Linear(32, 48)
    x = torch.randn(4, 10, 32) * 3  # wide enough to reach every branch of the activations
    with torch.inference_mode():
        torch.testing.assert_close(linear_act(layer, x, act), _reference(layer, x, act), atol=1e-5, rtol=1e-5)


def test_linear_trains_like_nn_linear_and_keeps_its_state_dict():
    torch.manual_seed(0)
    ours, ref = Linear(8, 4), nn.Linear(8, 4)
    assert ours.state_dict().keys() == ref.state_dict().keys()
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(3, 8)
    ours(x).square().sum().backward()
    ref(x).square().sum().backward()
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad)
    torch.testing.assert_close(ours.bias.grad, ref.bias.grad)


@needs_onednn
def test_fast_path_only_where_it_computes_the_same_function():
    w = torch.randn(4, 8)
    x = torch.randn(3, 8)
    with torch.inference_mode():
        assert use_onednn(x, w)
        assert not use_onednn(x.double(), w.double())  # fp32 only: bf16 already runs oneDNN in ATen
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not use_onednn(x, w)  # the kernel would not cast
        assert not use_onednn(torch.randn(3, 8, device="meta"), w.to("meta"))
    assert not use_onednn(x, w)  # autograd on: the kernel has no backward


def test_linear_act_calls_hooked_layers_as_modules():
    layer, seen = Linear(8, 8), []
    layer.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    with torch.inference_mode():
        linear_act(layer, torch.randn(2, 8), nn.GELU())
    assert seen == [torch.Size([2, 8])]


def test_mlp_inference_equals_training_graph():
    torch.manual_seed(0)
    mlp = Mlp(16, 64).eval()
    x = torch.randn(2, 5, 16)
    expected = mlp.fc2(F.gelu(F.linear(x, mlp.fc1.weight, mlp.fc1.bias)))  # autograd on: the ATen path
    with torch.inference_mode():
        torch.testing.assert_close(mlp(x), expected, atol=1e-5, rtol=1e-5)


def test_fx_symbolic_trace_records_the_aten_graph():
    torch.manual_seed(0)
    mlp = Mlp(16, 32).eval()
    traced = torch.fx.symbolic_trace(mlp)
    x = torch.randn(2, 5, 16)
    with torch.inference_mode():
        torch.testing.assert_close(traced(x), mlp(x), atol=1e-5, rtol=1e-5)


def test_env_switch_turns_the_fast_path_off(monkeypatch):
    monkeypatch.setenv("VITLAB_ONEDNN", "0")
    onednn_linear_available.cache_clear()
    try:
        with torch.inference_mode():
            assert not use_onednn(torch.randn(3, 8), torch.randn(4, 8))
    finally:
        monkeypatch.undo()
        onednn_linear_available.cache_clear()


@pytest.mark.filterwarnings("ignore:`torch.jit.trace:FutureWarning")  # deprecated, still used by ONNX export
def test_jit_trace_records_portable_aten_ops():
    mlp = Mlp(16, 32).eval()
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        traced = torch.jit.trace(mlp, x)
        torch.testing.assert_close(traced(x), mlp(x), atol=1e-5, rtol=1e-5)
    assert "mkldnn" not in str(traced.graph)  # ONNX export (TorchScript path) knows ATen's linear, not oneDNN's


def test_activation_hooks_still_fire():
    act, seen = nn.GELU(), []
    act.register_forward_hook(lambda m, i, o: seen.append(True))
    with torch.inference_mode():
        y = linear_act(Linear(8, 8), torch.randn(2, 8), act)
    assert seen == [True] and y.shape == (2, 8)


@needs_onednn
def test_no_fast_path_under_counters_fakes_or_transforms():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    w, x = torch.randn(4, 8), torch.randn(3, 8)
    with torch.no_grad():
        assert cpu_fp32_inference(x)
        with FlopCounterMode(display=False) as counter:  # the counter must see ATen's matmul to count it
            assert not cpu_fp32_inference(x)
            Linear(8, 4)(x)
        assert counter.get_total_flops() == 2 * 3 * 8 * 4
        with FakeTensorMode() as mode:
            assert not cpu_fp32_inference(mode.from_tensor(x))
        assert torch.func.vmap(lambda t: torch.tensor(cpu_fp32_inference(t)))(x).tolist() == [False] * 3
        with torch.autograd.forward_ad.dual_level():
            assert not cpu_fp32_inference(x)
        assert not use_onednn(nn.Parameter(x), w)  # a subclass: ATen's op


def test_fullgraph_compile_in_inference_traces_aten():
    # the fast-path test must leave before any query Dynamo cannot trace (dispatch stack, functorch)
    torch._dynamo.reset()
    layer, x = Linear(8, 4), torch.randn(3, 8)
    with torch.no_grad():
        out = torch.compile(layer, fullgraph=True, backend="eager")(x)
    torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias))
