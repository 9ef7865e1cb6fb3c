"""vitlab.optimize: every backend computes eager's function; auto picks by (faked) timing, caches per machine."""

from __future__ import annotations

import json
import types

import pytest
import torch
import torch.nn as nn

import vitlab
import vitlab.optimize as vo
from vitlab.optimize import _core, cpu
from vitlab.optimize.onednn import OneDNNLinear
from vitlab.registry import get_model_config

FAMILIES = ["deit_tiny_patch16_224", "levit_128s", "swin_tiny_patch4_window7_224", "cait_xxs24_224",
            "efficientformer_l1", "litv2_s"]


def tiny(name: str) -> nn.Module:
    torch.manual_seed(0)
    return vitlab.create_model(name, **get_model_config(name).smoke_kwargs)


def reference(name: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    model = tiny(name).eval()
    x = vo.default_input(model, 2)
    with torch.no_grad():
        ref = model(x)
    return model, x, ref


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("VITLAB_CACHE_DIR", str(tmp_path / "cache"))


def test_the_package_exposes_optimize_and_its_submodules():
    assert isinstance(vitlab.optimize, types.ModuleType)
    import importlib

    assert importlib.import_module("vitlab.optimize.onednn") is vitlab.optimize.onednn  # submodules reachable
    assert vitlab.optimize.onednn.OneDNNLinear is OneDNNLinear
    assert vitlab.optimize.optimize is _core.optimize


def test_onednn_path_present_where_torch_has_mkldnn():
    # no skipif hides the fast path: where torch has oneDNN, the swap must be available and used
    from vitlab.optimize.onednn import onednn_linear_available

    if torch.backends.mkldnn.is_available():
        assert onednn_linear_available()
        model = vo.optimize(tiny("deit_tiny_patch16_224"), backend="onednn")
        assert any(isinstance(m, OneDNNLinear) for m in model.modules())


@pytest.mark.parametrize("name, backend", [(n, b) for n in FAMILIES for b in ("none", "onednn")]
                         + [("litv2_s", "kernels"), ("deit_tiny_patch16_224", "kernels")])
def test_eager_backends_equal_eager(name, backend):
    _, x, ref = reference(name)
    model = vo.optimize(tiny(name), x, backend=backend)
    assert model.vitlab_backend == backend and not model.training
    with torch.no_grad():
        out = model(x)
    assert vo.max_abs_diff(out, ref) <= 1e-5
    out = model(x)  # grad mode on: still the same function (the swapped layers' parameters need no grad)
    assert vo.max_abs_diff(out, ref) <= 1e-5


@pytest.mark.parametrize("backend", ["compile", "onednn+compile"])
def test_compile_backends_equal_eager_and_keep_inductor_config(backend):
    import torch._inductor.config as inductor_config

    before = inductor_config.freezing
    _, x, ref = reference("deit_tiny_patch16_224")
    model = vo.optimize(tiny("deit_tiny_patch16_224"), x, backend=backend)
    assert isinstance(model, vo.CompiledInference) and model.vitlab_backend == backend
    out = model(x)  # runs under no_grad by itself
    assert not out.requires_grad
    assert vo.max_abs_diff(out, ref) <= 1e-5
    assert inductor_config.freezing == before  # freezing was a per-call option
    assert model.num_classes == 1000  # attributes reach the eager module
    if backend == "onednn+compile" and torch.backends.mkldnn.is_available():
        assert any(isinstance(m, OneDNNLinear) and m.in_graph for m in model.modules())


def test_inductor_options_state_the_simd_width_of_the_isa_in_use(monkeypatch):
    """The SIMD width goes into Inductor's cache key only when stated: it must follow ATEN_CPU_CAPABILITY, as
    Inductor's own choice does, so a graph compiled under the AVX2 caps is never served to a native process."""
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    widths = {isa.bit_width() for isa in valid_vec_isa_list()}
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    native = cpu.inductor_options()
    assert native["freezing"] is True and native["cpp.simdlen"] == (max(widths) if widths else 0)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    assert cpu.inductor_options()["cpp.simdlen"] == 0  # scalar code, as Inductor picks under that cap
    if {256, 512} <= widths:  # an AVX-512 machine: the emulated AVX2 gets another key
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
        assert cpu.inductor_options()["cpp.simdlen"] == 256


def test_inductor_options_build_the_cpp_for_the_capped_isa(monkeypatch):
    """Under ATEN_CPU_CAPABILITY=avx2 on x86 Inductor's C++ is built for x86-64-v3, not -march=native (whose
    AVX-512 code lowered the clock of an emulated AVX2 run); natively, or with TORCHINDUCTOR_CPP_MARCH set, the
    option is left to Inductor."""
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.delenv("TORCHINDUCTOR_CPP_MARCH", raising=False)
    assert "cpp.march" not in cpu.inductor_options()
    monkeypatch.setattr(cpu, "_x86", lambda: True)
    for cap, march in (("avx2", "x86-64-v3"), ("AVX2", "x86-64-v3"), ("default", "x86-64")):
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", cap)
        assert cpu.inductor_options()["cpp.march"] == march
    monkeypatch.setenv("TORCHINDUCTOR_CPP_MARCH", "skylake")  # the user's own choice stands
    assert "cpp.march" not in cpu.inductor_options()
    monkeypatch.delenv("TORCHINDUCTOR_CPP_MARCH")
    monkeypatch.setattr(cpu, "_x86", lambda: False)
    assert "cpp.march" not in cpu.inductor_options()


def test_compile_backend_passes_the_inductor_options(monkeypatch):
    seen = []
    monkeypatch.setattr(torch, "compile", lambda model, options=None, **kw: seen.append(options) or model)
    vo.optimize(tiny("deit_tiny_patch16_224"), backend="compile")
    assert seen == [cpu.inductor_options()]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["levit_128s", "swin_tiny_patch4_window7_224", "cait_xxs24_224", "litv2_s"])
