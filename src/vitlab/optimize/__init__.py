"""Inference-only speed-ups applied from outside the models, chosen by measurement on the machine at hand.

::

    from vitlab.optimize import explain, optimize
    fast = optimize(model, example_batch)            # backend="auto": measured once, cached per machine
    explain(fast)                                    # what it picked and why
    optimize(model, backend="compile")               # or "none", "onednn", "kernels"

Submodules: :mod:`~vitlab.optimize.onednn` (oneDNN linear swaps), :mod:`~vitlab.optimize.cpu` (CPU model, ISA,
native bf16), ``kernels`` / ``hilo`` (vitlab's compiled HiLo kernels). See :mod:`vitlab.optimize._core` for the
backends and the cache.
"""

from __future__ import annotations

from vitlab.optimize._core import (
    BACKENDS,
    OptimizeReport,
    cache_dir,
    cache_file,
    cache_key,
    default_input,
    explain,
    max_abs_diff,
    measure,
    optimize,
)
from vitlab.optimize.compiled import CompiledInference, compile_inference
from vitlab.optimize.cpu import bf16_note, cpu_model, isa, native_bf16

__all__ = ["BACKENDS", "CompiledInference", "OptimizeReport", "bf16_note", "cache_dir", "cache_file", "cache_key",
           "compile_inference", "cpu_model", "default_input", "explain", "isa", "max_abs_diff", "measure",
           "native_bf16", "optimize"]

