"""``vitlab bench tokens``: the speed-accuracy trade-off of token merging (ToMe) and pruning on one model.

Every setting -- the plain model (``r = 0``), ToMe at each ``r`` (merges per block, proportional attention) and
each pruning ``METHOD:KEEP_RATE`` -- is a copy of the same weights (a checkpoint of ``vitlab train``, or random
ones), timed in round robin in one process (eager, fused attention; the ratios to ``r = 0`` are medians of the
per-run paired ratios, with their spread). For each: images/s, GMACs counted by running the patched model (the
reduced token counts; for ToMe also the closed form of :func:`vitlab.tome.cost.tome_gmacs`), the token count
after the last block, peak CUDA memory (None on the CPU) and, with a checkpoint and data, top-1 on a split.
"""

from __future__ import annotations

import copy
import statistics
import time

import torch
import torch.nn as nn

from vitlab import _io, prune, tome
from vitlab._console import clock, console, metric_text, say
from vitlab.attention import Block
from vitlab.bench.models import DTYPES, _peak_mem_mb, _step_fn
from vitlab.models import VisionTransformer
from vitlab.profile import count_macs
from vitlab.prune.tasks import parse_spec
from vitlab.registry import create_model, get_model_config
from vitlab.timing import check_counts, paired_ratio, round_robin_times
from vitlab.tome.cost import tome_gmacs


def settings(r_values: list[int], prune: list[str] | None = None) -> list[tuple[str, dict]]:
    """(label, spec) for the plain model, each ToMe r and each pruning method / keep rate."""
    if any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in r_values):
        raise ValueError(f"--r takes non-negative integers, got {r_values}")
    out = [("r=0", {})]
    out += [(f"tome r={r}", {"tome_r": r}) for r in r_values if r > 0]
    for spec in prune or []:
        method, keeps = parse_spec(spec)
        out += [(f"{method} {k:g}", {"prune": method, "keep_rate": k}) for k in keeps]
    return out


def _patched(base: nn.Module, spec: dict) -> nn.Module:
    """A copy of ``base`` with the setting's patch; a model trained with pruning keeps its trained predictors for
    its own method (at the asked keep rate) and sheds them for every other setting."""
    model = copy.deepcopy(base)
    trained = prune.pruned_info(model).method if prune.is_applied(model) else None
    if trained is not None and trained == spec.get("prune"):
        prune.set_keep_rate(model, spec["keep_rate"])
        return model.eval()
    if trained is not None:
        prune.remove(model)
    if "tome_r" in spec:
        tome.apply(model, r=spec["tome_r"])
    elif "prune" in spec:
        prune.apply(model, spec["prune"], spec["keep_rate"])
    return model.eval()


def _load(name: str | None, checkpoint: str | None, data: str | None):
    """(the model as trained, the data bundle or None, the model's input size)."""
    if checkpoint is None:
        if name is None:
            raise ValueError("name a model or pass --checkpoint")
        if data is not None:
            raise ValueError("--data needs --checkpoint (top-1 of random weights means nothing)")
        torch.manual_seed(0)
        return create_model(name), None, tuple(get_model_config(name).input_size)
    from vitlab.data import DataConfig, build
    from vitlab.train import checkpoint as ck
    from vitlab.train.evaluate import load_model

    sd, meta = ck.load_weights(checkpoint, weights="auto")
    if name is not None and name != meta["model"]:
        raise ValueError(f"the checkpoint holds {meta['model']}, not {name}")
    model = load_model(checkpoint, weights="auto")[0].train()
    if tome.is_applied(model):  # trained with merging: every setting starts from the plain model
        tome.remove(model)
    # other data is read at the checkpoint's size and crop (an image folder's default preset would crop 87.5%)
    dc = DataConfig(**meta["data"]) if data is None else DataConfig(dataset=data, img_size=meta["img_size"],
                                                                     crop_pct=meta.get("crop_pct"))
    bundle = build(dc, mean=meta["mean"], std=meta["std"], in_chans=meta["in_chans"])
    trained = meta.get("class_names")
    if trained and list(bundle.class_names) != list(trained):
        # the same images under other labels (e.g. an image folder's sorted names against the IDX order) would
        # give a top-1 that is silently wrong
        raise ValueError(f"{dc.dataset} names its classes {bundle.class_names}, the checkpoint was trained on "
                         f"{trained} (another order or set): top-1 would compare the wrong labels")
    return model, bundle, (meta["in_chans"], meta["img_size"], meta["img_size"])


def _tokens_out(model: nn.Module, x: torch.Tensor) -> int:
    with torch.no_grad():
        return int(model.forward_features(x).shape[1])


