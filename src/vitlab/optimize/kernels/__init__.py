"""Fused fp32 CPU kernels, built on first use by ``torch.utils.cpp_extension`` as PyTorch operators
(``torch.ops.vitlab_kernels``): HiLo's two attention cores (Pan et al., NeurIPS 2022), a decoder's causal prompt
attention, and a linear layer against a prepacked weight.

HiLo's two attention cores are shapes that PyTorch's CPU kernels serve poorly:

* :func:`lofi_attention`: every query row attends to the same few keys (the 49 tokens of the pooled map); SDPA
  runs them as many tiny GEMM calls, the kernel keeps a block of query rows against all keys in registers.
* :func:`window_attention`: attention inside s x s windows. PyTorch needs a window-partition copy, one SDPA
  problem of s*s tokens per window and head, and a window-reverse copy; the kernel reads the projected tokens
  in place and writes raster order.

A decoder's prompt is the third: :func:`causal_attention`, a prompt of a few hundred tokens attending causally, which
PyTorch's CPU flash kernel runs in small query blocks (32 rows at 128 tokens) through small GEMM calls and an
online softmax; the kernel keeps a block of query rows against every key it may see in registers and never
touches the keys above the diagonal (:mod:`vitlab.optimize.llama` uses it for a Llama's prefill).

All three compute what ``F.scaled_dot_product_attention`` computes (max |diff| ~1e-6 in fp32).

:func:`packed_linear` is ``F.linear`` against a weight packed once (:func:`pack_linear_weight`) into panels of
two vector widths of output features: the classic register-blocked outer-product GEMM (Goto & van de Geijn, 2008),
whose loop is bound by the FMA units; with ``glu=True`` a SwiGLU's gate is applied to the product in registers.
On AMD's Zen 4 it runs the large products of a decoder's prompt nearer the FMA peak than oneDNN's or MKL's GEMMs
under AVX2 (not under AVX-512, where oneDNN's lead), and the few-row products of its decoding steps faster than
both under either (``docs/benchmarks.md``); :func:`vitlab.optimize.llama.compile_llama` measures it against them
on the machine it runs on.

None has a backward: they are for fp32 CPU inference, applied from outside the models by
:func:`vitlab.optimize.hilo.swap_hilo` (``vitlab.optimize.optimize(model, backend="kernels")``) and
:func:`vitlab.optimize.llama.compile_llama`.

Instruction sets. ``ops.cpp`` compiles the kernel bodies (``simd.h``, ``hilo_body.h``, ``causal_body.h``,
``gemm_body.h``) twice, for AVX2 + FMA (8-float vectors, register blocks sized for 16 registers; what
``-mavx2 -mfma`` gives) and for AVX-512 (16-float vectors, 32 registers), and each call runs the path of ATen's
CPU capability (``torch.backends.cpu.get_cpu_capability()``): the CPU's best, or what ``ATEN_CPU_CAPABILITY=avx2``
asks, which measures the AVX2 path on an AVX-512 machine. :func:`isa` says which.

Building. ``torch.utils.cpp_extension.load`` (needs a C++ compiler with OpenMP and ninja) compiles the source
into a private temporary folder; the library is then renamed into the cache, atomically, under a name that
hashes the sources, the flags, the compiler and torch's version: ``$VITLAB_CACHE_DIR/kernels`` when set, else
torch's extension folder (``$TORCH_EXTENSIONS_DIR/vitlab``, default ``~/.cache/torch_extensions/vitlab``). An
exclusive ``flock`` on a lock file next to it makes concurrent processes (pytest-xdist workers) build once and
the others wait and load it; a lock never outlives its process. A cached file that does not load is rebuilt
once. The operators are checked against SDPA and ``F.linear`` on small problems before their first use.

:func:`available` is False (and :func:`~vitlab.optimize.hilo.swap_hilo` swaps nothing) on anything but x86-64
Linux with PyTorch's OpenMP backend and an AVX2 or AVX-512 ATen capability, without a C++ compiler or ninja,
when the build or the self-check fails, and when ``VITLAB_CKERNELS=0`` is set. :func:`status` says which.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from vitlab.optimize.cpu import cpp_extension

SOURCES = tuple(Path(__file__).with_name(n)
                for n in ("ops.cpp", "simd.h", "hilo_body.h", "causal_body.h", "gemm_body.h"))
CFLAGS = ("-O3", "-fopenmp", "-Wno-psabi")  # no -march: each ISA region has its own `#pragma GCC target`
LDFLAGS = ("-fopenmp",)
MAX_HEAD_DIM = 64  # the kernels hold a head's row in registers
MAX_KEYS = 64  # Lo-Fi keys per (batch, head) item
MAX_WINDOW_TOKENS = 64  # tokens of one Hi-Fi window (s <= 8)
CAUSAL_MAX_HEAD_DIM = 128  # the causal kernel's head widths: multiples of 16 up to this
CAUSAL_MAX_TOKENS = 1024  # longer prompts: the flash kernel, whose key blocks suit them better (causal_body.h)
_ISA_CODES = {"AVX512": 512, "AVX2": 2}
_PANEL = {512: 32, 2: 16}  # packed_linear's output features per weight panel: two vector widths
_ISA_CODE = 0  # set when the operators load
_reason = "not loaded yet"


def status() -> str:
    """Whether the kernels are used ("available") or why not; builds them on the first call."""
    return "available" if available() else _reason


def available() -> bool:
    """Whether the operators are built, loaded and checked (built on the first call; see the module docstring)."""
    return _library() is not None


def isa() -> str | None:
    """The instruction set the kernels run ("AVX512" or "AVX2", ATen's CPU capability), None where neither."""
    cap = torch.backends.cpu.get_cpu_capability()
    return cap if cap in _ISA_CODES else None


def isa_code() -> int:
    """The ``isa`` argument of the operators: 512 (AVX-512) or 2 (AVX2), fixed for the process."""
    return _ISA_CODE


def lofi_supported(head_dim: int, keys: int) -> bool:
    """Whether :func:`lofi_attention` takes heads of this width attending to this many keys."""
    return 0 < head_dim <= MAX_HEAD_DIM and head_dim % 16 == 0 and 0 < keys <= MAX_KEYS


def window_supported(head_dim: int, window: int) -> bool:
    """Whether :func:`window_attention` takes heads of this width and s x s windows of this size."""
    return 0 < head_dim <= MAX_HEAD_DIM and head_dim % 16 == 0 and 0 < window * window <= MAX_WINDOW_TOKENS


def causal_supported(head_dim: int, tokens: int) -> bool:
    """Whether :func:`causal_attention` takes heads of this width over a prompt of this many tokens."""
    return 0 < head_dim <= CAUSAL_MAX_HEAD_DIM and head_dim % 16 == 0 and 0 < tokens <= CAUSAL_MAX_TOKENS


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)`` for fp32 CPU tensors: q
    (B, Hq, N, D), k and v (B, Hkv, N, D) with Hq a multiple of Hkv (query head h reads key and value head
    h // (Hq // Hkv)), any strides with a contiguous last dimension. Query i attends to keys 0 .. i: a prompt
    written from position 0.

    Returns (B, Hq, N, D) laid out as (B, N, Hq, D), as PyTorch's CPU SDPA does."""
    _require()
    _check(q, k, v)
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"causal_attention takes 4-D (B, heads, tokens, D) tensors, k and v of one shape, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)} and {tuple(v.shape)}")
    B, H, N, D = q.shape
    if k.shape[0] != B or k.shape[2:] != (N, D) or k.shape[1] < 1 or H % k.shape[1]:
        raise ValueError(f"causal_attention: k and v must be (B, Hkv, N, D) with B, N, D of q {tuple(q.shape)} and "
                         f"Hkv dividing its heads, got {tuple(k.shape)}")
    if not causal_supported(D, N):
        raise ValueError(f"causal_attention takes head_dim a multiple of 16 up to {CAUSAL_MAX_HEAD_DIM} and 1 to "
                         f"{CAUSAL_MAX_TOKENS} tokens, got head_dim {D} and {N} tokens")
    scale = D**-0.5 if scale is None else scale
    return torch.ops.vitlab_kernels.causal_attention(q, k, v, scale, _ISA_CODE)


