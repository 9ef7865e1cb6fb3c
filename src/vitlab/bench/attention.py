"""Single-layer attention benchmark, Table IV of the LITv2 / HiLo supplementary (Pan et al., NeurIPS 2022).

Every registered mechanism is built with its defaults (its authors' settings for 1/16-scale maps) at ViT-B's
shape (dim 768, 12 heads, a 14x14 map) and timed on a batch of 64 token maps: eval mode,
``torch.inference_mode``, ``warmup`` untimed calls, then the median of ``runs`` individually timed calls (the
device synchronised around each), the layers timed in round robin so that a noisy machine's drift falls on all
of them alike. A reduced precision (bf16 / fp16) means mixed precision by default, as used in
training: weights and input stay fp32 and the layer runs under ``torch.autocast`` (``autocast=False`` casts the
module and the input to that dtype instead). Parameters and MACs ("FLOPs" as the paper counts them) are
counted once at batch 1 on the meta device.

Each layer is timed as ``vitlab.optimize`` makes it by default (``optimize="auto"``: the fastest of the eager
backends ``none`` / ``onednn`` / ``kernels`` measured on this machine and cached; ``compile`` is left out of
the per-layer choice, which would compile every mechanism -- pass ``optimize="compile"`` for that), and each
row records the ``backend`` used; ``optimize=None`` times the plain eager layers.

Each row: ``name, params_m, mflops, device, dtype, batch_size, img_per_s, rel_msa`` (throughput relative to
``msa`` measured in the same run, None when msa is not part of it) plus ``paper_params_m, paper_mflops,
paper_cpu_img_per_s, paper_gpu_img_per_s`` (None for mechanisms without a Table IV row) and the run settings.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.nn as nn

from vitlab import _io
from vitlab.attention import create, list_attention
from vitlab.bench.paper_table_iv import SETTINGS, paper_row
from vitlab.profile import count_macs, count_params

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}

ROW_KEYS = ("name", "params_m", "mflops", "device", "dtype", "batch_size", "img_per_s", "rel_msa", "backend")
EAGER_CANDIDATES = ("none", "rewrite", "onednn", "kernels")


class _OnGrid(nn.Module):
    """``forward(x)`` for a mechanism on a fixed grid (the FLOP counter calls ``model(x)``)."""

    def __init__(self, attn: nn.Module, hw: tuple[int, int]):
        super().__init__()
        self.attn, self.hw = attn, hw

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, self.hw)


def attention_cost(name: str, hw=(14, 14), dim: int = 768, num_heads: int = 12,
                   **kwargs) -> tuple[float, float]:
    """(parameters in millions, MACs in millions) of one layer for one image, counted on the meta device."""
    with torch.device("meta"):
        attn = create(name, dim, num_heads, **kwargs).eval()
        x = torch.zeros(1, hw[0] * hw[1], dim)
    return count_params(attn)[0] / 1e6, count_macs(_OnGrid(attn, tuple(hw)), x) / 1e6


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_layers(layers: dict[str, Callable], x: torch.Tensor, hw, warmup: int, runs: int,
                 autocast_dtype: torch.dtype | None = None, on_run=None) -> dict[str, float]:
    """Median seconds of one forward pass of each layer over ``runs`` timed calls, after ``warmup`` untimed ones
    (under ``torch.autocast(device, autocast_dtype)`` when given).

    Round robin: every run times each layer once, one after the other, so the drift of a shared, noisy machine
    (other jobs starting and stopping) falls on all of them alike and the ratios to ``msa`` stay fair; timing
    the layers one after the other would hand each the load of its own minutes."""
    times: dict[str, list[float]] = {name: [] for name in layers}
    amp = torch.autocast(x.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None)
    with torch.inference_mode(), amp:
        for attn in layers.values():
            for _ in range(warmup):
                attn(x, hw)
        _sync(x.device)
        for _ in range(runs):
            for name, attn in layers.items():
                t0 = time.perf_counter()
                attn(x, hw)
                _sync(x.device)
                times[name].append(time.perf_counter() - t0)
            if on_run is not None:
                on_run()
    return {name: statistics.median(t) for name, t in times.items()}


def _select(only: str | Iterable[str] | None) -> list[str]:
    names = list_attention()
    if only is None:
        return names
    wanted = [s.strip() for s in only.split(",")] if isinstance(only, str) else list(only)
    unknown = [n for n in wanted if n not in names]
    if unknown:
        raise ValueError(f"unknown attention {unknown}; choose from {names}")
    return [n for n in names if n in wanted]


def bench_attention(device: str | torch.device = "cpu", batch_size: int = 64,
                    dtype: str | torch.dtype = "fp32", only: str | Iterable[str] | None = None,
                    warmup: int = 3, runs: int = 10, hw=(14, 14), dim: int = 768, num_heads: int = 12,
                    progress: bool = True, autocast: bool = True, optimize: str | None = "auto") -> list[dict]:
    """Benchmark every registered mechanism (or those in ``only``: names or "a,b") as one layer each.

    A bf16 / fp16 ``dtype`` runs under ``torch.autocast`` with fp32 weights and input (``autocast=False``:
    module and input cast to ``dtype``). fp32 ignores ``autocast``. ``optimize``: the ``vitlab.optimize``
    backend each layer runs through (``"auto"`` chooses among the eager backends; None: plain eager).

    Returns one dict per mechanism, in registry order (see the module docstring for the keys). All layers are
    built first and timed in round robin (see :func:`_time_layers`)."""
    if runs < 1 or warmup < 0:
        raise ValueError(f"need runs >= 1 and warmup >= 0, got runs={runs}, warmup={warmup}")
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; choose from {sorted(DTYPES)}")
        torch_dtype, dtype_name = DTYPES[dtype], dtype
    else:
        torch_dtype, dtype_name = dtype, str(dtype).removeprefix("torch.")
    device = torch.device(device)
    hw = tuple(hw)
    names = _select(only)
    use_amp = autocast and torch_dtype != torch.float32
    param_dtype = torch.float32 if use_amp else torch_dtype  # autocast: fp32 master weights and input

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    torch.manual_seed(0)
    x = torch.randn(batch_size, hw[0] * hw[1], dim, device=device, dtype=param_dtype)
    layers, costs, backends = {}, {}, {}
    for name in names:
        costs[name] = attention_cost(name, hw, dim, num_heads)
        torch.manual_seed(0)
        layer = create(name, dim, num_heads).to(device=device, dtype=param_dtype).eval()
        layers[name], backends[name] = _optimized(layer, x, hw, optimize)

    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, disable=not progress, transient=True) as bar:
        task = bar.add_task(f"{len(names)} layers ({device.type}, {dtype_name}, batch {batch_size}): runs",
                            total=runs)
        seconds = _time_layers(layers, x, hw, warmup, runs, torch_dtype if use_amp else None,
                               on_run=lambda: bar.advance(task))
    del layers, x

    rows = []
    for name in names:
        params_m, mflops = costs[name]
        paper = paper_row(name) or {}
        rows.append(dict(
            name=name, params_m=round(params_m, 4), mflops=round(mflops, 2), device=device.type,
            dtype=dtype_name, autocast=use_amp, batch_size=batch_size, backend=backends[name],
            img_per_s=round(batch_size / seconds[name], 2),
            rel_msa=None, median_ms=round(seconds[name] * 1e3, 3), runs=runs, warmup=warmup, hw=list(hw),
            dim=dim, num_heads=num_heads, paper_params_m=paper.get("params_m"),
            paper_mflops=paper.get("mflops"), paper_cpu_img_per_s=paper.get("cpu_img_per_s"),
            paper_gpu_img_per_s=paper.get("gpu_img_per_s")))
    base = next((r["img_per_s"] for r in rows if r["name"] == "msa"), None)
    for r in rows:
        r["rel_msa"] = None if base is None else round(r["img_per_s"] / base, 4)
    return rows


def _optimized(layer: nn.Module, x: torch.Tensor, hw, backend: str | None) -> tuple[nn.Module, str]:
    """The layer as ``vitlab.optimize`` makes it (``backend``: "auto" among the eager backends, or a backend
    name; None: as built), called as ``layer(x, hw)``; and the backend used."""
    if backend is None:
        return layer, "eager (not optimized)"
    from vitlab.optimize import optimize

    kwargs = dict(candidates=EAGER_CANDIDATES, tune=True) if backend == "auto" else {}  # a benchmark measures
    grid = optimize(_OnGrid(layer, tuple(hw)), x, backend=backend, **kwargs)
    return (lambda t, _hw, g=grid: g(t)), grid.vitlab_backend


def machine() -> dict:
    """The machine the speeds belong to: CPU model, the ISA in use (caps from the environment included), threads,
    native bf16."""
    from vitlab.optimize import cpu

    return dict(cpu=cpu.cpu_model(), isa=cpu.isa(), threads=torch.get_num_threads(), native_bf16=cpu.native_bf16())


def write_json(rows: list[dict], path: str | Path) -> Path:
    """Save the rows as ``{"benchmark", "paper", "paper_settings", "torch", "machine", "rows"}`` JSON,
    atomically. ``machine`` records the CPU model and ISA; each row its ``backend`` (``vitlab.optimize``)."""
    payload = dict(benchmark="attention", paper="LITv2/HiLo supplementary, Table IV (Pan et al., NeurIPS 2022)",
                   paper_settings={**SETTINGS, "hw": list(SETTINGS["hw"])}, torch=torch.__version__,
                   machine=machine(), rows=rows)
    return _io.write_json(path, payload)


def plot(rows: list[dict], path: str | Path) -> Path:
    """PNG of measured throughput against MACs, one labelled point per mechanism."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5.5))
    ax = fig.add_subplot()
    for r in rows:
        color = "tab:red" if r["name"] == "msa" else "tab:blue"
        ax.scatter(r["mflops"], r["img_per_s"], color=color, zorder=3)
        ax.annotate(r["name"], (r["mflops"], r["img_per_s"]), textcoords="offset points", xytext=(4, 4),
                    fontsize=8)
    ax.set_xlabel("MACs per image (M)")
    ax.set_ylabel("throughput (images/s)")
    if rows:
        r0 = rows[0]
        ax.set_title(f"one attention layer, dim {r0.get('dim', '?')}, {r0.get('num_heads', '?')} heads, "
                     f"{'x'.join(map(str, r0.get('hw', ['?'])))} map: {r0['device']}, {r0['dtype']}, "
                     f"batch {r0['batch_size']}", fontsize=9)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    return _io.write_png(path, fig, dpi=120)


