"""``vitlab.optimize.optimize(model, example_inputs=None, backend="auto")``: one explicit, measured step to a faster
inference model computing the same function.

Backends (each returns a model in eval mode whose outputs equal eager's within 1e-5 in fp32; on the CPU all of
them, on a GPU ``"none"``, ``"rewrite"`` and ``"compile"``):

* ``"none"``: ``eval()`` and the model's own ``fuse()`` where it has one (LeViT folds its BatchNorms). Plain
  eager PyTorch; nothing else about the model changes.
* ``"rewrite"``: the layer rewrites of :mod:`vitlab.optimize.rewrite` (class swaps, same function): a patch
  embedding's convolution as one GEMM; on the CPU, HiLo's Hi-Fi windows in fp32 for bf16 / fp16 inputs; CaiT's
  talking-heads attention folded into one fused attention call. Every backend below starts from them: from all
  of them when requested by name, from those that measured faster than eager (each alone) under ``"auto"``.
* ``"onednn"``: ``"rewrite"`` and module swaps (CPU): every ``nn.Linear`` becomes a
  :class:`~vitlab.optimize.onednn.OneDNNLinear` (same parameters and state dict) and an MLP's
  ``fc1 -> activation`` one oneDNN GEMM with the activation in its epilogue.
* ``"kernels"``: ``"onednn"`` plus vitlab's compiled HiLo kernels (:func:`vitlab.optimize.hilo.swap_hilo`), for
  models with HiLo attention, where the kernels build on this machine.
* ``"compile"``: ``torch.compile`` (Inductor) run under ``no_grad``; on the CPU with freezing (weights become
  constants, prepacked for MKL / oneDNN, BatchNorms folded) passed as a per-call option, so the global Inductor
  config is left as it was.
* ``"onednn+compile"`` (CPU): the ``"onednn"`` swaps, then ``"compile"``: Inductor fuses the graph around the
  linears, which stay oneDNN's GEMMs with their epilogues (one opaque op each) instead of Inductor's own GEMM
  choice (MKL's packed sgemm for fp32, slow on some CPUs, e.g. AMD's).
* ``"auto"`` (default): builds every applicable candidate, checks each against eager on ``example_inputs`` (max
  |diff| <= :data:`TOLERANCE` x the output's scale, for its dtype; a candidate that fails is rejected), times them
  in round robin on this machine and returns the fastest. ``"none"`` is always a candidate and another wins only
  when it is faster by ``margin``, so the result is never measurably slower than plain eager. The choice is cached
  in ``optimize.json`` under the user cache dir (``$VITLAB_CACHE_DIR``, else ``$XDG_CACHE_HOME/vitlab`` or
  ``~/.cache/vitlab``), written atomically and keyed by the model's class and parameter shapes, the shape of one
  input item (the batch size left out: one choice serves every batch) and its dtype, the device (CPU model, the
  ISA in use -- caps set in the environment included -- and thread count) and the torch version: a second call
  with the same key measures nothing.

  Tuning pays for itself or does not happen: building the candidates costs seconds (a ``torch.compile`` tens of
  seconds on a small CPU) and timing them dozens of calls, which a handful of images called once (``vitlab
  predict``) never wins back. So ``auto`` measures only an example of at least :data:`TUNE_MIN_BATCH` items
  whose eager call takes at least :data:`TUNE_MIN_SECONDS`; smaller work gets the fastest *cheap* backend
  (:data:`CHEAP`: module swaps, nothing compiled or built) by the cached timings of this model and item shape,
  or eager when none are cached. ``tune=True`` measures whatever the work, ``tune=False`` never does.

A Llama language model, or a vision-language model whose ``language_model`` is one, is compiled for generation
under ``"auto"`` (unless ``tune=False``) and ``"compile"`` (:func:`vitlab.optimize.llama.compile_language_model`:
prompts and decoding steps, weights frozen): its gain is per generated token, which one forward call does not
measure.

The returned model carries ``vitlab_backend`` (the backend used) and ``vitlab_optimize`` (an
:class:`OptimizeReport`: timings, cache hit, notes); :func:`explain` formats it. ``optimize`` never changes the
dtype: on a CPU without native bf16 it says so (a warning) when handed bf16 and never picks bf16 itself.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import math
import os
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from vitlab._io import atomic_write
from vitlab.optimize import cpu as cpuinfo
from vitlab.optimize.compiled import CompiledInference, compile_inference, share_copy
from vitlab.optimize.rewrite import REWRITES, rewrite

log = logging.getLogger("vitlab.optimize")

BACKENDS = ("none", "rewrite", "onednn", "kernels", "compile", "onednn+compile")
CHEAP = ("none", "rewrite", "onednn")  # built in milliseconds (module swaps): what auto uses when it does not measure
CACHE_VERSION = 3  # 2: keyed by the shape of one input item, not the batch's; 3: "none" is plain eager
# max |diff| from eager, as a fraction of the output's scale, by output dtype: rounding in fp32; a few units of
# the format's precision in bf16 (8 mantissa bits) and fp16 (11), where a rewrite may round differently
TOLERANCE = {torch.float64: 1e-5, torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}
TUNE_MIN_BATCH = 8  # fewer items is a one-off call (vitlab predict on a few images): never measured
TUNE_MIN_SECONDS = 0.05  # an eager call this short needs thousands of calls to win back a compile: not measured


@dataclasses.dataclass
class OptimizeReport:
    """What :func:`optimize` did: the backend used, and for ``auto`` the candidates' median seconds per call
    (``timings``), those rejected and why, whether the choice came from the cache, and notes."""

    backend: str
    requested: str
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    rejected: dict[str, str] = dataclasses.field(default_factory=dict)
    max_abs_diff: dict[str, float] = dataclasses.field(default_factory=dict)
    cached: bool = False
    rewrites: list[str] | None = None  # layer rewrites under the backend (None: all; auto: those measured faster)
    cache_file: str | None = None
    key: dict = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---- building each backend -----------------------------------------------------------------------------------
def _eval_fused(model: nn.Module) -> nn.Module:
    model.eval()
    fuse = getattr(model, "fuse", None)
    if callable(fuse) and not getattr(model, "fused", False):
        out = fuse()
        if isinstance(out, nn.Module):
            model = out
    return model.eval()


def _swap_onednn(model: nn.Module, notes: list[str]) -> int:
    from vitlab.optimize.onednn import onednn_linear_available, swap_linears

    if not onednn_linear_available():
        notes.append("onednn: oneDNN's fused linear is unavailable (torch without mkldnn, or VITLAB_ONEDNN=0)")
        return 0
    return swap_linears(model)


def _swap_kernels(model: nn.Module, notes: list[str]) -> int:
    """HiLo kernel swaps (from the kernels' own module, imported lazily); 0 when unavailable or no HiLo. The
    extension is built or loaded only for a model with a HiLo module to swap."""
    try:
        from vitlab.optimize import hilo, kernels
    except ImportError as e:  # not built into this checkout
        notes.append(f"kernels: unavailable ({e})")
        return 0
    if not hilo.hilo_modules(model):
        notes.append("kernels: no HiLo module to swap")
        return 0
    if not kernels.available():
        notes.append(f"kernels: unavailable ({kernels.status()})")
        return 0
    return int(hilo.swap_hilo(model))


def _compile(model: nn.Module, device: torch.device, options: dict | None = None) -> CompiledInference:
    if device.type == "cpu":
        cpuinfo.cpp_extension()  # imported quietly now, before Inductor's C++ build imports it and warns
        opts = {**cpuinfo.inductor_options(), **(options or {})}
        compiled = compile_inference(model, opts)
    else:
        compiled = compile_inference(model, options)
    return CompiledInference(model, compiled)


def _build(model: nn.Module, backend: str, device: torch.device, notes: list[str],
           explicit: bool = False, rewrites: Sequence[str] | None = None) -> nn.Module | None:
    """``model`` (already eval + fused) made into ``backend``, in place where it swaps modules, on top of the
    layer rewrites ``rewrites`` (names of :data:`~vitlab.optimize.rewrite.REWRITES`; None: all). None when the
    backend adds nothing here for ``auto`` (not this device; nothing to rewrite; no linear / no HiLo module to
    swap); an explicit request gets what applies (``"kernels"`` without HiLo is ``"onednn"``; off the CPU,
    eager)."""
    if backend == "none":
        return model
    rewritten = rewrite(model, device, rewrites)
    if backend == "rewrite":
        return model if rewritten or explicit else None
    if backend == "compile":
        return _compile(model, device)
    if device.type != "cpu":
        notes.append(f"{backend}: CPU only")
        return model if explicit else None
    if backend == "kernels" and not _swap_kernels(model, notes) and not explicit:
        return None  # checked first: no oneDNN swaps for a candidate that does not apply
    n = _swap_onednn(model, notes)
    if backend == "onednn":
        return model if n or explicit else None
    if backend == "onednn+compile":
        if not n and not explicit:
            return None
        from vitlab.optimize.onednn import OneDNNLinear

        for m in model.modules():
            if isinstance(m, OneDNNLinear):
                m.record_in_graph()
        return _compile(model, device)
    return model


# ---- inputs, checks, timing ----------------------------------------------------------------------------------
def default_input(model: nn.Module, batch_size: int = 1) -> torch.Tensor:
    """A random batch at the model's input size: ``patch_embed.img_size`` / ``img_size`` where the model has
    them, else its config's ``input_size``; on the model's device and dtype."""
    p = next(itertools.chain(model.parameters(), model.buffers()), None)
    device, dtype = (p.device, p.dtype) if p is not None else (torch.device("cpu"), torch.float32)
    if not dtype.is_floating_point:
        dtype = torch.float32
    cfg = getattr(model, "pretrained_cfg", None) or getattr(model, "default_cfg", None)
    size = getattr(cfg, "input_size", None) or (cfg.get("input_size") if isinstance(cfg, dict) else None)
    chans = size[0] if size else 3
    hw = None
    pe = getattr(model, "patch_embed", None)
    for src in (pe, model):
        img = getattr(src, "img_size", None) if src is not None else None
        if img is not None:
            hw = (img, img) if isinstance(img, int) else tuple(img)
            break
    if hw is None and size:
        hw = tuple(size[1:])
    proj = getattr(pe, "proj", None)
    if isinstance(proj, nn.Conv2d):
        chans = proj.in_channels
    if hw is None:
        raise ValueError("cannot tell this model's input size: pass example_inputs")
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch_size, chans, *hw, generator=g).to(device=device, dtype=dtype)


def _as_args(example_inputs) -> tuple:
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    return tuple(example_inputs)


def _leaves(out) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]


def max_abs_diff(out, ref) -> float:
    """Largest |out - ref| over the tensors of two outputs (inf when their structure or shapes differ)."""
    a, b = [t.detach() for t in _leaves(out)], [t.detach() for t in _leaves(ref)]
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        return math.inf
    return max((float((x.float() - y.float()).abs().max()) if x.numel() else 0.0 for x, y in zip(a, b)),
               default=0.0)


def _scale(ref) -> float:
    return max((float(t.detach().float().abs().max()) for t in _leaves(ref) if t.numel()), default=1.0)


def _tolerance(ref) -> float:
    """:data:`TOLERANCE` for the least precise floating dtype among the tensors of ``ref``."""
    return max((TOLERANCE.get(t.dtype, 1e-5) for t in _leaves(ref) if t.is_floating_point()), default=1e-5)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(candidates: dict[str, Callable[[], Any]], device: torch.device, warmup: int = 2,
            runs: int | None = None, budget_s: float = 4.0) -> dict[str, float]:
    """Median seconds per call of each candidate, timed in round robin (each run calls every candidate once,
    the order alternating) so that a shared machine's drift falls on all alike. ``runs`` defaults to what fits
    ``budget_s`` per candidate (3 to 15)."""
    with torch.no_grad():
        first = {}
        for name, fn in candidates.items():
            for _ in range(max(warmup, 1)):
                _sync(device)
                t0 = time.perf_counter()
                fn()
                _sync(device)
                first[name] = time.perf_counter() - t0
        if runs is None:
            slowest = max(first.values(), default=0.0)
            runs = int(min(15, max(3, budget_s / max(slowest, 1e-6))))
        times: dict[str, list[float]] = {n: [] for n in candidates}
        order = list(candidates.items())
        for i in range(runs):
            for name, fn in order if i % 2 == 0 else order[::-1]:
                _sync(device)
                t0 = time.perf_counter()
                fn()
                _sync(device)
                times[name].append(time.perf_counter() - t0)
    return {n: statistics.median(t) for n, t in times.items()}


# ---- the cache -----------------------------------------------------------------------------------------------
def cache_dir() -> Path:
    """``$VITLAB_CACHE_DIR``, else ``$XDG_CACHE_HOME/vitlab``, else ``~/.cache/vitlab``."""
    if os.environ.get("VITLAB_CACHE_DIR"):
        return Path(os.environ["VITLAB_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "vitlab"


def cache_file() -> Path:
    return cache_dir() / "optimize.json"


def _read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION or not isinstance(data.get("entries"),
                                                                                            dict):
        return {}
    return data["entries"]


def _write_cache(path: Path, entries: dict) -> None:
    """Write the cache atomically: a temporary file in the same folder, renamed over the old one."""
    atomic_write(path, (json.dumps({"version": CACHE_VERSION, "entries": entries}, indent=1, sort_keys=True)
                        + "\n").encode())


def model_fingerprint(model: nn.Module) -> str:
    """A hash of the model's architecture: module types and the names, shapes and dtypes of its parameters
    and buffers."""
    h = hashlib.sha256()
    for name, m in model.named_modules():
        h.update(f"{name}:{type(m).__module__}.{type(m).__qualname__};".encode())
    for name, t in itertools.chain(model.named_parameters(), model.named_buffers()):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
    return h.hexdigest()[:16]


def device_key(device: torch.device) -> dict:
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        return dict(device="cuda", gpu=torch.cuda.get_device_name(idx),
                    capability=list(torch.cuda.get_device_capability(idx)), cuda=torch.version.cuda)
    return dict(device=device.type, **cpuinfo.cpu_key())


def cache_key(model: nn.Module, args: Sequence, device: torch.device, candidates: Sequence[str]) -> dict:
    """What an ``auto`` choice depends on (see the module docstring): ``inputs`` holds each tensor's shape
    without its first (batch) dimension."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    return dict(model=f"{type(model).__module__}.{type(model).__qualname__}", arch=model_fingerprint(model),
                inputs=[list(t.shape[1:]) for t in tensors], dtype=[str(t.dtype) for t in tensors],
                torch=torch.__version__, candidates=sorted(candidates), **device_key(device))


