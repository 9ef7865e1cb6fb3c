"""``vitlab bench models``: whole-model throughput, memory and utilisation, optionally against timm.

For each model: images/s, step time, peak memory (CUDA), params, GMACs (one multiply-add = 1), achieved
TFLOP/s (2 FLOPs per MAC; a training step counts 3x the forward) and utilisation against a matrix-product
peak measured in the same run.

Our side runs through ``vitlab.optimize`` for inference by default (``optimize=False``: plain eager; the
backend used is in each row). ``compare`` names the peers, built from timm with the same weights and timed in
round robin with ours in the same process: ``"timm"`` (timm eager) and ``"timm-compile"`` (timm +
``torch.compile``, Inductor; on the CPU with freezing for inference -- the strongest peer a CPU user picks;
on a GPU, run it with ``dtype="bf16"`` for the compile + bf16 peer). ``ratio_vs_timm`` /
``ratio_vs_timm_compile`` are the medians of the per-run paired ratios (our throughput / the peer's: > 1
means we are faster), ``ratio_spread_*`` their (min, max).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable
from contextlib import nullcontext

import torch
import torch.nn as nn

from vitlab import _io
from vitlab._console import clock, console, say
from vitlab.bench.timing import matmul_peak_tflops
from vitlab.convert import load_state_dict
from vitlab.profile import profile_model
from vitlab.registry import create_model, get_model_config, list_models
from vitlab.timing import check_counts, paired_ratio, round_robin_times

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MODES = ("infer", "train")
PEERS = ("timm", "timm-compile")


def _peers(compare: str | Iterable[str] | None) -> tuple[str, ...]:
    if compare is None:
        return ()
    names = [c.strip() for c in compare.split(",")] if isinstance(compare, str) else list(compare)
    names = [n for n in names if n]
    bad = [n for n in names if n not in PEERS]
    if bad:
        raise ValueError(f"compare must name peers from {list(PEERS)}, got {bad}")
    return tuple(n for n in PEERS if n in names)


def _timm_twin(name: str, ours: nn.Module) -> nn.Module | None:
    """timm's model of the same name carrying our weights, or None when timm lacks it."""
    try:
        import timm
    except ImportError:
        return None
    if name not in timm.list_models():
        return None
    num_classes = ours.num_classes
    twin = timm.create_model(name, pretrained=False, num_classes=num_classes)
    twin.load_state_dict(ours.state_dict(), strict=False)
    # round-trip check: the twin computes our function (its own key names are what we load from)
    load_state_dict(ours, twin.state_dict())
    return twin


def _step_fn(model: nn.Module, x: torch.Tensor, mode: str, dtype: torch.dtype):
    device = x.device
    autocast = (torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else nullcontext())
    if mode == "infer":
        model.eval()

        def step():
            with torch.inference_mode(), autocast:
                model(x)
    else:
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=0.0)

        def step():
            with autocast:
                out = model(x)
            loss = sum(o.float().mean() for o in (out if isinstance(out, tuple) else (out,)))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return step


def _peak_mem_mb(step, dev: torch.device) -> float | None:
    """Peak CUDA memory of one step of this implementation alone (None on the CPU)."""
    if dev.type != "cuda":
        return None
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    step()
    torch.cuda.synchronize(dev)
    return torch.cuda.max_memory_allocated(dev) / 2**20