@pytest.mark.parametrize("backend", ["compile", "onednn+compile"])
def test_compile_backends_equal_eager_slow(name, backend):
    _, x, ref = reference(name)
    model = vo.optimize(tiny(name), x, backend=backend)
    assert vo.max_abs_diff(model(x), ref) <= 1e-5


def test_none_leaves_the_model_as_it_was_but_eval():
    model = tiny("deit_tiny_patch16_224").train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    types_before = [type(m) for m in model.modules()]
    grads = [p.requires_grad for p in model.parameters()]
    out = vo.optimize(model, backend="none")
    assert out is model and not model.training
    assert [type(m) for m in model.modules()] == types_before
    assert [p.requires_grad for p in model.parameters()] == grads
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_none_fuses_levit():
    model = vo.optimize(tiny("levit_128s"), backend="none")
    assert model.fused and not any(isinstance(m, nn.BatchNorm1d | nn.BatchNorm2d) for m in model.modules())


def test_onednn_keeps_the_state_dict_keys():
    model = tiny("deit_tiny_patch16_224").eval()
    keys = list(model.state_dict())
    vo.optimize(model, backend="onednn")
    assert list(model.state_dict()) == keys
    fused = [m for m in model.modules() if isinstance(m, OneDNNLinear) and m.act is not None]
    assert len(fused) == len(model.blocks)  # every Mlp's fc1 carries its GELU


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="backend"):
        vo.optimize(tiny("deit_tiny_patch16_224"), backend="fast")


# ---- auto: fake timings make the choice deterministic ----------------------------------------------------------
class FakeTimer:
    def __init__(self, times: dict[str, float]):
        self.times, self.calls = times, 0

    def __call__(self, candidates, device, **kwargs):
        self.calls += 1
        for fn in candidates.values():
            fn()
        return {n: self.times.get(n, 1.0) for n in candidates}


@pytest.mark.parametrize("times, expected", [
    ({"none": 1.0, "onednn": 0.5}, "onednn"),
    ({"none": 1.0, "onednn": 1.5}, "none"),
    ({"none": 1.0, "onednn": 0.995}, "none"),  # within the margin: eager is kept
])
def test_auto_picks_the_fastest_never_slower_than_eager(monkeypatch, times, expected):
    timer = FakeTimer(times)
    monkeypatch.setattr(_core, "measure", timer)
    _, x, ref = reference("deit_tiny_patch16_224")
    model = vo.optimize(tiny("deit_tiny_patch16_224"), x, candidates=["none", "onednn"], tune=True)
    assert model.vitlab_backend == expected and timer.calls == 2  # the rewrites first, then the candidates
    r = model.vitlab_optimize
    assert r.timings[expected] <= r.timings["none"] and not r.cached
    with torch.no_grad():
        assert vo.max_abs_diff(model(x), ref) <= 1e-5
    assert expected in vo.explain(model)


