"""vitlab.optimize.rewrite: each rewrite computes what the plain layer computes (outputs, gradients, hooks,
state dict), and the ``rewrite`` backend leaves a model's function as it was."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import vitlab
import vitlab.attention as A
from vitlab.layers import PatchEmbed
from vitlab.optimize import max_abs_diff, optimize
from vitlab.optimize.cait import FoldedTalkingHeadAttn
from vitlab.optimize.rewrite import Fp32WindowHiLo, PatchGemmConv2d, rewrite
from vitlab.registry import get_model_config


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("VITLAB_CACHE_DIR", str(tmp_path / "cache"))


def _rewritten(pe: nn.Module) -> nn.Module:
    fast = copy.deepcopy(pe)
    assert rewrite(fast, torch.device("cpu")) == 1
    return fast


@pytest.mark.parametrize("flatten", [True, False])
@pytest.mark.parametrize("channels_last", [False, True])
def test_patch_gemm_equals_the_convolution(flatten, channels_last):
    """Same outputs and gradients as the convolution; under autocast the GEMM runs in bf16 as the conv would."""
    torch.manual_seed(0)
    pe = PatchEmbed(img_size=(32, 48), patch_size=(8, 4), in_chans=5, embed_dim=24, flatten=flatten)
    fast = _rewritten(pe)
    assert type(fast.proj) is PatchGemmConv2d and fast.state_dict().keys() == pe.state_dict().keys()
    x = torch.randn(2, 5, 32, 48, requires_grad=True)
    xin = x.contiguous(memory_format=torch.channels_last) if channels_last else x
    out, ref = fast(xin), pe(x)
    assert out.shape == ref.shape == ((2, 4 * 12, 24) if flatten else (2, 4, 12, 24)) and out.is_contiguous()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, [x, fast.proj.weight, fast.proj.bias], g)
    ref_grads = torch.autograd.grad(ref, [x, pe.proj.weight, pe.proj.bias], g)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low, ref_low = fast(x), pe(x)
    assert low.dtype == ref_low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), ref_low.float(), rtol=2e-2, atol=2e-2)


def test_patch_gemm_keeps_hooks_and_leaves_other_convolutions():
    pe = PatchEmbed(img_size=16, patch_size=8, in_chans=3, embed_dim=4)
    seen = []
    pe.proj.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    fast = _rewritten(pe)
    assert fast(torch.randn(1, 3, 16, 16)).shape == (1, 4, 4) and seen == [(1, 4, 2, 2)]
    pe = PatchEmbed(img_size=16, patch_size=8, in_chans=3, embed_dim=4, strict_img_size=False)
    pe.proj = nn.Conv2d(3, 4, kernel_size=8, stride=4)  # overlapping patches: not what the GEMM computes
    assert rewrite(pe, torch.device("cpu")) == 0 and type(pe.proj) is nn.Conv2d


def test_fp32_windows_on_the_cpu_only():
    torch.manual_seed(0)
    m = A.create("hilo", 64, 4, alpha=0.5).eval()
    assert rewrite(copy.deepcopy(m), torch.device("cuda")) == 0  # not a CPU: HiLo stays as it is
    fast = _rewritten(m)
    assert type(fast) is Fp32WindowHiLo and fast.state_dict().keys() == m.state_dict().keys()
    x = torch.randn(2, 13 * 17, 64)
    with torch.no_grad():
        ref = m(x, (13, 17))
        torch.testing.assert_close(fast(x, (13, 17)), ref)  # fp32: the same arithmetic
        low = fast.bfloat16()(x.bfloat16(), (13, 17))
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), ref, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("name, swapped", [("deit_tiny_patch16_224", {PatchGemmConv2d}),
                                           ("litv2_s", {PatchGemmConv2d, Fp32WindowHiLo}),
                                           ("cait_xxs24_224", {PatchGemmConv2d, FoldedTalkingHeadAttn})])
def test_rewrite_backend_equals_eager_and_none_is_plain(name, swapped):
    torch.manual_seed(0)
    model = vitlab.create_model(name, **get_model_config(name).smoke_kwargs).eval()
    x = torch.randn(2, 3, *model.patch_embed.img_size)
    with torch.no_grad():
        ref = model(x)
    rewritten = {PatchGemmConv2d, Fp32WindowHiLo, FoldedTalkingHeadAttn}
    plain = optimize(model, x, backend="none")
    assert not any(type(m) in rewritten for m in plain.modules())
    fast = optimize(model, x, backend="rewrite")
    assert {type(m) for m in fast.modules()} & rewritten == swapped
    with torch.no_grad():
        assert max_abs_diff(fast(x), ref) <= 1e-5 * max(1.0, float(ref.abs().max()))


def test_a_bf16_rewrite_is_within_the_tolerance_for_its_dtype():
    """In bf16 the fp32 windows round differently from eager: within auto's bf16 tolerance, not fp32's."""
    from vitlab.optimize import _core

    torch.manual_seed(0)
    model = vitlab.create_model("deit_tiny_patch16_224", img_size=64, depth=2, attn_layer="hilo",
                                class_token=False, global_pool="avg").eval().bfloat16()
    x = torch.randn(2, 3, 64, 64).bfloat16()
    with torch.no_grad():
        ref = model(x)
        out = optimize(copy.deepcopy(model), x, backend="rewrite")(x)
    assert _core._tolerance(ref) == _core.TOLERANCE[torch.bfloat16] > _core.TOLERANCE[torch.float32]
    assert 0 < max_abs_diff(out, ref) <= _core._tolerance(ref) * max(1.0, _core._scale(ref))
