"""The compiled forward of the Llama decoder: the same tokens as eager generation, with padding or without, a few
graphs shared across prompt lengths and decoding steps, the weights frozen (prepacked for MKL's, oneDNN's or
vitlab's GEMM, whichever is fastest here); and ``vitlab.optimize.optimize`` on a Llama or on a LLaVA-style model's
language model."""

from __future__ import annotations

import itertools
import platform

import pytest
import torch

import vitlab
from vitlab.models.llama import Llama
from vitlab.optimize import explain, kernels, optimize
from vitlab.optimize.llama import (
    GEMMS,
    CompiledLlama,
    KernelLlamaAttention,
    PackedLinear,
    PackedSwiGLU,
    compile_llama,
    faster_gemm,
    packed_gemm_times,
    packed_gemms_available,
    with_fused_attention,
    with_packed_linears,
)
from vitlab.vlm.llava import LLaVA


@pytest.mark.slow  # Inductor compiles C++ (about a minute on two cores)
def test_compiled_generation_equals_eager():
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    torch.manual_seed(0)
    model = vitlab.create_model("llama_tiny").eval()
    fast = compile_llama(model)
    ids = torch.randint(3, 512, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    assert torch.equal(model.generate(ids, 10, attention_mask=mask, forward=fast),
                       model.generate(ids, 10, attention_mask=mask))
    for n, new in ((13, 12), (20, 3), (9, 5)):  # other prompt lengths: no new graph after the second
        other = torch.randint(3, 512, (2, n))
        assert torch.equal(model.generate(other, new, forward=fast), model.generate(other, new))
    # prefill and step, with and without a padding mask: each compiled static, then once with symbolic sizes
    assert counters["stats"]["unique_graphs"] <= 8 and not counters["graph_break"]
    if torch.backends.mkldnn.is_available() and torch._C.has_mkl:  # the weights became constants, prepacked
        assert counters["inductor"]["mkldnn_linear_weight_pack_matcher_count"] > 0
    steps_only = compile_llama(model, prefill=False)
    assert torch.equal(model.generate(ids, 4, forward=steps_only), model.generate(ids, 4))


@pytest.mark.slow  # Inductor compiles C++ (a minute or two on two cores)
def test_two_optimized_models_and_several_batch_sizes_keep_their_own_graphs():
    """The compiled graphs are unguarded snapshots of one model's frozen weights: a second model of the same
    architecture gets graphs of its own, not the first one's (whose tokens it would return), and each batch size
    its own compiled function, within Dynamo's recompilation limit (exceeded, it would fall back to eager and
    warn)."""
    import copy

    torch._dynamo.reset()
    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        models.append(vitlab.create_model("llama_tiny").eval())
    eager = [copy.deepcopy(m) for m in models]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 512, (2, 12), generator=g)
    fast_a = optimize(models[0])
    assert torch.equal(fast_a.generate(ids, 6), eager[0].generate(ids, 6))
    fast_b = optimize(models[1])
    assert not torch.equal(eager[0].generate(ids, 6), eager[1].generate(ids, 6))
    assert torch.equal(fast_b.generate(ids, 6), eager[1].generate(ids, 6))
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):  # an error, not a quiet eager fallback
        for b in (3, 1, 2):
            for n in (5, 9, 13):
                x = torch.randint(3, 512, (b, n), generator=g)
                mask = torch.ones_like(x)
                mask[0, :2] = 0
                assert torch.equal(fast_b.generate(x, 4, attention_mask=mask),
                                   eager[1].generate(x, 4, attention_mask=mask))
                assert torch.equal(fast_b.generate(x, 4), eager[1].generate(x, 4))


def test_the_gemm_library_is_timed_on_the_models_weight_shapes():
    if platform.machine().lower() in ("x86_64", "amd64"):  # the official x86 wheels carry MKL and oneDNN
        assert packed_gemms_available()
    if not packed_gemms_available():
        pytest.skip("no MKL in this torch build: Inductor packs for oneDNN alone, nothing to choose")
    model = vitlab.create_model("llama_tiny").eval()
    weights = [model.layers[0].attn.qkv.weight, model.lm_head.weight]
    times = packed_gemm_times(weights, rows=3, runs=3)
    assert set(times) == {"mkl", "onednn"} | ({"vitlab"} if kernels.available() else set())
    assert all(t > 0 for t in times.values())
    assert faster_gemm(model, 3) in GEMMS[1:] and faster_gemm(model, 3) == faster_gemm(model, 3)
    with pytest.raises(ValueError, match="gemm must be one of"):
        compile_llama(model, gemm="openblas")