def test_auto_rejects_a_candidate_that_changes_the_function(monkeypatch):
    monkeypatch.setattr(_core, "measure", FakeTimer({"none": 1.0, "onednn": 0.1}))
    real = _core._build

    def broken(model, backend, device, notes, explicit=False, rewrites=None):
        out = real(model, backend, device, notes, explicit, rewrites)
        if backend == "onednn":
            with torch.no_grad():
                next(m for m in out.modules() if isinstance(m, OneDNNLinear)).bias.add_(1.0)
        return out

    monkeypatch.setattr(_core, "_build", broken)
    model = vo.optimize(tiny("deit_tiny_patch16_224"), candidates=["none", "onednn"], cache=False, tune=True)
    assert model.vitlab_backend == "none" and "differs from eager" in model.vitlab_optimize.rejected["onednn"]


def test_auto_caches_the_choice_atomically_keyed_by_isa(monkeypatch, tmp_path):
    timer = FakeTimer({"none": 1.0, "onednn": 0.5})
    monkeypatch.setattr(_core, "measure", timer)
    x = vo.default_input(tiny("deit_tiny_patch16_224"), 2)
    first = vo.optimize(tiny("deit_tiny_patch16_224"), x, candidates=["none", "onednn"], tune=True)
    assert timer.calls == 2 and not first.vitlab_optimize.cached
    path = tmp_path / "cache" / "optimize.json"
    assert vo.cache_file() == path
    data = json.loads(path.read_text())
    [entry] = data["entries"].values()
    assert entry["backend"] == "onednn" and entry["key"]["isa"] == cpu.isa()
    assert entry["key"]["cpu"] == cpu.cpu_model() and entry["key"]["inputs"] == [[3, 32, 32]]  # one item's
    assert [p.name for p in path.parent.iterdir()] == ["optimize.json"]  # the temporary file was renamed

    second = vo.optimize(tiny("deit_tiny_patch16_224"), x, candidates=["none", "onednn"], tune=True)
    assert timer.calls == 2 and second.vitlab_optimize.cached and second.vitlab_backend == "onednn"
    assert any(isinstance(m, OneDNNLinear) for m in second.modules())

    monkeypatch.setattr(cpu, "isa", lambda: "AVX2")  # another ISA (e.g. the AVX2 emulation): measured afresh
    third = vo.optimize(tiny("deit_tiny_patch16_224"), x, candidates=["none", "onednn"], tune=True)
    assert timer.calls == 4 and not third.vitlab_optimize.cached
    assert len(json.loads(path.read_text())["entries"]) == 2

    fourth = vo.optimize(tiny("deit_tiny_patch16_224"), vo.default_input(tiny("deit_tiny_patch16_224"), 4),
                         candidates=["none", "onednn"], tune=True)  # another batch size: the same key
    assert timer.calls == 4 and fourth.vitlab_optimize.cached


def test_cache_key_leaves_the_batch_size_out():
    model, dev = tiny("deit_tiny_patch16_224"), torch.device("cpu")
    key = vo.cache_key(model, (torch.zeros(2, 3, 32, 32),), dev, ["none"])
    assert key == vo.cache_key(model, (torch.zeros(64, 3, 32, 32),), dev, ["none"])
    assert key != vo.cache_key(model, (torch.zeros(2, 3, 48, 48),), dev, ["none"])  # another item shape
    assert key != vo.cache_key(model, (torch.zeros(2, 3, 32, 32, dtype=torch.float64),), dev, ["none"])


def test_a_broken_cache_file_is_ignored_and_replaced(monkeypatch, tmp_path):
    monkeypatch.setattr(_core, "measure", FakeTimer({"none": 1.0, "onednn": 2.0}))
    path = tmp_path / "cache" / "optimize.json"
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    model = vo.optimize(tiny("deit_tiny_patch16_224"), candidates=["none", "onednn"], tune=True)
    assert model.vitlab_backend == "none"
    assert json.loads(path.read_text())["version"] == _core.CACHE_VERSION