def lofi_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v)`` for fp32 CPU tensors: q (B, heads, N, D), k and v
    (B, heads, M, D), any strides with a contiguous last dimension (k and v must share theirs).

    Returns (B, heads, N, D) laid out as (B, N, heads, D), as PyTorch's CPU SDPA does, so that
    ``out.transpose(1, 2).reshape(B, N, heads * D)`` is free."""
    _require()
    _check(q, k, v)
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"lofi_attention takes 4-D (B, heads, tokens, D) tensors, got {tuple(q.shape)} and "
                         f"{tuple(k.shape)}")
    B, H, N, D = q.shape
    M = k.shape[2]
    if k.shape != (B, H, M, D) or v.shape != k.shape or k.stride() != v.stride():
        raise ValueError(f"k and v must be (B, heads, M, D) = {(B, H, M, D)} with equal strides, got "
                         f"{tuple(k.shape)} {k.stride()} and {tuple(v.shape)} {v.stride()}")
    if not lofi_supported(D, M):
        raise ValueError(f"lofi_attention takes head_dim a multiple of 16 up to {MAX_HEAD_DIM} and 1 to {MAX_KEYS} "
                         f"keys, got head_dim {D} and {M} keys")
    scale = D**-0.5 if scale is None else scale
    return torch.ops.vitlab_kernels.lofi_attention(q, k, v, scale, _ISA_CODE)


def window_attention(qkv: torch.Tensor, window: int, heads: int, scale: float | None = None) -> torch.Tensor:
    """Self-attention inside the non-overlapping ``window`` x ``window`` windows of an H x W map.

    ``qkv``: (B, H, W, 3 * heads * D) fp32 CPU tokens, q, k and v of each head in that channel order (any
    strides with contiguous channels, e.g. a channel slice of a larger projection). Windows cut by the bottom or
    right border hold only their real tokens, as padding the map and masking the padded keys would give.
    Returns (B, H, W, heads * D), contiguous, in raster order."""
    _require()
    _check(qkv)
    if qkv.dim() != 4 or heads < 1:
        raise ValueError(f"window_attention takes a (B, H, W, 3 * heads * D) map and heads >= 1, got "
                         f"{tuple(qkv.shape)} and heads={heads}")
    C3 = qkv.shape[-1]
    if C3 % (3 * heads):
        raise ValueError(f"window_attention: {C3} channels do not split into q, k, v of {heads} heads")
    D = C3 // (3 * heads)
    if not window_supported(D, window):
        raise ValueError(f"window_attention takes head_dim a multiple of 16 up to {MAX_HEAD_DIM} and windows of at "
                         f"most {MAX_WINDOW_TOKENS} tokens, got head_dim {D} and window {window}")
    scale = D**-0.5 if scale is None else scale
    return torch.ops.vitlab_kernels.window_attention(qkv, window, heads, scale, _ISA_CODE)


def pack_linear_weight(weight: torch.Tensor, glu: bool = False) -> torch.Tensor:
    """``weight`` (out_features, in_features), an fp32 CPU linear layer's, laid out for :func:`packed_linear` on
    this process's instruction set: panels of 16 (AVX2) or 32 (AVX-512) output features, each (in_features, 16 or
    32) with the features innermost, zero past the last feature; (ceil(out / panel), in, panel), a copy.

    ``glu``: ``weight`` is a SwiGLU's first layer, its gate's h rows over its value's h (``SwiGLU.fc1``); each
    panel then holds half a panel of gate features beside the same value features, (ceil(h / (panel / 2)), in,
    panel), for ``packed_linear(..., glu=True)``."""
    _require()
    _check(weight)
    if weight.dim() != 2 or 0 in weight.shape or (glu and weight.shape[0] % 2):
        raise ValueError(f"pack_linear_weight takes a non-empty (out_features, in_features) matrix"
                         f"{', out_features even (gate and value rows)' if glu else ''}, got {tuple(weight.shape)}")
    return _pack(weight, glu)


def _pack(weight: torch.Tensor, glu: bool = False) -> torch.Tensor:
    nr = _PANEL[_ISA_CODE]
    n, k = weight.shape
    if glu:  # (2, h, k) -> per panel: nr / 2 gate rows, then the same value rows
        half = nr // 2
        rows = F.pad(weight.view(2, n // 2, k), (0, 0, 0, -(n // 2) % half))
        weight = rows.view(2, -1, half, k).transpose(0, 1).reshape(-1, k)  # whole panels
    return F.pad(weight, (0, 0, 0, -weight.shape[0] % nr)).view(-1, nr, k).transpose(1, 2).contiguous()


def packed_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None,
                  glu: bool = False) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for fp32 CPU tensors, ``packed = pack_linear_weight(weight)``: x (..., in)
    with a contiguous last dimension; returns (..., out_features), contiguous. Register blocks of x's rows
    against the weight's panels, the weight's loads contiguous; on AVX2 it runs nearer the CPU's FMA peak than
    oneDNN's or MKL's GEMMs at a few hundred rows or more (``benchmarks/llama_generate.py``), which is where
    :func:`vitlab.optimize.llama.compile_llama` uses it when measured faster.

    ``glu``: a SwiGLU's first layer and its gate, ``packed = pack_linear_weight(fc1.weight, glu=True)``: returns
    ``silu(gate) * value`` (..., out_features = h) for ``gate, value = F.linear(x, fc1.weight, bias).chunk(2, -1)``,
    the 2h pre-activations never written to memory."""
    _require()
    _check(x, packed, *(() if bias is None else (bias,)))
    nr = _PANEL[_ISA_CODE]
    width = nr // 2 if glu else nr
    if (x.dim() < 1 or packed.dim() != 3 or packed.shape[2] != nr or packed.shape[1] != x.shape[-1]
            or out_features < 1 or packed.shape[0] != -(-out_features // width)):
        raise ValueError(f"packed_linear: packed must be pack_linear_weight's (ceil(out / {width}), in, {nr}) for x "
                         f"(..., in) and out_features {out_features}{' (glu)' if glu else ''}, got "
                         f"{tuple(packed.shape)} and x {tuple(x.shape)}")
    if bias is not None and bias.shape != ((2 if glu else 1) * out_features,):
        raise ValueError(f"packed_linear: bias must be ({(2 if glu else 1) * out_features},), got "
                         f"{tuple(bias.shape)}")
    return torch.ops.vitlab_kernels.packed_linear(x, packed.contiguous(), bias, out_features, _ISA_CODE, glu)


def _check(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if (t.device.type != "cpu" or t.dtype != torch.float32 or t.stride(-1) != 1 or t.requires_grad):
            raise ValueError(f"the CPU kernels take plain fp32 CPU tensors with a contiguous last dimension and no "
                             f"autograd, got {type(t).__name__} {t.dtype} on {t.device} with strides {t.stride()}")


def _require() -> None:
    if _library() is None:
        raise RuntimeError(f"vitlab's CPU kernels are not available: {_reason}")


def _cache_dir() -> Path:
    if os.environ.get("VITLAB_CACHE_DIR"):
        return Path(os.environ["VITLAB_CACHE_DIR"]) / "kernels"
    return Path(cpp_extension().get_default_build_root()) / "vitlab"


def _compiler() -> list[str] | None:
    """The C++ compiler command torch's cpp_extension runs: ``$CXX`` (may carry a launcher such as ``ccache``),
    else ``c++``; None when it is not found."""
    cmd = shlex.split(os.environ.get("CXX") or "c++")
    return [shutil.which(cmd[0]), *cmd[1:]] if cmd and shutil.which(cmd[0]) else None


def _key(cxx: list[str]) -> str:
    version = subprocess.run([*cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    parts = [p.read_text() for p in SOURCES] + [" ".join(CFLAGS + LDFLAGS), " ".join(cxx), version,
                                                torch.__version__, sys.version.split()[0], platform.machine()]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _build(cxx: list[str], rebuild: bool = False, load: bool = True) -> Path:
    """The cached library (built once per key; see the module docstring). With ``load`` the operators are
    registered in this process (once a process: a second library of the namespace would clash)."""
    name = f"vitlab_kernels_{_key(cxx)}"
    root = _cache_dir()
    lib = root / f"{name}.so"
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when this process closes it or dies: never stale
        if lib.exists() and not rebuild:
            if load:
                torch.ops.load_library(str(lib))
            return lib
        with tempfile.TemporaryDirectory(dir=root, prefix=f".{name}.") as tmp:
            if load:
                cpp_extension().load(name=name, sources=[str(SOURCES[0])], extra_cflags=list(CFLAGS),
                                   extra_ldflags=list(LDFLAGS), build_directory=tmp, is_python_module=False,
                                   verbose=False)
            else:
                _compile_only(name, tmp)
            built = Path(tmp) / f"{name}.so"
            os.chmod(built, 0o755)  # readable by the other users of a shared cache
            os.replace(built, lib)  # atomic; the loaded library stays mapped
    return lib


def _compile_only(name: str, build_dir: str) -> None:
    """Build without loading (the namespace may already be registered in this process): in a child process."""
    code = ("import sys, torch.utils.cpp_extension as c; c.load(name=sys.argv[1], sources=[sys.argv[2]], "
            f"extra_cflags={list(CFLAGS)!r}, extra_ldflags={list(LDFLAGS)!r}, build_directory=sys.argv[3], "
            "is_python_module=False, verbose=False)")
    res = subprocess.run([sys.executable, "-c", code, name, str(SOURCES[0]), build_dir], capture_output=True,
                         text=True, timeout=900)
    if res.returncode:
        raise RuntimeError((res.stderr or res.stdout).strip().splitlines()[-1])


def _self_check() -> str | None:
    """Compare the kernels with PyTorch on small problems that exercise padding and odd sizes; None when equal."""
    g = torch.Generator().manual_seed(0)
    cpu = dict(dtype=torch.float32, device="cpu")  # whatever the default dtype and device are
    code = _ISA_CODES[isa()]
    with torch.no_grad():
        q, k, v = (torch.randn(2, 3, n, 32, generator=g, **cpu) for n in (13, 21, 21))
        out = torch.ops.vitlab_kernels.lofi_attention(q, k, v, 32**-0.5, code)
        if not torch.allclose(out, F.scaled_dot_product_attention(q, k, v), atol=1e-5):
            return "lofi_attention disagrees with SDPA"
        qkv = torch.randn(1, 3, 5, 3 * 16, generator=g, **cpu)  # one head of 16 channels, windows cut at the border
        out = torch.ops.vitlab_kernels.window_attention(qkv, 2, 1, 0.25, code)
        for r in range(0, 3, 2):
            for c in range(0, 5, 2):
                win = qkv[0, r:r + 2, c:c + 2].reshape(-1, 3, 16)
                ref = F.scaled_dot_product_attention(win[:, 0], win[:, 1], win[:, 2], scale=0.25)
                if not torch.allclose(out[0, r:r + 2, c:c + 2].reshape(-1, 16), ref, atol=1e-5):
                    return "window_attention disagrees with SDPA"
        q, k, v = (torch.randn(2, h, 70, 32, generator=g, **cpu) for h in (4, 2, 2))  # two chunks, grouped heads
        out = torch.ops.vitlab_kernels.causal_attention(q, k, v, 32**-0.5, code)
        if not torch.allclose(out, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                              atol=1e-5):
            return "causal_attention disagrees with SDPA"
        x, w, b = (torch.randn(*shape, generator=g, **cpu) for shape in ((2, 9, 37), (21, 37), (21,)))
        out = torch.ops.vitlab_kernels.packed_linear(x, _pack(w), b, 21, code)
        if not torch.allclose(out, F.linear(x, w, b), atol=1e-4):  # ragged rows and features, a bias
            return "packed_linear disagrees with F.linear"
        w, b = w[:20], b[:20]  # a SwiGLU's 10 gate and 10 value features
        out = torch.ops.vitlab_kernels.packed_linear(x, _pack(w, True), b, 10, code, True)
        gate, value = F.linear(x, w, b).chunk(2, -1)
        if not torch.allclose(out, F.silu(gate) * value, atol=1e-4):
            return "packed_linear's SwiGLU gate disagrees with F.silu"
    return None


def _register_fakes() -> None:
    """Shapes for torch.compile / FakeTensor tracing (the operators stay opaque calls in a compiled graph)."""

    @torch.library.register_fake("vitlab_kernels::lofi_attention")
    def _(q, k, v, scale, isa):
        B, H, N, D = q.shape
        return q.new_empty(B, N, H, D).transpose(1, 2)

    @torch.library.register_fake("vitlab_kernels::causal_attention")
    def _(q, k, v, scale, isa):
        B, H, N, D = q.shape
        return q.new_empty(B, N, H, D).transpose(1, 2)

    @torch.library.register_fake("vitlab_kernels::packed_linear")
    def _(x, packed, bias, out_features, isa, glu=False):
        return x.new_empty(*x.shape[:-1], out_features)

    @torch.library.register_fake("vitlab_kernels::window_attention")
    def _(qkv, window, heads, scale, isa):
        B, H, W, C3 = qkv.shape
        return qkv.new_empty(B, H, W, C3 // 3)


def _unavailable_reason() -> str | None:
    if os.environ.get("VITLAB_CKERNELS", "1") == "0":
        return "switched off by VITLAB_CKERNELS=0"
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "AMD64"):
        return f"needs x86-64 Linux, this is {sys.platform} {platform.machine()}"
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return "needs PyTorch's OpenMP backend (the kernels share its libgomp threads)"
    if isa() is None:
        return f"needs AVX2 or AVX-512; ATen's CPU capability is {torch.backends.cpu.get_cpu_capability()}"
    if _compiler() is None:
        return "no C++ compiler found (set CXX, or install g++)"
    if not cpp_extension().is_ninja_available():
        return "torch.utils.cpp_extension needs ninja (pip install ninja)"
    return None


@functools.cache
def _library() -> Path | None:
    global _reason, _ISA_CODE
    _reason = _unavailable_reason() or "available"
    if _reason != "available":
        return None
    lib = None
    for rebuild in (False, True):  # a cached file that does not load (truncated, foreign) is rebuilt once
        try:
            lib = _build(_compiler(), rebuild)
            break
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            last = str(e).strip().splitlines()
            _reason, lib = f"build or load failed: {last[-1] if last else type(e).__name__}", None
    if lib is None:
        return None
    _register_fakes()
    _ISA_CODE = _ISA_CODES[isa()]
    bad = _self_check()
    if bad:
        _reason = f"self-check failed: {bad}"
        return None
    _reason = "available"
    return lib
