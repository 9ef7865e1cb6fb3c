"""Fused fp32 CPU attention kernels for HiLo (Pan et al., NeurIPS 2022), compiled from C on first use.

HiLo's two branches are attention shapes that PyTorch's CPU kernels serve poorly (``docs/benchmarks.md``,
batch 64, ViT-B's 14x14 map, 2-core AVX-512 machine):

* :func:`lofi_attention`: every query row attends to the same few keys (the 49 tokens of the pooled map).
  The flash kernel runs 64 x 49 x 64 GEMM calls at ~30 GMAC/s; this kernel keeps a block of query rows against
  all keys in registers: 21 ms instead of 34 ms.
* :func:`window_attention`: attention inside 2 x 2 windows. PyTorch needs a window-partition copy, one SDPA
  problem of 4 tokens per window and head (6,272 of them), and a window-reverse copy: 16 ms. This kernel reads
  the projected tokens in place and writes raster order: 3 ms.

Both compute what ``F.scaled_dot_product_attention`` computes (max |diff| ~2e-7 in fp32) and have no backward:
callers use them only for fp32 CPU inference (see :func:`vitlab.layers.linear.cpu_fp32_inference`).

Building. ``attention_cpu.c`` (GCC vector extensions and OpenMP) is compiled by GCC (``$CC`` when set, which
may carry arguments such as ``ccache gcc``, else ``gcc``, else ``cc``) with ``-O3 -march=native -fopenmp``
into a per-user cache (``$VITLAB_CACHE_DIR``, else ``$XDG_CACHE_HOME/vitlab`` or ``~/.cache/vitlab``). The
cache key covers the source, the flags, the compiler and the CPU's model and feature flags, so a home folder
shared by different machines never loads a build made for another CPU. The library is written under a
temporary name, made readable to all and renamed into place (concurrent processes race harmlessly); a cached
file that does not load is rebuilt once. It is loaded with ctypes and checked against SDPA on small problems
before its first use. It links the ``libgomp.so.1`` that PyTorch has already loaded, so the kernels run on
PyTorch's own worker threads.

:func:`available` is False (and callers keep PyTorch's kernels, the same function) on any system other than
Linux with PyTorch's OpenMP backend, without a C compiler with OpenMP, when the build or the check fails, and
when ``VITLAB_CKERNELS=0`` is set. :func:`status` says which.
"""

from __future__ import annotations

import ctypes
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

SOURCE = Path(__file__).with_name("attention_cpu.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-Wno-psabi")
MAX_HEAD_DIM = 64  # the kernels hold a head's row in at most four 16-float vectors
MAX_KEYS = 64  # Lo-Fi keys per (batch, head) item
MAX_WINDOW_TOKENS = 64  # tokens of one Hi-Fi window (s <= 8)

_L, _P, _I, _F = ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    # q, (qb, qh, qn), k, v, (kb, kh, kn), o, (ob, oh, on), B, H, N, M, D, scale, threads
    "lofi_attention": [_P, _L, _L, _L, _P, _P, _L, _L, _L, _P, _L, _L, _L, _I, _I, _I, _I, _I, _F, _I],
    # x, (xb, xr, xc), (qo, ko, vo), o, (ob, or, oc), B, H, W, s, heads, D, scale, threads
    "hifi_attention": [_P, _L, _L, _L, _L, _L, _L, _P, _L, _L, _L, _I, _I, _I, _I, _I, _I, _F, _I],
}
_reason = "not loaded yet"


def status() -> str:
    """Whether the kernels are used ("available") or why not; builds them on the first call."""
    return "available" if available() else _reason


def available() -> bool:
    """Whether the compiled kernels are loaded and checked (built on the first call; see the module docstring)."""
    return _library() is not None


def lofi_supported(head_dim: int, keys: int) -> bool:
    """Whether :func:`lofi_attention` takes heads of this width attending to this many keys."""
    return 0 < head_dim <= MAX_HEAD_DIM and head_dim % 16 == 0 and 0 < keys <= MAX_KEYS


def window_supported(head_dim: int, window: int) -> bool:
    """Whether :func:`window_attention` takes heads of this width and s x s windows of this size."""
    return 0 < head_dim <= MAX_HEAD_DIM and head_dim % 16 == 0 and 0 < window * window <= MAX_WINDOW_TOKENS