# ---- auto measures only work that wins the measuring back -----------------------------------------------------
def _refuse(what: str):
    def refuse(*args, **kwargs):
        raise AssertionError(f"{what} called")

    return refuse


def test_a_handful_of_inputs_is_not_measured(monkeypatch, tmp_path):
    """``vitlab predict`` on two images: nothing is built, compiled or timed, nothing cached; the model runs eager."""
    timer = FakeTimer({})
    monkeypatch.setattr(_core, "measure", timer)
    monkeypatch.setattr(torch, "compile", _refuse("torch.compile"))
    _, x, ref = reference("deit_tiny_patch16_224")  # two images
    model = vo.optimize(tiny("deit_tiny_patch16_224"), x)
    assert model.vitlab_backend == "none" and timer.calls == 0 and not model.vitlab_optimize.cached
    assert "not measured (2 input items, fewer than 8): eager" in vo.explain(model)
    assert not (tmp_path / "cache").exists()
    with torch.no_grad():
        assert vo.max_abs_diff(model(x), ref) <= 1e-5


def test_a_short_eager_call_is_not_measured(monkeypatch):
    timer = FakeTimer({"none": 1.0, "onednn": 0.5})
    monkeypatch.setattr(_core, "measure", timer)
    x = vo.default_input(tiny("deit_tiny_patch16_224"), _core.TUNE_MIN_BATCH)
    monkeypatch.setattr(_core, "TUNE_MIN_SECONDS", 1e9)  # every eager call is short
    model = vo.optimize(tiny("deit_tiny_patch16_224"), x, candidates=["none", "onednn"])
    assert model.vitlab_backend == "none" and timer.calls == 0 and "ms, under" in vo.explain(model)
    monkeypatch.setattr(_core, "TUNE_MIN_SECONDS", 0.0)  # every eager call is long enough: measured
    model = vo.optimize(tiny("deit_tiny_patch16_224"), x, candidates=["none", "onednn"])
    assert model.vitlab_backend == "onednn" and timer.calls == 2


@pytest.mark.parametrize("rewrite_time, kept", [(0.5, True), (1.5, False)])
def test_the_other_backends_build_on_the_rewrites_only_where_they_are_faster(monkeypatch, rewrite_time, kept):
    """Each rewrite is timed alone against eager; the backends build on those that are faster."""
    from vitlab.optimize.rewrite import PatchGemmConv2d

    timer = FakeTimer({"none": 1.0, "patch_gemm": rewrite_time, "onednn": 0.4})
    monkeypatch.setattr(_core, "measure", timer)
    _, x, ref = reference("deit_tiny_patch16_224")
    model = vo.optimize(tiny("deit_tiny_patch16_224"), x, candidates=["none", "rewrite", "onednn"], tune=True)
    r = model.vitlab_optimize
    assert model.vitlab_backend == "onednn" and r.rewrites == (["patch_gemm"] if kept else [])
    assert any(type(m) is PatchGemmConv2d for m in model.modules()) is kept
    assert f"patch_gemm {rewrite_time * 1e3:.2f} ms ({'kept' if kept else 'left out'})" in vo.explain(model)
    assert ("rewrite" in r.timings) is kept and ("rewrite" in r.rejected) is not kept
    cached = vo.optimize(tiny("deit_tiny_patch16_224"), x, candidates=["none", "rewrite", "onednn"], tune=True)
    assert cached.vitlab_optimize.cached and timer.calls == 2 and cached.vitlab_optimize.rewrites == r.rewrites
    assert any(type(m) is PatchGemmConv2d for m in cached.modules()) is kept
    with torch.no_grad():
        assert vo.max_abs_diff(model(x), ref) <= 1e-5