def bench_tokens(name: str | None, r_values: list[int], prune: list[str] | None = None,
                 checkpoint: str | None = None, data: str | None = None, split: str = "test", device: str = "cpu",
                 dtype: str = "fp32", batch_size: int = 32, warmup: int = 3, runs: int = 10,
                 progress: bool = True) -> list[dict]:
    """One row per setting (see the module docstring). ``progress``: a spinner on a terminal while timing, else a
    line when the timing starts and one per finished setting."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {sorted(DTYPES)}")
    check_counts(batch_size, warmup, runs)
    dev, tdtype = torch.device(device), DTYPES[dtype]
    base, bundle, input_size = _load(name, checkpoint, data)
    base = base.eval()
    # the closed form knows ViT / DeiT blocks (MLP fc1); HaLViT's and CaiT's are counted only
    plain = isinstance(base, VisionTransformer) and all(isinstance(b, Block) for b in base.blocks)
    grid = settings(r_values, prune)
    models = {label: _patched(base, spec).to(dev) for label, spec in grid}
    x = torch.randn(batch_size, *input_size, device=dev)
    one = x[:1].cpu()
    steps = {label: _step_fn(m, x, "infer", tdtype) for label, m in models.items()}
    from rich.progress import Progress, SpinnerColumn, TextColumn

    live = progress and console.is_terminal  # in a log or a pipe: plain lines instead
    what = f"timing {len(steps)} settings in round robin ({dev.type}, {dtype}, batch {batch_size})"
    t0 = time.perf_counter()
    if progress and not live:
        say(what)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), console=console, disable=not live,
                  transient=True) as bar:
        bar.add_task(what)
        times = round_robin_times(steps, dev, warmup, runs)
    rows = []
    for i, (label, spec) in enumerate(grid, 1):
        m = models[label]
        cpu_model = copy.deepcopy(m).cpu().float()
        med, lo, hi = paired_ratio(times, label, "r=0")
        seconds = statistics.median(times[label])
        row = dict(model=name or checkpoint,
                   setting=label, device=dev.type, dtype=dtype, batch_size=batch_size,
                   img_per_s=round(batch_size / seconds, 2), step_ms=round(seconds * 1e3, 3),
                   speedup_vs_r0=round(med, 4), speedup_spread=[round(lo, 4), round(hi, 4)],
                   gmacs=round(count_macs(cpu_model, one) / 1e9, 4),
                   gmacs_closed_form=None, tokens_out=_tokens_out(cpu_model, one),
                   peak_mem_mb=_peak_mem_mb(steps[label], dev), top1=None, **spec)
        if "prune" not in spec and plain:
            rs = tome.info(m).r if "tome_r" in spec else [0] * len(m.blocks)
            row["gmacs_closed_form"] = round(tome_gmacs(base, rs, input_size[1:]), 4)
        if bundle is not None:
            from vitlab.classify import evaluate_model

            loader = bundle.loader(split if getattr(bundle, split, None) is not None else "val", batch_size=256)
            row["top1"] = round(evaluate_model(m, loader, dev, bundle.num_classes)["top1"], 3)
        rows.append(row)
        if progress and not live:
            top1 = "" if row["top1"] is None else f", top-1 {metric_text('top1', row['top1'])}"
            say(f"[{i}/{len(grid)}] {label}: {row['img_per_s']:,.1f} img/s{top1}  ({clock(time.perf_counter() - t0)} "
                f"elapsed)")
    return rows


def write_json(rows: list[dict], path) -> None:
    from vitlab.bench.attention import machine

    _io.write_json(path, {"benchmark": "tokens", "torch": torch.__version__, "machine": machine(), "rows": rows})


def plot(rows: list[dict], path) -> None:
    """Speed-accuracy: top-1 against images/s when measured (else GMACs against images/s), one point a setting."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    has_acc = all(r["top1"] is not None for r in rows)
    for kind, marker in (("r=0", "s"), ("tome", "o"), ("prune", "^")):
        pts = [r for r in rows if (r["setting"] == "r=0") == (kind == "r=0")
               and (kind != "tome" or "tome_r" in r) and (kind != "prune" or "prune" in r)]
        if not pts:
            continue
        ys = [r["top1"] if has_acc else r["gmacs"] for r in pts]
        ax.plot([r["img_per_s"] for r in pts], ys, marker=marker, linestyle="-" if kind == "tome" else "none",
                label={"r=0": "plain", "tome": "ToMe", "prune": "pruning"}[kind])
        for r, y in zip(pts, ys, strict=True):
            ax.annotate(r["setting"], (r["img_per_s"], y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    r0 = rows[0]
    ax.set_xlabel(f"images/s ({r0['device']}, {r0['dtype']}, batch {r0['batch_size']})")
    ax.set_ylabel("top-1 (%)" if has_acc else "GMACs")
    ax.set_title(f"{r0['model']}: token merging and pruning")
    ax.grid(alpha=0.3)
    ax.legend()
    _io.write_png(path, fig)


def format_table(rows: list[dict]):
    from rich.table import Table

    t = Table(title="bench tokens (GMACs: one multiply-add = 1, counted with the reduced token counts)")
    for c in ("setting", "img/s", "x r=0", "spread", "GMACs", "closed form", "tokens out", "peak MB", "top-1"):
        t.add_column(c, justify="left" if c == "setting" else "right")
    for r in rows:
        t.add_row(r["setting"], f"{r['img_per_s']:.1f}", f"{r['speedup_vs_r0']:.2f}",
                  f"{r['speedup_spread'][0]:.2f}-{r['speedup_spread'][1]:.2f}", f"{r['gmacs']:.3f}",
                  "-" if r["gmacs_closed_form"] is None else f"{r['gmacs_closed_form']:.3f}", str(r["tokens_out"]),
                  "-" if r["peak_mem_mb"] is None else f"{r['peak_mem_mb']:.0f}",
                  "-" if r["top1"] is None else f"{r['top1']:.2f}")
    return t
