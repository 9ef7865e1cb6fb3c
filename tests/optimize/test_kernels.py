"""vitlab.optimize.kernels: the attention operators (HiLo's two and the causal prompt attention) compute what
PyTorch's SDPA computes, and the packed linear what ``F.linear`` computes, on both instruction set paths and any
shape they accept; they reject the others with a clear error, and build once into an atomic cache.

Where the toolchain exists (x86-64 Linux, a C++ compiler, ninja, an AVX2 CPU) the kernels must be available:
those tests fail rather than skip when the build breaks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from vitlab.optimize import kernels


@pytest.fixture(scope="module")
def built():
    """The kernels, asserted present where the toolchain is (skipped only where it is not)."""
    reason = kernels._unavailable_reason()
    if reason is not None:
        pytest.skip(f"CPU kernels: {reason}")
    assert kernels.available(), kernels.status()


# every instruction-set path this CPU runs: AVX2 always, AVX-512 where ATen's capability has it
ISAS = ["AVX2"] + (["AVX512"] if kernels.isa() == "AVX512" else [])


@pytest.fixture(params=ISAS)
def isa(request, built, monkeypatch):
    monkeypatch.setattr(kernels, "_ISA_CODE", kernels._ISA_CODES[request.param])
    return request.param


def _window_reference(qkv: torch.Tensor, s: int, heads: int) -> torch.Tensor:
    """Attention of each s x s window (cut at the border) over its real tokens, one window at a time."""
    B, H, W, C3 = qkv.shape
    d = C3 // (3 * heads)
    if s == 1:  # one token a window attends only to itself: its value (channels: all q, all k, all v)
        return qkv[..., 2 * heads * d:].contiguous()
    out = torch.empty(B, H, W, heads * d)
    for r in range(0, H, s):
        for c in range(0, W, s):
            win = qkv[:, r:r + s, c:c + s]  # (B, h', w', 3 * heads * d)
            h_, w_ = win.shape[1:3]
            q, k, v = win.reshape(B, h_ * w_, 3, heads, d).permute(2, 0, 3, 1, 4)
            o = F.scaled_dot_product_attention(q, k, v)  # (B, heads, T, d)
            out[:, r:r + s, c:c + s] = o.transpose(1, 2).reshape(B, h_, w_, heads * d)
    return out


@pytest.mark.parametrize("d", [16, 32, 48, 64])
@pytest.mark.parametrize("m", [1, 5, 9, 16, 49, 64])
@pytest.mark.parametrize("n", [1, 7, 196])
def test_lofi_equals_sdpa(isa, d, m, n):
    B, H = 2, 3
    q = torch.randn(B, n, 2 * H * d)[..., H * d:].reshape(B, n, H, d).transpose(1, 2)  # strided, as HiLo's
    kv = torch.randn(B, m, 2, H, d).permute(2, 0, 3, 1, 4)  # k and v: views of one projection
    k, v = kv.unbind(0)
    with torch.inference_mode():
        out = kernels.lofi_attention(q, k, v)
        ref = F.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    assert out.transpose(1, 2).is_contiguous()  # (B, N, heads, d) memory, as SDPA's CPU output


def test_lofi_scale_and_large_logits(isa):
    q, k, v = torch.randn(1, 2, 9, 32) * 30, torch.randn(1, 2, 49, 32) * 30, torch.randn(1, 2, 49, 32)
    with torch.no_grad():
        for scale in (None, 1.0, 0.01):
            torch.testing.assert_close(kernels.lofi_attention(q, k, v, scale=scale),
                                       F.scaled_dot_product_attention(q, k, v, scale=scale), atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("hw", [(14, 14), (13, 17), (1, 1), (3, 2)])
@pytest.mark.parametrize("s", [1, 2, 3, 8])
@pytest.mark.parametrize("d", [16, 64])
def test_window_attention_equals_per_window_sdpa(isa, hw, s, d):
    heads = 2
    y = torch.randn(2, *hw, 3 * heads * d + 40)  # a wider projection: the kernel reads a channel slice in place
    qkv = y[..., :3 * heads * d]
    with torch.inference_mode():
        out = kernels.window_attention(qkv, s, heads)
    assert out.shape == (2, *hw, heads * d) and out.is_contiguous()
    torch.testing.assert_close(out, _window_reference(qkv, s, heads), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("d", [16, 48, 64, 128])
@pytest.mark.parametrize("n", [1, 7, 63, 64, 65, 130])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)])
def test_causal_equals_sdpa(isa, d, n, heads):
    hq, hkv = heads
    B = 2
    q = torch.randn(B, n, hq * d).view(B, n, hq, d).transpose(1, 2)  # (B, N, heads, d) memory, as a projection's
    kv = torch.randn(B, n, 2 * hkv * d + 8)  # k and v: strided views of one wider projection
    k = kv[..., :hkv * d].view(B, n, hkv, d).transpose(1, 2)
    v = kv[..., hkv * d:2 * hkv * d].view(B, n, hkv, d).transpose(1, 2)
    with torch.inference_mode():
        out = kernels.causal_attention(q, k, v)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, ref, atol=3e-6, rtol=1e-5)
    assert out.transpose(1, 2).is_contiguous()  # (B, N, heads, d) memory, as SDPA's CPU output


def test_causal_scale_large_logits_and_longest_prompt(isa):
    q, k, v = torch.randn(1, 2, 100, 32) * 30, torch.randn(1, 2, 100, 32) * 30, torch.randn(1, 2, 100, 32)
    with torch.no_grad():
        for scale in (None, 1.0, 0.01):
            # logits in the thousands: fp32 rounding of near-tied ones moves the output of any implementation, so
            # the kernel is held to SDPA's own error against a float64 reference
            exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True, scale=scale)
            ours = (kernels.causal_attention(q, k, v, scale=scale) - exact).abs().max().item()
            sdpa = (F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale) - exact).abs().max().item()
            assert ours <= 2 * sdpa + 1e-5, (scale, ours, sdpa)
        n = kernels.CAUSAL_MAX_TOKENS
        q, k, v = (torch.randn(1, 1, n, 16) for _ in range(3))
        torch.testing.assert_close(kernels.causal_attention(q, k, v),
                                   F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=3e-6, rtol=1e-5)


@pytest.mark.parametrize("m", [1, 6, 97])  # one row; a register block; two row blocks of each path, ragged
@pytest.mark.parametrize("k", [1, 37, 2049])  # 2049: three K blocks of the product
@pytest.mark.parametrize("n", [1, 17, 64, 100])  # features ragged against the 16- and 32-feature panels
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_linear(isa, m, k, n, bias):
    x, w, b = torch.randn(m, k), torch.randn(n, k), torch.randn(n) if bias else None
    packed = kernels.pack_linear_weight(w)
    assert packed.shape == (-(-n // kernels._PANEL[kernels.isa_code()]), k, kernels._PANEL[kernels.isa_code()])
    with torch.no_grad():
        out = kernels.packed_linear(x, packed, n, b)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert out.shape == (m, n) and out.is_contiguous() and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=2e-6 * k, rtol=1e-5)  # fp32 sums of k products


@pytest.mark.parametrize("m", [1, 7, 97])
@pytest.mark.parametrize("h", [1, 8, 21, 64])  # hidden features ragged against the 8- and 16-feature half panels
@pytest.mark.parametrize("bias", [False, True])
def test_packed_swiglu_gate_equals_silu_of_the_linear(isa, m, h, bias):
    k = 40
    x, w, b = torch.randn(m, k), torch.randn(2 * h, k), torch.randn(2 * h) if bias else None
    x[0, :3] = torch.tensor([30.0, -30.0, 0.0])  # gates far out on both sides
    packed = kernels.pack_linear_weight(w, glu=True)
    with torch.no_grad():
        out = kernels.packed_linear(x, packed, h, b, glu=True)
    gate, value = F.linear(x.double(), w.double(), None if b is None else b.double()).chunk(2, -1)
    assert out.shape == (m, h) and out.is_contiguous()
    torch.testing.assert_close(out.double(), F.silu(gate) * value, atol=1e-4, rtol=1e-5)


def test_packed_linear_takes_batched_and_strided_inputs(isa):
    w, b = torch.randn(48, 64), torch.randn(48)
    packed = kernels.pack_linear_weight(w)
    big = torch.randn(3, 10, 64)
    with torch.no_grad():
        for x in (big, big[:, -1:], big[:, ::3], big.transpose(0, 1)):  # rows evenly strided, or not at all
            out = kernels.packed_linear(x, packed, 48, b)
            assert out.shape == (*x.shape[:-1], 48) and out.is_contiguous()
            torch.testing.assert_close(out, F.linear(x, w, b), atol=2e-5, rtol=1e-5)
        assert kernels.packed_linear(torch.randn(0, 64), packed, 48).shape == (0, 48)


def test_results_do_not_depend_on_threads(isa):
    q, k, v = torch.randn(4, 5, 50, 64), torch.randn(4, 5, 49, 64), torch.randn(4, 5, 49, 64)
    qkv = torch.randn(3, 14, 14, 3 * 2 * 64)
    x, w = torch.randn(200, 1500), kernels.pack_linear_weight(torch.randn(70, 1500))
    threads = torch.get_num_threads()
    try:
        with torch.no_grad():
            torch.set_num_threads(1)
            one = (kernels.lofi_attention(q, k, v), kernels.window_attention(qkv, 2, 2),
                   kernels.causal_attention(q, q, q), kernels.packed_linear(x, w, 70))
            torch.set_num_threads(max(2, threads))
            many = (kernels.lofi_attention(q, k, v), kernels.window_attention(qkv, 2, 2),
                    kernels.causal_attention(q, q, q), kernels.packed_linear(x, w, 70))
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, many):
        assert torch.equal(a, b)


def test_unsupported_input_is_a_clear_error(built):
    q, kv = torch.randn(1, 2, 8, 24), torch.randn(1, 2, 8, 24)
    with torch.no_grad():
        with pytest.raises(ValueError, match="head_dim a multiple of 16"):
            kernels.lofi_attention(q, kv, kv)
        with pytest.raises(ValueError, match="65 keys"):
            kernels.lofi_attention(torch.randn(1, 2, 8, 16), *[torch.randn(1, 2, 65, 16)] * 2)
        with pytest.raises(ValueError, match="fp32 CPU"):
            kernels.lofi_attention(*[torch.randn(1, 2, 8, 16, dtype=torch.float64)] * 3)
        with pytest.raises(ValueError, match="window 9"):
            kernels.window_attention(torch.randn(1, 9, 9, 3 * 16), 9, 1)
        with pytest.raises(ValueError, match="do not split"):
            kernels.window_attention(torch.randn(1, 4, 4, 50), 2, 1)
        with pytest.raises(ValueError, match="heads >= 1"):
            kernels.window_attention(torch.randn(1, 4, 4, 48), 2, 0)
        with pytest.raises(ValueError, match="4-D"):
            kernels.lofi_attention(*[torch.randn(2, 8, 16)] * 3)
        with pytest.raises(ValueError, match="head_dim a multiple of 16 up to 128"):
            kernels.causal_attention(*[torch.randn(1, 2, 8, 24)] * 3)
        with pytest.raises(ValueError, match="1025 tokens"):
            kernels.causal_attention(*[torch.randn(1, 1, 1025, 16)] * 3)
        with pytest.raises(ValueError, match="Hkv dividing"):
            kernels.causal_attention(torch.randn(1, 3, 8, 16), *[torch.randn(1, 2, 8, 16)] * 2)
        with pytest.raises(ValueError, match="one shape"):
            kernels.causal_attention(torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 9, 16))
        with pytest.raises(RuntimeError, match="isa must be"):  # the operator itself checks its path
            torch.ops.vitlab_kernels.lofi_attention(*[torch.randn(1, 2, 8, 16)] * 3, 0.25, 7)
        packed = kernels.pack_linear_weight(torch.randn(20, 8))
        with pytest.raises(ValueError, match="out_features 40"):  # a weight of another layer
            kernels.packed_linear(torch.randn(3, 8), packed, 40)
        with pytest.raises(ValueError, match=r"x \(3, 9\)"):
            kernels.packed_linear(torch.randn(3, 9), packed, 20)
        with pytest.raises(ValueError, match=r"bias must be \(20,\)"):
            kernels.packed_linear(torch.randn(3, 8), packed, 20, torch.randn(21))
        with pytest.raises(ValueError, match="contiguous last dimension"):
            kernels.packed_linear(torch.randn(8, 3).t(), packed, 20)
        with pytest.raises(ValueError, match="non-empty"):
            kernels.pack_linear_weight(torch.randn(0, 8))
        with pytest.raises(ValueError, match="out_features even"):
            kernels.pack_linear_weight(torch.randn(7, 8), glu=True)
        with pytest.raises(ValueError, match=r"out_features 20 \(glu\)"):  # packed without its gate
            kernels.packed_linear(torch.randn(3, 8), packed, 20, glu=True)
        other = 2 if kernels.isa_code() == 512 else 512  # the other path's panels are another width
        with pytest.raises(RuntimeError, match="packed must be"):
            torch.ops.vitlab_kernels.packed_linear(torch.randn(3, 8), packed, None, 20, other)
    with pytest.raises(ValueError, match="no autograd"):
        kernels.lofi_attention(*[torch.randn(1, 2, 8, 16, requires_grad=True)] * 3)
    assert kernels.lofi_supported(64, 49) and not kernels.lofi_supported(80, 49)
    assert kernels.window_supported(32, 8) and not kernels.window_supported(32, 9)
    assert kernels.causal_supported(128, 1024)
    assert not kernels.causal_supported(64, 1025) and not kernels.causal_supported(136, 8)


def test_cached_library_is_shared_and_atomic(built, monkeypatch):
    lib = kernels._library()
    # the library this process loaded was built under the cache dir in effect then (a test that ran earlier in
    # this worker may have pointed VITLAB_CACHE_DIR at its tmp dir): look it up under that one
    if lib.parent.name == "kernels":
        monkeypatch.setenv("VITLAB_CACHE_DIR", str(lib.parent.parent))
    else:
        monkeypatch.delenv("VITLAB_CACHE_DIR", raising=False)
    assert lib.parent == kernels._cache_dir() and lib.exists()
    assert lib.stat().st_mode & 0o777 == 0o755  # readable by the other users of a shared cache
    mtime = lib.stat().st_mtime_ns
    assert kernels._build(kernels._compiler(), load=False) == lib and lib.stat().st_mtime_ns == mtime  # found
    assert kernels._key(kernels._compiler()) in lib.name


@pytest.mark.slow
def test_concurrent_builds_into_an_empty_cache(tmp_path, built):
    """Two processes asking for the kernels at once (pytest-xdist): one builds, the other waits and loads."""
    code = "from vitlab.optimize import kernels; print(kernels.status(), kernels._library())"
    env = {**os.environ, "VITLAB_CACHE_DIR": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=900)[0].split() for p in procs]
    assert [o[0] for o in outs] == ["available"] * 2 and outs[0][1] == outs[1][1]
    assert [p.name for p in (tmp_path / "kernels").iterdir() if not p.name.endswith(".lock")] == [
        os.path.basename(outs[0][1])]  # no temporary folder left behind
    lib = tmp_path / "kernels" / os.path.basename(outs[0][1])
    lib.write_bytes(b"")  # a truncated cache entry: the loader rebuilds it
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout
    assert out.startswith("available") and lib.stat().st_size > 0


def test_aten_capability_picks_the_path(built):
    """ATEN_CPU_CAPABILITY=avx2 (the AVX2 emulation of the benchmarks) runs the AVX2 path, and it is correct."""
    code = ("import torch, torch.nn.functional as F; from vitlab.optimize import kernels;"
            " q = torch.randn(2, 3, 50, 64); k, v = torch.randn(2, 2, 3, 49, 64); o = kernels.lofi_attention(q, k, v);"
            " print(kernels.status(), kernels.isa(), kernels.isa_code(),"
            " float((o - F.scaled_dot_product_attention(q, k, v)).abs().max()))")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    status, isa, code_, diff = out.split()
    assert (status, isa, code_) == ("available", "AVX2", "2") and float(diff) < 2e-6


def test_compiler_command_may_carry_arguments(monkeypatch):
    monkeypatch.setenv("CXX", "env c++")  # like "ccache g++": a launcher in front of the compiler
    assert kernels._compiler()[-1] == "c++" and kernels._compiler()[0].endswith("env")
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    assert kernels._compiler() is None


def test_switched_off_by_environment():
    code = "from vitlab.optimize import kernels; print(kernels.available(), kernels.status())"
    env = {**os.environ, "VITLAB_CKERNELS": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False switched off by VITLAB_CKERNELS=0"


def test_missing_toolchain_is_a_reason_not_an_error(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    monkeypatch.delenv("VITLAB_CKERNELS", raising=False)
    if kernels.isa() is not None and sys.platform.startswith("linux"):
        assert kernels._unavailable_reason() == "no C++ compiler found (set CXX, or install g++)"


def test_unavailable_kernels_raise_with_the_reason(monkeypatch):
    monkeypatch.setattr(kernels, "_library", lambda: None)
    monkeypatch.setattr(kernels, "_reason", "no C++ compiler found (set CXX, or install g++)")
    assert not kernels.available() and kernels.status().startswith("no C++ compiler")
    with pytest.raises(RuntimeError, match="not available: no C\\+\\+ compiler"):
        kernels.window_attention(torch.randn(1, 2, 2, 48), 2, 1)


@pytest.mark.parametrize("bits", [0x7FC00000, 0x7FC00001, 0x7FC000FF, 0x7F800001, 0xFFC00000])  # payloads, signs
def test_nan_propagates_as_in_sdpa(isa, bits):
    nan = torch.tensor([bits], dtype=torch.int64).to(torch.int32).view(torch.float32)
    assert nan.isnan().all()
    q, k, v = torch.randn(1, 2, 5, 16), torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16)
    k[0, 1, 3, 0] = nan[0]  # head 1: every query row sees one NaN logit
    qkv = torch.randn(1, 2, 2, 3 * 16)
    qkv[0, 1, 1, 16] = nan[0]  # one key of the only window
    with torch.no_grad():
        out = kernels.lofi_attention(q, k, v)
        win = kernels.window_attention(qkv, 2, 1)
    assert out[0, 0].isfinite().all() and out[0, 1].isnan().all()
    assert win.isnan().all()


def test_outputs_are_cpu_fp32_whatever_the_defaults(built):
    q = torch.randn(1, 2, 5, 16)
    default = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        with torch.no_grad():
            out, win = kernels.lofi_attention(q, q, q), kernels.window_attention(torch.randn(1, 2, 2, 48).float(), 2, 1)
    finally:
        torch.set_default_dtype(default)
    assert out.dtype == win.dtype == torch.float32
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, q, q), atol=2e-6, rtol=1e-5)


def test_operators_trace_under_fake_tensors(built):
    """torch.compile sees the operators' output shapes and strides (registered fakes), as the real ones give."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k = torch.randn(2, 3, 50, 32), torch.randn(2, 3, 49, 32)
    qkv = torch.randn(2, 5, 7, 3 * 2 * 32)
    packed = kernels.pack_linear_weight(torch.randn(40, 32))
    with torch.no_grad():
        real = (kernels.lofi_attention(q, k, k), kernels.window_attention(qkv, 2, 2), kernels.causal_attention(q, q, q),
                kernels.packed_linear(q, packed, 40))
    with FakeTensorMode() as mode:
        fq, fk, fqkv, fp = (mode.from_tensor(t) for t in (q, k, qkv, packed))
        fake = (torch.ops.vitlab_kernels.lofi_attention(fq, fk, fk, 0.1, 2),
                torch.ops.vitlab_kernels.window_attention(fqkv, 2, 2, 0.1, 2),
                torch.ops.vitlab_kernels.causal_attention(fq, fq, fq, 0.1, 2),
                torch.ops.vitlab_kernels.packed_linear(fq, fp, None, 40, kernels.isa_code()))
    for r, f in zip(real, fake):
        assert r.shape == f.shape and r.stride() == f.stride()
