"""vitlab.optimize.hilo.swap_hilo: HiLo modules become KernelHiLo (same parameters and state dict), compute the
same function as the SDPA path, use the kernels only in fp32 CPU inference and fall back to HiLo's own code
everywhere else. Where the toolchain exists the kernels must be available (no silent skip)."""

from __future__ import annotations

import copy

import pytest
import torch

import vitlab
import vitlab.attention as A
from vitlab.attention.hilo import HiLo
from vitlab.optimize import kernels
from vitlab.optimize.hilo import KernelHiLo, swap_hilo


@pytest.fixture(scope="module", autouse=True)
def built():
    reason = kernels._unavailable_reason()
    if reason is not None:
        pytest.skip(f"CPU kernels: {reason}")
    assert kernels.available(), kernels.status()


def _pair(dim=128, heads=4, **kw):
    ref = A.create("hilo", dim, heads, **kw).eval()  # head_dim 32
    fast = copy.deepcopy(ref)
    assert swap_hilo(fast) == 1 and type(fast) is KernelHiLo
    return ref, fast


@pytest.mark.parametrize("hw", [(14, 14), (13, 17), (7, 7), (1, 1)])
@pytest.mark.parametrize("kw", [{}, dict(alpha=0.5), dict(alpha=1.0), dict(alpha=0.0), dict(window_size=3),
                                dict(window_size=1, alpha=1.0), dict(window_size=1, alpha=0.5),
                                dict(pooled_queries=True), dict(alpha=0.5, window_size=3, qkv_bias=False)])
def test_same_function_as_sdpa(hw, kw):
    ref, fast = _pair(**kw)
    x = torch.randn(2, hw[0] * hw[1], 128)
    with torch.inference_mode():
        torch.testing.assert_close(fast(x, hw), ref(x, hw), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(fast(x, hw), ref(x, hw), rtol=1e-5, atol=1e-5)


def test_table_iv_setting():
    ref, fast = _pair(768, 12)  # dim 768, 12 heads (10 Lo-Fi, 2 Hi-Fi), s = 2
    x = torch.randn(2, 196, 768)
    with torch.inference_mode():
        torch.testing.assert_close(fast(x, (14, 14)), ref(x, (14, 14)), rtol=1e-5, atol=1e-5)


def _spy_kernel_calls(monkeypatch) -> list[str]:
    """The names of the HiLo kernel operators called from now on, in call order."""
    seen = []
    for name in ("lofi_attention", "window_attention"):
        real = getattr(torch.ops.vitlab_kernels, name)
        monkeypatch.setattr(torch.ops.vitlab_kernels, name,
                            lambda *a, _real=real, _name=name: seen.append(_name) or _real(*a))
    return seen


def test_kernels_run_in_fp32_inference_only(monkeypatch):
    seen = _spy_kernel_calls(monkeypatch)
    ref, fast = _pair()
    x = torch.randn(1, 64, 128)
    expected = ["lofi_attention", "window_attention"] if kernels.isa_code() == 512 else ["window_attention"]
    with torch.no_grad():
        fast(x, (8, 8))
    assert sorted(seen) == expected
    seen.clear()

    # autograd: HiLo's SDPA path (the kernels have no backward), and the same gradients
    xg = x.clone().requires_grad_()
    fast(xg, (8, 8)).sum().backward()
    xr = x.clone().requires_grad_()
    ref(xr, (8, 8)).sum().backward()
    torch.testing.assert_close(xg.grad, xr.grad, rtol=1e-5, atol=1e-5)
    for (n, p), (_, r) in zip(fast.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-5, atol=1e-5, msg=n)
    fast(x, (8, 8))  # grad mode with parameters that require grad, plain input
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        torch.testing.assert_close(fast(x, (8, 8)), ref(x, (8, 8)))
    half = copy.deepcopy(fast).bfloat16()
    with torch.no_grad():
        assert half(x.bfloat16(), (8, 8)).dtype == torch.bfloat16
        fast.train()
        fast.attn_drop = 0.1  # attention dropout in training
        fast(x, (8, 8))
        fast.attn_drop = 0.0
        fast(x, (8, 8))  # training without dropout: the same function, the kernels may run
    assert sorted(seen) == expected  # only the last call


def test_avx2_path_keeps_sdpa_for_lofi(monkeypatch):
    """On the AVX2 path (ATEN_CPU_CAPABILITY=avx2 or an AVX2 CPU) Lo-Fi keeps SDPA (faster there), Hi-Fi runs
    the kernel; the same function either way."""
    monkeypatch.setattr(kernels, "_ISA_CODE", 2)
    seen = _spy_kernel_calls(monkeypatch)
    ref, fast = _pair()
    x = torch.randn(2, 13 * 17, 128)
    with torch.inference_mode():
        torch.testing.assert_close(fast(x, (13, 17)), ref(x, (13, 17)), rtol=1e-5, atol=1e-5)
    assert seen == ["window_attention"]


def test_unsupported_heads_fall_back():
    ref, fast = _pair(96, 4)  # head_dim 24: not a multiple of 16
    x = torch.randn(2, 49, 96)
    with torch.inference_mode():
        torch.testing.assert_close(fast(x, (7, 7)), ref(x, (7, 7)), rtol=1e-5, atol=1e-5)
    ref, fast = _pair(128, 4, window_size=1, alpha=1.0)  # 196 un-pooled keys: more than the Lo-Fi kernel takes
    x = torch.randn(1, 196, 128)
    with torch.inference_mode():
        torch.testing.assert_close(fast(x, (14, 14)), ref(x, (14, 14)), rtol=1e-5, atol=1e-5)


def test_swap_keeps_parameters_and_state_dict():
    m = A.create("hilo", 128, 4).eval()
    params = {n: p for n, p in m.named_parameters()}
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    assert swap_hilo(m) == 1 and isinstance(m, HiLo) and type(m) is KernelHiLo
    assert {n: p for n, p in m.named_parameters()} == params  # the same tensors, not copies
    assert m.state_dict().keys() == sd.keys() and all(torch.equal(m.state_dict()[k], v) for k, v in sd.items())
    assert swap_hilo(m) == 0  # already swapped
    assert swap_hilo(torch.nn.Linear(2, 2)) == 0


def test_swap_is_a_no_op_without_kernels(monkeypatch):
    monkeypatch.setattr(kernels, "available", lambda: False)
    m = A.create("hilo", 128, 4)
    assert swap_hilo(m) == 0 and type(m) is HiLo


def test_inside_litv2():
    torch.manual_seed(0)
    ref = vitlab.create_model("litv2_s", num_classes=10).eval()
    fast = copy.deepcopy(ref)
    n = sum(type(m) is HiLo for m in ref.modules())
    assert n > 0 and swap_hilo(fast) == n
    assert not any(type(m) is HiLo for m in fast.modules())
    assert fast.state_dict().keys() == ref.state_dict().keys()
    x = torch.randn(2, 3, 64, 96)  # non-square: stage 3 is 4 x 6 (s = 2), stage 4 is 2 x 3 (s = 1)
    with torch.inference_mode():
        torch.testing.assert_close(fast(x), ref(x), rtol=1e-5, atol=1e-5)


def test_under_torch_compile():
    """The operators are opaque nodes of the compiled graph: same function, no graph break."""
    ref, fast = _pair()
    x = torch.randn(2, 13 * 17, 128)
    torch._dynamo.reset()
    compiled = torch.compile(fast, fullgraph=True, dynamic=False)
    with torch.inference_mode():
        torch.testing.assert_close(compiled(x, (13, 17)), ref(x, (13, 17)), rtol=1e-5, atol=1e-5)
