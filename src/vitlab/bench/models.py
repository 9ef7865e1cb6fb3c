"""``vitlab bench models``: whole-model throughput, memory and utilisation, optionally against timm.

For each model: images/s, step time, peak memory (CUDA), params, GMACs (one multiply-add = 1), achieved
TFLOP/s (2 FLOPs per MAC; a training step counts 3x the forward) and utilisation against a matrix-product
peak measured in the same run. With ``compare='timm'`` timm's implementation of the same architecture is
built with the same weights and timed alternately with ours in the same process; ``ratio_vs_timm`` is the
median of the paired ratios (our throughput / timm's: > 1 means we are faster).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from contextlib import nullcontext

import torch
import torch.nn as nn

from vitlab._io import atomic_write
from vitlab.bench.timing import matmul_peak_tflops, median_time, paired_times
from vitlab.convert import load_state_dict
from vitlab.profile import profile_model
from vitlab.registry import create_model, get_model_config, list_models

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MODES = ("infer", "train")


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


def _prepare(model: nn.Module, device, channels_last: bool, compile_: bool) -> nn.Module:
    model = model.to(device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    return torch.compile(model) if compile_ else model


def bench_models(patterns: str | Iterable[str] = "*", mode: str = "infer", device: str = "cpu",
                 dtype: str = "fp32", batch_size: int = 32, compile: bool = False, channels_last: bool = False,
                 compare: str | None = None, warmup: int = 3, runs: int = 10, progress: bool = True,
                 fuse: bool = False) -> list[dict]:
    """Benchmark the registered models matching ``patterns`` (see the module docstring); one row per
    (model, implementation, mode). ``fuse`` folds our BatchNorms for inference where a model has ``fuse()``
    (LeViT); timm's model is timed as timm ships it."""
    if mode not in (*MODES, "both"):
        raise ValueError(f"mode must be 'infer', 'train' or 'both', got {mode!r}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {sorted(DTYPES)}")
    if compare not in (None, "timm"):
        raise ValueError(f"compare must be 'timm' or None, got {compare!r}")
    names = list_models(list(patterns) if not isinstance(patterns, str) else patterns)
    if not names:
        raise ValueError(f"no registered model matches {patterns!r}")
    dev, tdtype = torch.device(device), DTYPES[dtype]
    peak = matmul_peak_tflops(dev, tdtype)
    modes = MODES if mode == "both" else (mode,)

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    rows: list[dict] = []
    cols = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*cols, disable=not progress, transient=True) as bar:
        task = bar.add_task("models", total=len(names) * len(modes))
        for name in names:
            cfg = get_model_config(name)
            prof = profile_model(name)
            for m in modes:
                bar.update(task, description=f"{name} {m} ({dev.type}, {dtype}, batch {batch_size})")
                rows.extend(_bench_one(name, cfg.input_size, prof, m, dev, tdtype, dtype, batch_size, compile,
                                       channels_last, compare, warmup, runs, peak, fuse and m == "infer"))
                bar.advance(task)
    return rows


def _bench_one(name, input_size, prof, mode, dev, tdtype, dtype, batch_size, compile_, channels_last, compare,
               warmup, runs, peak, fuse) -> list[dict]:
    bs, note = batch_size, ""
    while True:
        try:
            torch.manual_seed(0)
            ours = create_model(name)
            twin = _timm_twin(name, ours) if compare == "timm" else None
            fused = fuse and hasattr(ours, "fuse")
            if fused:
                ours = ours.eval().fuse()
            impls = {"vitlab": _prepare(ours, dev, channels_last, compile_)}
            if twin is not None:
                impls["timm"] = _prepare(twin, dev, channels_last, compile_)
            x = torch.randn(bs, *input_size, device=dev)
            if channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            steps = {k: _step_fn(v, x, mode, tdtype) for k, v in impls.items()}
            if "timm" in steps:
                t_ours, t_timm, ratio = paired_times(steps["vitlab"], steps["timm"], dev, warmup, runs)
                times = {"vitlab": t_ours, "timm": t_timm}
            else:
                times, ratio = {"vitlab": median_time(steps["vitlab"], dev, warmup, runs)}, None
            peak_mem = {k: _peak_mem_mb(step, dev) for k, step in steps.items()}
            break
        except torch.cuda.OutOfMemoryError:
            if bs == 1:
                raise
            bs, note = bs // 2, f"out of memory at batch {bs}; retried smaller"
            torch.cuda.empty_cache()
    flops_per_step = 2 * prof.gmacs * 1e9 * bs * (3 if mode == "train" else 1)
    out = []
    for impl, seconds in times.items():
        tflops = flops_per_step / seconds / 1e12
        out.append(dict(
            model=name, impl=impl, mode=mode, device=dev.type, dtype=dtype, batch_size=bs,
            img_per_s=round(bs / seconds, 2), step_ms=round(seconds * 1e3, 3),
            peak_mem_mb=None if peak_mem[impl] is None else round(peak_mem[impl], 1), params_m=round(prof.params_m, 2),
            gmacs=round(prof.gmacs, 3), tflops=round(tflops, 4), util=round(tflops / peak, 4),
            ratio_vs_timm=(None if ratio is None else round(ratio, 4)) if impl == "vitlab" else None,
            compile=compile_, channels_last=channels_last, fused=fused and impl == "vitlab", note=note))
    return out


def write_json(rows: list[dict], path) -> None:
    atomic_write(path, (json.dumps({"benchmark": "models", "torch": torch.__version__, "rows": rows}, indent=2)
                        + "\n").encode())


def plot(rows: list[dict], path) -> None:
    """Throughput against GMACs, one labelled point per (model, impl, mode)."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for impl, marker in (("vitlab", "o"), ("timm", "x")):
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
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    plt.close(fig)
    atomic_write(path, buf.getvalue())


def format_table(rows: list[dict]):
    from rich.table import Table

    t = Table(title="bench models (GMACs: one multiply-add = 1; TFLOP/s = 2 x MACs / time)")
    for c in ("model", "impl", "mode", "batch", "img/s", "step ms", "peak MB", "GMACs", "TFLOP/s", "util",
              "ours/timm"):
        t.add_column(c, justify="left" if c in ("model", "impl", "mode") else "right", no_wrap=c == "model")
    for r in rows:
        t.add_row(r["model"], r["impl"], r["mode"], str(r["batch_size"]), f"{r['img_per_s']:.1f}",
                  f"{r['step_ms']:.1f}", "-" if r["peak_mem_mb"] is None else f"{r['peak_mem_mb']:.0f}",
                  f"{r['gmacs']:.2f}", f"{r['tflops']:.3f}", f"{r['util']:.1%}",
                  "-" if r["ratio_vs_timm"] is None else f"{r['ratio_vs_timm']:.3f}")
    return t