def _key_id(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


# ---- the entry point -----------------------------------------------------------------------------------------
def _device_of(model: nn.Module, args: Sequence) -> torch.device:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device
    p = next(itertools.chain(model.parameters(), model.buffers()), None)
    return p.device if p is not None else torch.device("cpu")


def _candidates(device: torch.device) -> list[str]:
    return list(BACKENDS) if device.type == "cpu" else ["none", "rewrite", "compile"]


def _finish(model: nn.Module, report: OptimizeReport) -> nn.Module:
    if report.backend in ("onednn", "kernels", "onednn+compile"):
        model.requires_grad_(False)  # an inference model: the swapped kernels have no backward
    for obj in (model, getattr(model, "module", None)) if isinstance(model, CompiledInference) else (model,):
        object.__setattr__(obj, "vitlab_backend", report.backend)
        object.__setattr__(obj, "vitlab_optimize", report)
    log.info("vitlab.optimize: %s", explain(model))
    return model


def _items(args: Sequence) -> int:
    """The batch size of the example: the first dimension of its first tensor (1 for a 0-d tensor)."""
    t = next((a for a in args if isinstance(a, torch.Tensor)), None)
    return int(t.shape[0]) if t is not None and t.dim() else 1


def _fastest(timings: dict[str, float], margin: float) -> str:
    """The fastest of ``timings`` (which hold ``"none"``), kept only when it beats eager by ``margin``."""
    best = min(timings, key=timings.get)
    return best if best == "none" or timings[best] < timings["none"] * (1 - margin) else "none"


def _untuned(model: nn.Module, entry: dict | None, names: Sequence[str], device: torch.device, margin: float,
             report: OptimizeReport, why: str) -> nn.Module:
    """``auto`` without measuring: the fastest :data:`CHEAP` backend by the timings cached for this key
    (``entry``, measured on an earlier, larger example), else eager."""
    timings = {n: t for n, t in (entry or {}).get("timings", {}).items() if n in CHEAP and n in names}
    report.cached = "none" in timings  # every measurement times eager
    report.timings = timings if report.cached else {}
    report.cache_file = report.cache_file if report.cached else None
    best = _fastest(timings, margin) if report.cached else "none"
    report.rewrites = list((entry or {}).get("rewrites", []))
    built = _build(model, best, device, report.notes, rewrites=report.rewrites)
    if built is None:  # the cached choice no longer applies here (e.g. oneDNN switched off since)
        best, built = "none", model
    report.backend = best
    report.notes.append(f"not measured ({why}): " + ("the fastest cheap backend by the cached timings"
                                                     if report.cached else "eager"))
    return _finish(built, report)


def optimize(model: nn.Module, example_inputs: torch.Tensor | Sequence | None = None, backend: str = "auto", *,
             candidates: Sequence[str] | None = None, cache: bool = True, margin: float = 0.02,
             runs: int | None = None, tune: bool | None = None) -> nn.Module:
    """An inference model computing what ``model`` computes (eval mode; see the module docstring).

    ``example_inputs``: a tensor or a tuple of positional inputs like those the model will see (the choice of
    ``auto`` is measured on them and cached for the shape of one item); default: a batch of
    :data:`TUNE_MIN_BATCH` random images at the model's input size. ``backend``: ``"auto"`` or one of
    :data:`BACKENDS`. ``candidates`` restricts ``auto``'s choice; ``cache=False`` measures afresh and records
    nothing; a candidate must beat ``"none"`` by ``margin`` (fraction of its time) to be chosen. ``tune``
    (``auto``): None measures only work large enough to win the measuring back (see the module docstring),
    True measures whatever the work (a cached choice still counts), False never does (as for small work, only a
    cheap backend is built)."""
    if backend not in ("auto", *BACKENDS):
        raise ValueError(f"unknown backend {backend!r}; choose from {['auto', *BACKENDS]}")
    model = _eval_fused(model)
    args = _as_args(example_inputs) if example_inputs is not None else None
    device = _device_of(model, args or ())
    notes: list[str] = []
    dtypes = {a.dtype for a in (args or ()) if isinstance(a, torch.Tensor)} | {
        p.dtype for p in itertools.islice(model.parameters(), 1)}
    if device.type == "cpu" and torch.bfloat16 in dtypes and not cpuinfo.native_bf16():
        msg = cpuinfo.bf16_note() + "; optimize keeps the model's dtype (it never picks bf16 itself)"
        warnings.warn(msg, stacklevel=2)
        notes.append(msg)
    if backend in ("auto", "compile") and tune is not False:
        from vitlab.optimize.llama import compile_language_model

        # a language model's gain is in generate (prompt, then one token at a time), not in one forward: its own
        # compile (benchmarks/llama_generate.py measures it against transformers' generate). The caller's model is
        # not modified: a LLaVA-style model gives a copy sharing its weights, its language model compiled
        lm = compile_language_model(model)
        if lm is not None:
            notes.append("Llama language model: prefill and decoding step compiled with frozen weights "
                         "(vitlab.optimize.llama.compile_language_model)")
            return _finish(lm, OptimizeReport(backend="compile", requested=backend, notes=notes))
    if backend != "auto":
        built = _build(model, backend, device, notes, explicit=True)
        return _finish(built, OptimizeReport(backend=backend, requested=backend, notes=notes))

    if args is None:
        args = (default_input(model, TUNE_MIN_BATCH),)
    names = [c for c in (candidates or _candidates(device)) if c in _candidates(device)]
    if "none" not in names:
        names.insert(0, "none")
    key = cache_key(model, args, device, names)
    path = cache_file()
    entry = _read_cache(path).get(_key_id(key)) if cache else None
    items = _items(args)
    if tune is False or (tune is None and items < TUNE_MIN_BATCH):
        why = "tune=False" if tune is False else f"{items} input items, fewer than {TUNE_MIN_BATCH}"
        return _untuned(model, entry, names, device, margin, OptimizeReport(
            backend="none", requested="auto", key=key, notes=notes, cache_file=str(path)), why)
    if entry and entry.get("backend") in names:
        report = OptimizeReport(backend=entry["backend"], requested="auto", timings=entry.get("timings", {}),
                                rejected=entry.get("rejected", {}), cached=True, cache_file=str(path), key=key,
                                notes=notes, rewrites=list(entry.get("rewrites", [])))
        built = _build(model, report.backend, device, notes, rewrites=report.rewrites)
        if built is not None:
            return _finish(built, report)
        notes.append(f"cached choice {report.backend!r} no longer applies: measuring again")

    report = OptimizeReport(backend="none", requested="auto", key=key, notes=notes,
                            cache_file=str(path) if cache else None)
    with torch.no_grad():
        _sync(device)
        t0 = time.perf_counter()
        ref = model(*args)
        _sync(device)
        eager_s = time.perf_counter() - t0
    if tune is None and eager_s < TUNE_MIN_SECONDS:
        return _untuned(model, None, names, device, margin, report,
                        f"one eager call takes {eager_s * 1e3:.1f} ms, under {TUNE_MIN_SECONDS * 1e3:g} ms")
    scale, tol = max(1.0, _scale(ref)), _tolerance(ref)

    def check(name: str, rewrites: Sequence[str]) -> nn.Module | None:
        """The candidate ``name`` built on a copy and checked against eager; None (the reason recorded) if not."""
        try:
            cand = _build(share_copy(model), name, device, notes, rewrites=rewrites)
            if cand is None:
                report.rejected[name] = "does not apply"
                return None
            with torch.no_grad():
                diff = max_abs_diff(cand(*args), ref)
        except Exception as e:  # noqa: BLE001 -- a backend that fails to build or run is simply not chosen
            report.rejected[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            log.warning("vitlab.optimize: %s failed: %s", name, report.rejected[name])
            return None
        report.max_abs_diff[name] = diff
        if not diff <= tol * scale:
            report.rejected[name] = f"output differs from eager by {diff:.3g} (> {tol:g} x {scale:.3g})"
            return None
        return cand

    # First each layer rewrite on its own against eager (all eager PyTorch): the "rewrite" backend and every other
    # one build on those faster on this machine (e.g. oneDNN's patch convolution can beat the patch GEMM).
    alone = {}
    for kind in REWRITES:
        cand = check(f"rewrite:{kind}", (kind,))
        if cand is not None:
            alone[kind] = cand
        elif report.rejected.get(f"rewrite:{kind}") == "does not apply":  # nothing to rewrite: not worth a line
            del report.rejected[f"rewrite:{kind}"]
    first = measure({"none": lambda: model(*args), **{k: (lambda m=m: m(*args)) for k, m in alone.items()}},
                    device, warmup=1, runs=runs) if alone else {}
    report.rewrites = [k for k in alone if _fastest({"none": first["none"], k: first[k]}, margin) == k]
    if alone:
        notes.append("layer rewrites measured alone: " + ", ".join(
            f"{k} {first[k] * 1e3:.2f} ms ({'kept' if k in report.rewrites else 'left out'})" for k in alone)
            + f" against eager's {first['none'] * 1e3:.2f} ms")
    built: dict[str, nn.Module] = {"none": model}
    for name in names:
        if name == "rewrite" and not report.rewrites:
            report.rejected[name] = "no layer rewrite is faster than eager here" if alone else "does not apply"
        elif name != "none" and (cand := check(name, report.rewrites)) is not None:
            built[name] = cand
    # each candidate ran once in its check (compiled there): one more untimed call each is warm-up enough
    timings = measure({n: (lambda m=m: m(*args)) for n, m in built.items()}, device, warmup=1, runs=runs)
    report.timings = {n: round(t, 6) for n, t in timings.items()}
    best = report.backend = _fastest(timings, margin)
    if cache:
        try:
            entries = _read_cache(path)
            entries[_key_id(key)] = dict(backend=best, rewrites=report.rewrites, timings=report.timings,
                                         rejected=report.rejected, key=key,
                                         written=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
            _write_cache(path, entries)
        except OSError as e:
            notes.append(f"could not write the cache {path}: {e}")
    return _finish(built[best], report)


def explain(model_or_report: nn.Module | OptimizeReport) -> str:
    """One paragraph: what :func:`optimize` chose for this model and why (timings, rejections, cache)."""
    r = model_or_report if isinstance(model_or_report, OptimizeReport) else getattr(
        model_or_report, "vitlab_optimize", None)
    if r is None:
        return "not optimized by vitlab.optimize"
    parts = [f"backend {r.backend!r}" + (" (requested)" if r.requested != "auto" else "")]
    if r.timings:
        base = r.timings.get("none")
        parts.append("timings " + ", ".join(
            f"{n} {t * 1e3:.2f} ms" + (f" ({base / t:.2f}x eager)" if base and n != "none" else "")
            for n, t in sorted(r.timings.items(), key=lambda kv: kv[1])))
    if r.rejected:
        parts.append("rejected " + "; ".join(f"{n}: {why}" for n, why in r.rejected.items()))
    if r.cached:
        parts.append(f"cached choice from {r.cache_file}")
    if r.key:
        where = r.key.get("gpu") or f"{r.key.get('cpu')} {r.key.get('isa')}"
        parts.append(f"on {where}, inputs {r.key.get('inputs')} {r.key.get('dtype')}")
    parts.extend(n for n in r.notes if n)
    return "; ".join(parts)