def test_small_work_takes_the_fastest_cheap_cached_choice(monkeypatch):
    """A choice measured on a large batch serves a small one by its timings, without compiling anything."""
    monkeypatch.setattr(_core, "measure", _refuse("measure"))
    monkeypatch.setattr(torch, "compile", _refuse("torch.compile"))
    big = vo.default_input(tiny("deit_tiny_patch16_224"), 32)
    key = vo.cache_key(tiny("deit_tiny_patch16_224"), (big,), torch.device("cpu"), list(vo.BACKENDS))

    def cached(**timings):
        _core._write_cache(vo.cache_file(), {_core._key_id(key): dict(backend="compile", key=key, timings=timings)})

    cached(none=1.0, onednn=0.8, compile=0.2, **{"onednn+compile": 0.3})
    for x, tune in ((big[:2], None), (big, False)):
        model = vo.optimize(tiny("deit_tiny_patch16_224"), x, tune=tune)
        assert model.vitlab_backend == "onednn" and model.vitlab_optimize.cached
        assert any(isinstance(m, OneDNNLinear) for m in model.modules())
        assert model.vitlab_optimize.timings == {"none": 1.0, "onednn": 0.8}
    cached(none=1.0, onednn=0.995, compile=0.2)  # oneDNN within the margin of eager: eager
    assert vo.optimize(tiny("deit_tiny_patch16_224"), big[:2]).vitlab_backend == "none"


def test_kernels_are_never_built_for_a_model_without_hilo(monkeypatch):
    from vitlab.optimize import kernels

    monkeypatch.setattr(kernels, "available", _refuse("kernels.available"))
    monkeypatch.setattr(_core, "measure", FakeTimer({"none": 1.0}))
    x = vo.default_input(tiny("deit_tiny_patch16_224"), _core.TUNE_MIN_BATCH)
    model = vo.optimize(tiny("deit_tiny_patch16_224"), x, candidates=["none", "kernels"], cache=False, tune=True)
    assert model.vitlab_optimize.rejected == {"kernels": "does not apply"}
    assert "no HiLo module to swap" in vo.explain(model)
    assert vo.optimize(tiny("deit_tiny_patch16_224"), backend="kernels").vitlab_backend == "kernels"  # oneDNN
    asked = []
    monkeypatch.setattr(kernels, "available", lambda: asked.append(1) or False)
    vo.optimize(tiny("litv2_s"), backend="kernels")  # a HiLo model does ask for them
    assert asked


def test_cpp_extension_is_imported_without_its_cuda_warning(tmp_path):
    """Importing torch's cpp_extension logs "No CUDA runtime is found" where a CUDA toolkit is found and no GPU;
    vitlab imports it first, quietly, for the HiLo kernels' build and before Inductor's C++ compile."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "CUDA_HOME": str(tmp_path)}  # a toolkit is found: the warning's condition
    code = ("import logging, sys; from vitlab.optimize.cpu import cpp_extension; c = cpp_extension(); "
            "assert c is sys.modules['torch.utils.cpp_extension'] and c.CUDA_HOME; "
            "assert logging.getLogger(c.__name__).level == logging.NOTSET")  # the logger left as it was
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "No CUDA runtime" not in r.stderr
    if torch.version.cuda and not torch.cuda.is_available():  # the control: torch's own import warns here
        r = subprocess.run([sys.executable, "-c", "import torch.utils.cpp_extension"], env=env, capture_output=True,
                           text=True, timeout=300)
        assert "No CUDA runtime" in r.stderr


def test_cache_key_follows_the_isa_emulation(monkeypatch):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    assert "ONEDNN_MAX_CPU_ISA=AVX2" in cpu.isa() and not cpu.native_bf16()
    key = vo.cache_key(tiny("deit_tiny_patch16_224"), (torch.zeros(1, 3, 32, 32),), torch.device("cpu"), ["none"])
    assert "AVX2" in key["isa"]


def test_bf16_without_native_support_is_reported(monkeypatch):
    monkeypatch.setattr(cpu, "native_bf16", lambda: False)
    model = tiny("deit_tiny_patch16_224").to(torch.bfloat16)
    with pytest.warns(UserWarning, match="no native bf16"):
        out = vo.optimize(model, backend="none")
    assert any("no native bf16" in n for n in out.vitlab_optimize.notes)


def test_measure_times_every_candidate():
    t = vo.measure({"a": lambda: sum(range(100)), "b": lambda: sum(range(100000))}, torch.device("cpu"), runs=3)
    assert set(t) == {"a", "b"} and t["b"] > t["a"] > 0