def _prepare(model: nn.Module, device, channels_last: bool, compile_: bool, mode: str = "train") -> nn.Module:
    model = model.to(device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    if not compile_:
        return model
    if mode == "infer" and torch.device(device).type == "cpu":
        from vitlab.optimize.compiled import CompiledInference, compile_inference
        from vitlab.optimize.cpu import inductor_options

        return CompiledInference(model.eval(), compile_inference(model, inductor_options()))
    return torch.compile(model)


def bench_models(patterns: str | Iterable[str] = "*", mode: str = "infer", device: str = "cpu",
                 dtype: str = "fp32", batch_size: int = 32, compile: bool = False, channels_last: bool = False,
                 compare: str | Iterable[str] | None = None, warmup: int = 3, runs: int = 10,
                 progress: bool = True, fuse: bool = False, optimize: bool | str = True) -> list[dict]:
    """Benchmark the registered models matching ``patterns`` (see the module docstring); one row per
    (model, implementation, mode). Inference runs our model through ``vitlab.optimize`` (``"auto"``: measured
    on this batch, cached; or the backend named by ``optimize``) unless ``optimize=False`` or ``compile=True``
    (both implementations plainly compiled); ``fuse`` folds our BatchNorms for plain eager inference where a
    model has ``fuse()`` (LeViT; optimize does it too). timm's model is timed as timm ships it (eager and / or
    compiled: ``compare``). ``progress``: a live bar on a terminal, else a line per finished model and mode."""
    if mode not in (*MODES, "both"):
        raise ValueError(f"mode must be 'infer', 'train' or 'both', got {mode!r}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {sorted(DTYPES)}")
    check_counts(batch_size, warmup, runs)
    peers = _peers(compare)
    patterns = [patterns] if isinstance(patterns, str) else list(patterns)
    for pattern in patterns:
        if not any(c in pattern for c in "*?["):
            get_model_config(pattern)  # a misspelt name: UnknownModelError naming the close matches
    names = list_models(patterns)
    if not names:
        raise ValueError(f"no registered model matches {patterns!r}")
    dev, tdtype = torch.device(device), DTYPES[dtype]
    peak = matmul_peak_tflops(dev, tdtype)
    modes = MODES if mode == "both" else (mode,)

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    rows: list[dict] = []
    live = progress and console.is_terminal  # in a log or a pipe: a plain line per model and mode instead
    total, done, t0 = len(names) * len(modes), 0, time.perf_counter()
    cols = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*cols, console=console, disable=not live, transient=True) as bar:
        task = bar.add_task("models", total=total)
        for name in names:
            cfg = get_model_config(name)
            prof = profile_model(name)
            for m in modes:
                bar.update(task, description=f"{name} {m} ({dev.type}, {dtype}, batch {batch_size})")
                t_one = time.perf_counter()
                new = _bench_one(name, cfg.input_size, prof, m, dev, tdtype, dtype, batch_size, compile,
                                 channels_last, peers, warmup, runs, peak, fuse and m == "infer",
                                 optimize if m == "infer" and not compile else False)
                rows.extend(new)
                bar.advance(task)
                done += 1
                if progress and not live:
                    now = time.perf_counter()
                    say(f"[{done}/{total}] {name} {m}: "
                        f"{new[0]['img_per_s']:,.1f} img/s  ({clock(now - t_one)}, {clock(now - t0)} elapsed)")
    return rows


def _ours(ours: nn.Module, dev, channels_last: bool, compile_: bool, fuse: bool, optimize: bool | str,
          x) -> tuple:
    """(our model ready to time, the ``vitlab.optimize`` backend or None, fused)."""
    if not optimize:
        fused = fuse and hasattr(ours, "fuse")
        if fused:
            ours = ours.eval().fuse()
        return _prepare(ours, dev, channels_last, compile_), None, fused
    from vitlab.optimize import optimize as vitlab_optimize

    ours = ours.to(dev)
    if channels_last:
        ours = ours.to(memory_format=torch.channels_last)
    fast = vitlab_optimize(ours, x, backend="auto" if optimize is True else optimize, tune=True)
    return fast, fast.vitlab_backend, hasattr(ours, "fuse")


