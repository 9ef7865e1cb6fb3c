"""CPU fp32 inference at batch 32: ONNX Runtime (the file ``vitlab export`` writes) against vitlab eager PyTorch and
``optimize(model)`` (``backend="auto"``: the fastest path measured on this machine), paired in one process.

    python benchmarks/export_speed.py                                  # deit_tiny, vit_base, swin_tiny, levit_256
    python benchmarks/export_speed.py --models deit_tiny_patch16_224 --runs 5 --threads 2

Each model is exported with :func:`vitlab.export.onnx` (validated: max abs diff vs eager <= 1e-4) and an ONNX
Runtime session is opened with ``--threads`` intra-op threads (PyTorch gets the same ``torch.set_num_threads``).
Every run calls the three once, the order reversed every other run (``vitlab.timing.round_robin_times``);
ratios are taken within a run and summarised by median, min and max after ``--warmup`` runs. Writes
``docs/bench/export_speed_cpu_fp32_b32.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

import torch

import vitlab
import vitlab.export as ex
from vitlab._io import atomic_write
from vitlab.bench.attention import machine
from vitlab.optimize import optimize
from vitlab.timing import paired_ratio, round_robin_times

MODELS = ["deit_tiny_patch16_224", "vit_base_patch16_224", "swin_tiny_patch4_window7_224", "levit_256"]


def bench_model(name: str, batch: int, threads: int, warmup: int, runs: int, folder: Path,
                backend: str = "auto") -> dict:
    report = ex.onnx(name, folder / f"{name}.onnx")
    print("\n".join(report.lines()), flush=True)
    model, meta = ex.load_source(name)
    x = torch.randn(batch, meta.in_chans, *meta.img_size)
    sess = ex.onnx_session(report.path, threads=threads)
    feed = {sess.get_inputs()[0].name: x.numpy()}
    with torch.inference_mode():
        fast = optimize(model, example_inputs=(x,), backend=backend, tune=True)
        chosen = getattr(fast, "vitlab_backend", None) or type(fast).__name__
        fns = {"eager": lambda: model(x), "optimize": lambda: fast(x), "onnxruntime": lambda: sess.run(None, feed)}
        times = round_robin_times(fns, torch.device("cpu"), warmup=warmup, runs=runs)
    med = {k: statistics.median(v) for k, v in times.items()}
    row = {"model": name, "onnx_max_abs_diff": report.max_abs_diff, "onnx_exporter": report.exporter,
           "optimize_backend": chosen, "times_s": times,
           "img_per_s": {k: batch / v for k, v in med.items()}}
    for peer in ("eager", "optimize"):
        r, lo, hi = paired_ratio(times, "onnxruntime", peer)
        row[f"ort_speedup_vs_{peer}"] = {"median": r, "min": lo, "max": hi}
    print(f"{name}: img/s eager {row['img_per_s']['eager']:.1f}, optimize ({chosen}) "
          f"{row['img_per_s']['optimize']:.1f}, onnxruntime {row['img_per_s']['onnxruntime']:.1f}; ORT vs eager "
          f"{row['ort_speedup_vs_eager']['median']:.2f}x, vs optimize {row['ort_speedup_vs_optimize']['median']:.2f}x",
          flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=MODELS)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--optimize-backend", default="auto", help="vitlab.optimize's backend (default: auto)")
    p.add_argument("--out", default="docs/bench/export_speed_cpu_fp32_b32.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    loadavg = list(os.getloadavg())  # say how busy the machine was: paired ratios do not cancel every effect of load
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            if not vitlab.is_model(name):
                raise SystemExit(f"unknown model {name}")
            rows.append(bench_model(name, args.batch, args.threads, args.warmup, args.runs, Path(tmp),
                                    args.optimize_backend))
            out = {"machine": machine(), "batch": args.batch, "threads": args.threads, "warmup": args.warmup,
                   "runs": args.runs, "torch": torch.__version__, "onnxruntime": __import__("onnxruntime").__version__,
                   "loadavg_start": loadavg, "rows": rows}
            atomic_write(args.out, json.dumps(out, indent=2).encode())  # after every model: partial results survive
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