def test_vitlab_gemm_without_the_kernels_is_refused_with_the_reason(monkeypatch):
    if not packed_gemms_available():
        pytest.skip("no MKL in this torch build: Inductor packs for oneDNN alone, nothing to time")
    monkeypatch.setattr(kernels, "_library", lambda: None)
    monkeypatch.setattr(kernels, "_reason", "no C++ compiler found (set CXX, or install g++)")
    model = vitlab.create_model("llama_tiny").eval()
    with pytest.raises(ValueError, match="gemm='vitlab' needs vitlab's CPU kernels.*no C\\+\\+ compiler"):
        compile_llama(model, gemm="vitlab")
    assert set(packed_gemm_times([model.lm_head.weight], rows=2, runs=1)) == {"mkl", "onednn"}


@pytest.mark.slow  # Inductor compiles C++ (a minute or two on two cores)
@pytest.mark.parametrize("gemm", ["onednn", "mkl", "vitlab"])
def test_the_chosen_gemm_library_runs_every_linear(gemm):
    """``gemm="onednn"`` hands every GEMM with more than one row to oneDNN's kernel (symbolic row counts), prompt
    and decoding steps, with a padding mask or without; ``"mkl"`` leaves them all to MKL's packed sgemm;
    ``"vitlab"`` runs the linear layers on vitlab's packed kernel (the prompt's last block, which projects the last
    position's query alone through a slice of the weight, stays with Inductor's MKL). The same tokens as eager
    every way."""
    from torch.profiler import ProfilerActivity, profile

    assert packed_gemms_available()
    if gemm == "vitlab" and not kernels.available():
        assert kernels._unavailable_reason() is not None, kernels.status()  # no toolchain here, not a failed build
        pytest.skip(f"CPU kernels: {kernels.status()}")
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = vitlab.create_model("llama_tiny").eval()
    fast = compile_llama(model, options={"cpp_wrapper": False}, gemm=gemm)  # the Python wrapper: calls profiled
    ids = torch.randint(3, 512, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    for kwargs in ({}, {"attention_mask": mask}):
        want = model.generate(ids, 6, **kwargs)
        assert torch.equal(model.generate(ids, 6, forward=fast, **kwargs), want)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            assert torch.equal(model.generate(ids, 6, forward=fast, **kwargs), want)
        ran = {e.key for e in prof.key_averages()}
        if gemm == "vitlab":
            assert PACKED in ran and "mkldnn::_linear_pointwise" not in ran, sorted(k for k in ran if "linear" in k)
            continue
        mine, other = ("mkldnn::_linear_pointwise", "mkl::_mkl_linear")[:: 1 if gemm == "onednn" else -1]
        assert mine in ran and other not in ran and PACKED not in ran, sorted(k for k in ran if "linear" in k)


def _ran(fn) -> set[str]:
    """The operators ``fn()`` ran (CPU profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key for e in prof.key_averages()}


FUSED = "vitlab_kernels::causal_attention"
PACKED = "vitlab_kernels::packed_linear"


@pytest.fixture
def kernels_built():
    """vitlab's CPU kernels, asserted built where the toolchain is (skipped only where it is not)."""
    reason = kernels._unavailable_reason()
    if reason is not None:
        pytest.skip(f"CPU kernels: {reason}")
    assert kernels.available(), kernels.status()


def test_fused_attention_snapshot_runs_the_kernel_for_prompts_only(kernels_built):
    """The snapshot shares the model's tensors and swaps its attention layers, the model itself untouched; a prompt
    from position 0 runs the fused causal kernel, with eager's logits and tokens; a padded prompt and the decoding
    steps stay on SDPA."""
    torch.manual_seed(0)
    model = vitlab.create_model("llama_tiny").eval()  # grouped-query heads: 4 query heads, 2 key / value heads
    fused = with_fused_attention(model)
    assert _tensors(fused) == _tensors(model)
    assert all(type(b.attn) is KernelLlamaAttention for b in fused.layers)
    assert all(type(b.attn) is not KernelLlamaAttention for b in model.layers)
    ids = torch.randint(3, 512, (2, 70))  # two of the kernel's 64-row chunks
    with torch.no_grad():
        torch.testing.assert_close(fused(ids), model(ids), atol=1e-5, rtol=1e-5)
        assert FUSED in _ran(lambda: fused(ids))
        want = model.generate(ids, 5)
        assert torch.equal(fused.generate(ids, 5), want)
        cache = fused.new_cache(2, 80)
        fused(ids, cache=cache, logits_to_keep=1)
        step = ids[:, -1:]
        assert FUSED not in _ran(lambda: fused(step, cache=cache))  # one token against the cache
        mask = torch.ones_like(ids)
        mask[0, :4] = 0
        assert FUSED not in _ran(lambda: fused(ids, attention_mask=mask))
        assert torch.equal(fused.generate(ids, 5, attention_mask=mask), model.generate(ids, 5, attention_mask=mask))


def test_packed_linear_snapshot_equals_the_model(kernels_built):
    """The snapshot's linear layers run vitlab's packed GEMM on packed copies of the shared weights, its SwiGLU
    layers with the gate in the GEMM: eager's logits and tokens, the model itself untouched, the same state dict
    (the packed copies are not saved)."""
    torch.manual_seed(0)
    model = vitlab.create_model("llama_tiny").eval()
    packed = with_packed_linears(with_fused_attention(model))
    assert set(_tensors(model)) <= set(_tensors(packed))  # shared; the packed copies are new buffers
    assert all(type(b.mlp) is PackedSwiGLU for b in packed.layers)
    assert all(type(m) is PackedLinear for m in packed.modules()
               if isinstance(m, torch.nn.Linear) and not any(m is b.mlp.fc1 for b in packed.layers))
    assert not any(type(m) is PackedLinear for m in model.modules())
    assert packed.state_dict().keys() == model.state_dict().keys()
    ids = torch.randint(3, 512, (2, 30))
    with torch.no_grad():
        torch.testing.assert_close(packed(ids), model(ids), atol=1e-4, rtol=1e-4)
        assert PACKED in _ran(lambda: packed(ids))
        assert torch.equal(packed.generate(ids, 6), model.generate(ids, 6))


@pytest.mark.slow  # Inductor compiles C++ (a minute or two on two cores)
def test_compiled_prefill_runs_the_fused_attention(kernels_built):
    """Compiled, the prompt's attention is the fused kernel (an opaque operator in the graph), and the tokens are
    eager's; ``fused_attention=False`` keeps SDPA."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = vitlab.create_model("llama_tiny").eval()
    ids = torch.randint(3, 512, (2, 21))
    want = model.generate(ids, 6)
    for fused in (True, False):
        fast = compile_llama(model, options={"cpp_wrapper": False}, fused_attention=fused)
        assert torch.equal(model.generate(ids, 6, forward=fast), want)
        assert (FUSED in _ran(lambda fast=fast: model.generate(ids, 6, forward=fast))) is fused
    assert all(type(b.attn) is not KernelLlamaAttention for b in model.layers)


def test_optimize_picks_the_language_model_compile_without_compiling_yet():
    model = vitlab.create_model("llama_tiny").eval()
    fast = optimize(model)  # torch.compile is lazy: nothing is compiled until the first call
    assert isinstance(fast, CompiledLlama) and fast.module is model and fast.vitlab_backend == "compile"
    assert fast.config is model.config and "Llama" in explain(fast)
    assert optimize(model, backend="none") is model and optimize(model, tune=False) is model


def _tensors(model: torch.nn.Module) -> list[int]:
    return sorted(id(t) for t in itertools.chain(model.parameters(), model.buffers()))


def test_optimize_leaves_a_llava_as_it_was_and_shares_its_weights():
    """A LLaVA is not modified: optimize returns a copy holding the same tensors, its language model compiled
    (lazily: nothing is compiled here), while the original keeps its keys, its eager generate and its training."""
    torch.manual_seed(0)
    llava = vitlab.create_model("llava_tiny").eval()
    lm, keys = llava.language_model, list(llava.state_dict())
    x = torch.randn(2, 3, 32, 32)
    prompt = torch.tensor([[1, 110, 20, 21], [1, 110, 30, 31]])
    want = llava.generate(prompt, x, max_new_tokens=5, eos_token_id=-1)
    for backend in ("compile", "auto"):
        fast = optimize(llava, backend=backend)
        assert isinstance(fast, LLaVA) and fast is not llava and fast.vitlab_backend == "compile"
        assert isinstance(fast.language_model, CompiledLlama) and fast.language_model.module is not lm
        assert _tensors(fast) == _tensors(llava)  # shared, not copied
        assert llava.language_model is lm and type(lm) is Llama and list(llava.state_dict()) == keys
        assert getattr(llava, "vitlab_backend", None) is None
    assert torch.equal(llava.generate(prompt, x, max_new_tokens=5, eos_token_id=-1), want)
    fresh = vitlab.create_model("llava_tiny")
    fresh.load_state_dict(llava.state_dict())  # the keys a LLaVA has
    llava.train()
    out = llava(prompt, x, labels=prompt)
    assert out.loss.requires_grad
    out.loss.backward()
    assert all(p.grad is not None for p in lm.parameters())


def test_compiled_llama_keeps_its_cache_between_calls():
    torch.manual_seed(0)
    model = vitlab.create_model("llama_tiny").eval()
    fast = CompiledLlama(model, model)  # the eager forward in the compiled one's place: the cache logic alone
    ids = torch.randint(3, 512, (2, 7))
    assert torch.equal(fast.generate(ids, 6), model.generate(ids, 6))
    kept = fast.cache
    assert kept is not None and kept.max_len == 13
    shorter = torch.randint(3, 512, (2, 4))
    assert torch.equal(fast.generate(shorter, max_new_tokens=6), model.generate(shorter, 6))
    assert fast.cache is kept  # it fits: refilled, not reallocated
    assert torch.equal(fast.generate(ids, 6), model.generate(ids, 6))
    wider = torch.randint(3, 512, (3, 7))
    assert torch.equal(fast.generate(wider, 6), model.generate(wider, 6))
    assert fast.cache is not kept and fast.cache.k[0].shape[0] == 3
    with pytest.raises(ValueError, match="exceed the context"):  # refused before a cache of that size is made
        fast.generate(ids, 300)
    assert fast.cache.max_len == 13
    for bad in (dict(max_new_tokens=0), dict(max_new_tokens=4, temperature=-1.0)):  # refused, the cache untouched
        with pytest.raises(ValueError, match="must be"):
            fast.generate(torch.randint(3, 512, (5, 7)), **bad)
        assert fast.cache.k[0].shape[0] == 3 and fast.cache.max_len == 13
    fast.release_cache()
    assert fast.cache is None


@pytest.mark.slow  # Inductor compiles C++ (a minute or two on two cores)
def test_optimized_llama_and_llava_generate_as_eager():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = vitlab.create_model("llama_tiny").eval()
    ids = torch.randint(3, 512, (2, 7))
    want = model.generate(ids, 6)
    assert torch.equal(optimize(model).generate(ids, 6), want)
    llava = vitlab.create_model("llava_tiny").eval()
    x = torch.randn(2, 3, 32, 32)
    prompt = torch.tensor([[1, 110, 20, 21], [1, 110, 30, 31]])
    want = llava.generate(prompt, x, max_new_tokens=5, eos_token_id=-1)
    fast = optimize(llava)
    assert torch.equal(fast.generate(prompt, x, max_new_tokens=5, eos_token_id=-1), want)
    assert torch.allclose(fast(prompt, x).logits, llava(prompt, x).logits, atol=1e-4)
    # the original stays eager after the compiled calls: its generate follows a change of its weights (the
    # compiled snapshot froze them), and it trains
    assert type(llava.language_model) is Llama
    with torch.no_grad():
        llava.language_model.lm_head.weight.zero_()  # every logit 0: greedy picks token 0
    assert not llava.generate(prompt, x, max_new_tokens=5, eos_token_id=-1).any()
    llava.train()
    llava(prompt, x, labels=prompt).loss.backward()
    assert llava.language_model.lm_head.weight.grad is not None