def _bench_one(name, input_size, prof, mode, dev, tdtype, dtype, batch_size, compile_, channels_last, peers,
               warmup, runs, peak, fuse, optimize) -> list[dict]:
    bs, note = batch_size, ""
    if dev.type == "cpu" and tdtype == torch.bfloat16:
        from vitlab.optimize.cpu import bf16_note

        note = bf16_note() or ""
    while True:
        try:
            x = torch.randn(bs, *input_size, device=dev)
            if channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            torch.manual_seed(0)
            ours = create_model(name)
            twin = _timm_twin(name, ours) if peers else None  # before any fusing: timm's keys
            fast, backend, fused = _ours(ours, dev, channels_last, compile_, fuse, optimize, x)
            impls = {"vitlab": fast}
            if twin is not None:
                twin = twin.to(dev)
                if "timm" in peers:
                    impls["timm"] = _prepare(twin, dev, channels_last, compile_, mode)
                if "timm-compile" in peers:
                    impls["timm-compile"] = _prepare(twin, dev, channels_last, True, mode)
            steps = {k: _step_fn(v, x, mode, tdtype) for k, v in impls.items()}
            times = round_robin_times(steps, dev, warmup, runs)
            peak_mem = {k: _peak_mem_mb(step, dev) for k, step in steps.items()}
            break
        except torch.cuda.OutOfMemoryError:
            if bs == 1:
                raise
            bs, note = bs // 2, f"out of memory at batch {bs}; retried smaller"
            torch.cuda.empty_cache()
    flops_per_step = 2 * prof.gmacs * 1e9 * bs * (3 if mode == "train" else 1)
    ratios = {peer: paired_ratio(times, "vitlab", peer) for peer in impls if peer != "vitlab"}
    out = []
    for impl, ts in times.items():
        seconds = statistics.median(ts)
        tflops = flops_per_step / seconds / 1e12
        row = dict(
            model=name, impl=impl, mode=mode, device=dev.type, dtype=dtype, batch_size=bs,
            img_per_s=round(bs / seconds, 2), step_ms=round(seconds * 1e3, 3),
            peak_mem_mb=None if peak_mem[impl] is None else round(peak_mem[impl], 1),
            params_m=round(prof.params_m, 2), gmacs=round(prof.gmacs, 3), tflops=round(tflops, 4),
            util=round(tflops / peak, 4), ratio_vs_timm=None, ratio_vs_timm_compile=None,
            compile=compile_ or impl == "timm-compile", channels_last=channels_last,
            fused=fused and impl == "vitlab", backend=backend if impl == "vitlab" else None, note=note)
        if impl == "vitlab":
            for peer, (med, lo, hi) in ratios.items():
                field = "ratio_vs_" + peer.replace("-", "_")
                row[field] = round(med, 4)
                row["ratio_spread_" + peer.replace("-", "_")] = [round(lo, 4), round(hi, 4)]
        out.append(row)
    return out


def write_json(rows: list[dict], path) -> None:
    from vitlab.bench.attention import machine

    _io.write_json(path, {"benchmark": "models", "torch": torch.__version__, "machine": machine(), "rows": rows})


def plot(rows: list[dict], path) -> None:
    """Throughput against GMACs, one labelled point per (model, impl, mode)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5))
    ax = fig.subplots()
    for impl, marker in (("vitlab", "o"), ("timm", "x"), ("timm-compile", "+")):
        pts = [r for r in rows if r["impl"] == impl]
        ax.scatter([r["gmacs"] for r in pts], [r["img_per_s"] for r in pts], marker=marker, label=impl)
        for r in pts:
            ax.annotate(f"{r['model']} ({r['mode']})", (r["gmacs"], r["img_per_s"]), fontsize=7)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("GMACs per image (one multiply-add = 1)")
    ax.set_ylabel("images / s")
    if rows:
        r = rows[0]
        ax.set_title(f"{r['device']} {r['dtype']}, batch {r['batch_size']}")
    ax.legend()
    _io.write_png(path, fig, dpi=120)


def format_table(rows: list[dict]):
    from rich.table import Table

    t = Table(title="bench models (GMACs: one multiply-add = 1; TFLOP/s = 2 x MACs / time)")
    for c in ("model", "impl", "mode", "batch", "img/s", "step ms", "peak MB", "GMACs", "TFLOP/s", "util",
              "ours/timm", "ours/timm-compile"):
        t.add_column(c, justify="left" if c in ("model", "impl", "mode") else "right", no_wrap=c == "model")
    for r in rows:
        t.add_row(r["model"], r["impl"], r["mode"], str(r["batch_size"]), f"{r['img_per_s']:.1f}",
                  f"{r['step_ms']:.1f}", "-" if r["peak_mem_mb"] is None else f"{r['peak_mem_mb']:.0f}",
                  f"{r['gmacs']:.2f}", f"{r['tflops']:.3f}", f"{r['util']:.1%}",
                  _ratio(r, "timm"), _ratio(r, "timm_compile"))
    return t


def _ratio(r: dict, peer: str) -> str:
    v = r.get(f"ratio_vs_{peer}")
    if v is None:
        return "-"
    lo, hi = r.get(f"ratio_spread_{peer}") or (v, v)
    return f"{v:.3f} [{lo:.2f}-{hi:.2f}]"