def format_table(rows: list[dict]):
    """A rich Table in Table IV's layout: name, params, FLOPs, img/s, rel. MSA, and the paper's CPU / GPU."""
    from rich.table import Table

    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    title = "Attention layers (Table IV layout)"
    if rows:
        r0 = rows[0]
        title += f": {r0['device']}, {r0['dtype']}, batch {r0['batch_size']}"
    caption = "FLOPs are MACs (multiply-add = 1), fused attention counted."
    if rows and rows[0]["device"] == "cpu":
        m = machine()
        caption += f"\nCPU: {m['cpu']}, ISA {m['isa']}, {m['threads']} threads."
    if rows and "backend" in rows[0]:
        caption += "\nvitlab.optimize backend: " + ", ".join(f"{r['name']} {r['backend']}" for r in rows) + "."
    table = Table(title=title, caption=caption)
    table.add_column("Name")
    for col in ("Params (M)", "FLOPs (M)", "img/s", "rel. MSA", "paper CPU", "paper GPU"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["name"], fmt(r["params_m"], ".2f"), fmt(r["mflops"], ".1f"),
                      fmt(r["img_per_s"], ",.0f"), fmt(r["rel_msa"], ".2f"),
                      fmt(r.get("paper_cpu_img_per_s"), ",d"), fmt(r.get("paper_gpu_img_per_s"), ",d"))
    return table