def lofi_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v)`` for fp32 CPU tensors: q (B, heads, N, D), k and v
    (B, heads, M, D), any strides with a contiguous last dimension (k and v must share theirs).

    Returns (B, heads, N, D) laid out as (B, N, heads, D), as PyTorch's CPU SDPA does, so that
    ``out.transpose(1, 2).reshape(B, N, heads * D)`` is free."""
    lib = _require()
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
    out = torch.empty(B, N, H, D, dtype=torch.float32, device="cpu").transpose(1, 2)
    scale = D**-0.5 if scale is None else scale
    rc = lib.lofi_attention(q.data_ptr(), *q.stride()[:3], k.data_ptr(), v.data_ptr(), *k.stride()[:3],
                            out.data_ptr(), *out.stride()[:3], B, H, N, M, D, scale, torch.get_num_threads())
    _raise_for(rc, "lofi_attention")
    return out


def window_attention(qkv: torch.Tensor, window: int, heads: int, scale: float | None = None) -> torch.Tensor:
    """Self-attention inside the non-overlapping ``window`` x ``window`` windows of an H x W map.

    ``qkv``: (B, H, W, 3 * heads * D) fp32 CPU tokens, q, k and v of each head in that channel order (any
    strides with contiguous channels, e.g. a channel slice of a larger projection). Windows cut by the bottom or
    right border hold only their real tokens, as padding the map and masking the padded keys would give.
    Returns (B, H, W, heads * D), contiguous, in raster order."""
    lib = _require()
    _check(qkv)
    if qkv.dim() != 4 or heads < 1:
        raise ValueError(f"window_attention takes a (B, H, W, 3 * heads * D) map and heads >= 1, got "
                         f"{tuple(qkv.shape)} and heads={heads}")
    B, H, W, C3 = qkv.shape
    if C3 % (3 * heads):
        raise ValueError(f"window_attention: {C3} channels do not split into q, k, v of {heads} heads")
    D = C3 // (3 * heads)
    if not window_supported(D, window):
        raise ValueError(f"window_attention takes head_dim a multiple of 16 up to {MAX_HEAD_DIM} and windows of at "
                         f"most {MAX_WINDOW_TOKENS} tokens, got head_dim {D} and window {window}")
    out = torch.empty(B, H, W, heads * D, dtype=torch.float32, device="cpu")
    scale = D**-0.5 if scale is None else scale
    hd = heads * D
    rc = lib.hifi_attention(qkv.data_ptr(), *qkv.stride()[:3], 0, hd, 2 * hd, out.data_ptr(), *out.stride()[:3],
                            B, H, W, window, heads, D, scale, torch.get_num_threads())
    _raise_for(rc, "window_attention")
    return out


def _check(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if (type(t) is not torch.Tensor or t.device.type != "cpu" or t.dtype != torch.float32 or t.stride(-1) != 1
                or t.requires_grad):
            raise ValueError(f"the CPU kernels take plain fp32 CPU tensors with a contiguous last dimension and no "
                             f"autograd, got {type(t).__name__} {t.dtype} on {t.device} with strides {t.stride()}")


def _raise_for(rc: int, name: str) -> None:
    if rc:
        raise RuntimeError(f"{name} failed ({'unsupported shape' if rc == 1 else 'out of memory'})")


def _require() -> ctypes.CDLL:
    lib = _library()
    if lib is None:
        raise RuntimeError(f"vitlab's CPU kernels are not available: {_reason}")
    return lib


def _cache_dir() -> Path:
    if os.environ.get("VITLAB_CACHE_DIR"):
        return Path(os.environ["VITLAB_CACHE_DIR"]) / "kernels"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "vitlab" / "kernels"


def _cpu_fingerprint() -> str:
    """The CPU's model and feature flags: a build with -march=native is only valid where they are the same."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    keep = [ln for ln in lines if ln.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(keep)))


def _compiler() -> list[str] | None:
    """The compiler command: ``$CC`` split like a shell would (``ccache gcc``), else gcc, else cc."""
    for cc in (os.environ.get("CC"), "gcc", "cc"):
        cmd = shlex.split(cc) if cc else []
        if cmd and shutil.which(cmd[0]):
            return [shutil.which(cmd[0]), *cmd[1:]]
    return None


