"""What this CPU can do, as the optimiser sees it: model name, the ISA ATen and oneDNN dispatch to, native bf16.

The ISA is what the libraries *use*, not only what the chip has: ``ATEN_CPU_CAPABILITY=avx2
ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2`` on an AVX-512 machine emulates an AVX2 machine, and
:func:`isa` then says ``AVX2`` (with the caps in its key) and :func:`native_bf16` False, so a cached choice
measured under one never serves the other.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import subprocess
import sys
import tempfile
import types

import torch

# the environment variables that cap the instruction set of ATen, oneDNN, MKL and Inductor's generated C++
ISA_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS",
           "TORCHINDUCTOR_CPP_MARCH")
# An AVX2 machine emulated on an AVX-512 one. Inductor builds its C++ with -march=native unless told otherwise,
# and its cache does not key on the caps: a graph compiled (weights prepacked) for AVX-512 and served under
# them computed NaN in every model we benchmarked, so the emulation also gets an Inductor cache of its own.
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
            "TORCHINDUCTOR_CPP_MARCH": "x86-64-v3"}
_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


# the -march of Inductor's C++ under an ATen cap below the machine's own ISA (x86): the psABI level of that cap
_CAP_MARCH = {"avx2": "x86-64-v3", "default": "x86-64"}


def inductor_options() -> dict:
    """``torch.compile`` options for CPU inference: freezing, and the SIMD width Inductor picks under this
    environment (it follows ``ATEN_CPU_CAPABILITY``) stated explicitly as ``cpp.simdlen``. Stated, it enters
    Inductor's cache key, which the environment does not: without it, a graph compiled under
    ``ATEN_CPU_CAPABILITY=avx2`` was served to a later native AVX-512 process (same cache directory), whose
    kernels then wrote past their buffers (glibc: "double free or corruption"; Swin-T, torch 2.14).

    Under ``ATEN_CPU_CAPABILITY=avx2`` (or ``default``) on x86, Inductor's C++ is also built for that level
    (``cpp.march``: ``x86-64-v3``, or ``x86-64``) instead of ``-march=native``, unless
    ``TORCHINDUCTOR_CPP_MARCH`` says otherwise. On an AVX-512 machine emulating an AVX2 one, native code let GCC
    vectorise the kernels' scalar loops with AVX-512: the cores then ran at AVX-512's lower clock, and the AVX2
    GEMMs around those kernels with them (the compiled ``llama_100m`` batch-8 prefill ran at 1.01x the eager
    one; built for ``x86-64-v3``, at 1.09-1.16x)."""
    import torch._inductor
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    options = {"freezing": True, "cpp.simdlen": pick_vec_isa().bit_width()}
    march = _CAP_MARCH.get(os.environ.get("ATEN_CPU_CAPABILITY", "").lower())
    # the option where this torch has it (torch.compile's documented list of Inductor options)
    if march and _x86() and not os.environ.get("TORCHINDUCTOR_CPP_MARCH") \
            and "cpp.march" in torch._inductor.list_options():
        options["cpp.march"] = march
    return options


def cpp_extension() -> types.ModuleType:
    """``torch.utils.cpp_extension``, imported without the warning it logs at import on a machine with a CUDA
    toolkit but no CUDA runtime ("No CUDA runtime is found, using CUDA_HOME=..."). The HiLo kernels build with it
    and Inductor imports it when it compiles C++: importing it here first keeps that line off the user's screen
    (it says nothing about the CPU paths vitlab builds)."""
    if "torch.utils.cpp_extension" not in sys.modules:
        logger = logging.getLogger("torch.utils.cpp_extension")
        level = logger.level
        logger.setLevel(logging.ERROR)
        try:
            import torch.utils.cpp_extension  # noqa: F401
        finally:
            logger.setLevel(level)
    return sys.modules["torch.utils.cpp_extension"]


_KEY_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16",
              "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve")


@functools.cache
def _cpuinfo() -> tuple[str, frozenset[str]]:
    model, flags = "", frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = frozenset(value.split())
                if model and flags:
                    break
    except OSError:
        pass
    return model or platform.processor() or platform.machine(), flags


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; ``platform.processor()`` elsewhere)."""
    return _cpuinfo()[0]


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (``/proc/cpuinfo``; empty where unknown)."""
    return _cpuinfo()[1]


def isa_caps() -> dict[str, str]:
    """The instruction-set caps set in the environment (``ATEN_CPU_CAPABILITY`` and friends)."""
    return {k: os.environ[k] for k in ISA_ENV if os.environ.get(k)}


def isa() -> str:
    """The vector ISA ATen dispatches to here (``torch.backends.cpu.get_cpu_capability()``: e.g. ``AVX512``,
    ``AVX2``, ``DEFAULT``), with a ``+caps`` note when oneDNN or MKL are capped below it by the environment."""
    cap = torch.backends.cpu.get_cpu_capability()
    caps = isa_caps()
    lib_caps = {k: v for k, v in caps.items() if k != "ATEN_CPU_CAPABILITY"}
    if lib_caps:
        cap += "+" + ",".join(f"{k}={v}" for k, v in sorted(lib_caps.items()))
    return cap


def rerun_under(isa: str) -> None:
    """For benchmark scripts: with ``isa="avx2"``, run this script again under :data:`AVX2_ENV` (the caps must be
    set before torch loads) and exit with its status; return at once when already under it or for ``native``."""
    if isa != "avx2" or all(os.environ.get(k) == v for k, v in AVX2_ENV.items()):
        return
    base = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(tempfile.gettempdir(),
                                                                     f"torchinductor_{os.getuid()}")
    cache = base + "_avx2"
    env = {**os.environ, **AVX2_ENV, "TORCHINDUCTOR_CACHE_DIR": cache}
    sys.exit(subprocess.call([sys.executable, *sys.argv], env=env))


def _x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def _capped_below_avx512() -> bool:
    """On x86: ATen runs below AVX-512, or oneDNN / MKL are capped below it by the environment."""
    if "AVX512" not in torch.backends.cpu.get_cpu_capability().upper():
        return True
    for k in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"):
        v = os.environ.get(k, "").lower()
        if v and not any(s in v for s in ("avx512", "amx", "all", "default")):
            return True
    return False


def native_bf16() -> bool:
    """Whether bf16 matmuls run natively here (x86: ``avx512_bf16`` or ``amx_bf16`` and not capped below
    AVX-512 by the environment; Arm: the ``bf16`` feature).

    Without it, bf16 on the CPU is emulated and several times slower than fp32: :func:`vitlab.optimize` never
    picks bf16 there, and ``vitlab bench`` says so."""
    flags = cpu_flags()
    if _x86():
        return any(f in flags for f in _BF16_FLAGS) and not _capped_below_avx512()
    return "bf16" in flags


def bf16_note() -> str | None:
    """A one-line warning when this CPU has no native bf16 (None when it has)."""
    if native_bf16():
        return None
    return (f"this CPU ({cpu_model()}, ISA {isa()}) has no native bf16 (avx512_bf16 / amx_bf16): bf16 is emulated "
            "and typically several times slower than fp32 here")


def cpu_key() -> dict:
    """What a measured choice depends on: CPU model, the ISA in use (with caps), key feature flags, threads."""
    flags = cpu_flags()
    return dict(cpu=cpu_model(), isa=isa(), flags=sorted(f for f in _KEY_FLAGS if f in flags),
                threads=torch.get_num_threads(), native_bf16=native_bf16())