def _build(cc: list[str], rebuild: bool = False) -> Path:
    """Compile the source into the cache (once per source, flags, compiler and CPU) and return the library."""
    version = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(FLAGS), " ".join(cc), version, _cpu_fingerprint(),
                                    platform.machine()]).encode()).hexdigest()[:16]
    lib = _cache_dir() / f"attention_cpu-{key}.so"
    if lib.exists() and not rebuild:
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=lib.parent, prefix=f".{lib.name}.", suffix=".tmp")
    os.close(fd)
    try:
        res = subprocess.run([*cc, *FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True, timeout=300)
        if res.returncode:
            last = (res.stderr or res.stdout).strip().splitlines()
            raise RuntimeError(f"{Path(cc[-1]).name} exited with {res.returncode}: {last[-1] if last else ''}")
        os.chmod(tmp, 0o755)  # mkstemp's 0600 would lock other users of a shared cache out
        os.replace(tmp, lib)  # atomic: a concurrent build of the same key writes the same bytes
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def _self_check(lib: ctypes.CDLL) -> str | None:
    """Compare both kernels with PyTorch on small problems that exercise padding and odd sizes; None when equal."""
    g = torch.Generator().manual_seed(0)
    cpu = dict(dtype=torch.float32, device="cpu")  # whatever the default dtype and device are
    threads = torch.get_num_threads()
    with torch.no_grad():
        q, k, v = (torch.randn(2, 3, n, 32, generator=g, **cpu) for n in (13, 21, 21))
        out = torch.empty(2, 13, 3, 32, **cpu).transpose(1, 2)
        rc = lib.lofi_attention(q.data_ptr(), *q.stride()[:3], k.data_ptr(), v.data_ptr(), *k.stride()[:3],
                                out.data_ptr(), *out.stride()[:3], 2, 3, 13, 21, 32, 32**-0.5, threads)
        if rc or not torch.allclose(out, F.scaled_dot_product_attention(q, k, v), atol=1e-5):
            return "lofi_attention disagrees with SDPA"
        qkv = torch.randn(1, 3, 5, 3 * 16, generator=g, **cpu)  # one head of 16 channels, windows cut at the border
        out = torch.empty(1, 3, 5, 16, **cpu)
        rc = lib.hifi_attention(qkv.data_ptr(), *qkv.stride()[:3], 0, 16, 32, out.data_ptr(), *out.stride()[:3],
                                1, 3, 5, 2, 1, 16, 0.25, threads)
        if rc:
            return "hifi_attention rejected a supported shape"
        for r in range(0, 3, 2):
            for c in range(0, 5, 2):
                win = qkv[0, r:r + 2, c:c + 2].reshape(-1, 3, 16)
                ref = F.scaled_dot_product_attention(win[:, 0], win[:, 1], win[:, 2])
                if not torch.allclose(out[0, r:r + 2, c:c + 2].reshape(-1, 16), ref, atol=1e-5):
                    return "hifi_attention disagrees with SDPA"
    return None


@functools.cache
def _library() -> ctypes.CDLL | None:
    global _reason
    if os.environ.get("VITLAB_CKERNELS", "1") == "0":
        _reason = "switched off by VITLAB_CKERNELS=0"
        return None
    if not sys.platform.startswith("linux") or "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        _reason = "needs Linux and PyTorch's OpenMP backend (the kernels share its libgomp threads)"
        return None
    cc = _compiler()
    if cc is None:
        _reason = "no C compiler found (set CC, or install gcc)"
        return None
    lib = None
    for rebuild in (False, True):  # a cached file that does not load (truncated, foreign) is rebuilt once
        try:
            lib = ctypes.CDLL(str(_build(cc, rebuild)))
            for name, argtypes in _SIGNATURES.items():
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = argtypes, ctypes.c_int
            break
        except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as e:
            _reason, lib = f"build or load failed: {e}", None
    if lib is None:
        return None
    bad = _self_check(lib)
    if bad:
        _reason = f"self-check failed: {bad}"
        return None
    _reason = "available"
    return lib
