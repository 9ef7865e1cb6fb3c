"""int8 on ONNX Runtime for a vitlab-trained checkpoint: file size, top-1 change on the test split and CPU speed at
batch 32, fp32 ONNX against dynamic-int8 ONNX (``vitlab.export.quantize_onnx``), paired in one process.

    vitlab train --epochs 8 --output_dir runs/digits           # the default pico ViT on digits (under a minute)
    python benchmarks/export_int8.py runs/digits --data digits

Every run calls both sessions ``--calls`` times (a small model's single call is ~2 ms, shorter than the
scheduler's noise), the order reversed every other run; the speed ratio is the median of the per-run ratios (min,
max alongside) after ``--warmup`` runs. Writes ``docs/bench/export_int8_cpu_b32.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

import vitlab.export as ex
from vitlab._io import atomic_write
from vitlab.bench.attention import machine
from vitlab.timing import paired_ratio, round_robin_times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", help="a run directory written by vitlab train")
    p.add_argument("--data", default="digits")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--calls", type=int, default=20, help="session calls per timed run")
    p.add_argument("--note", default="", help="how busy the machine was, recorded in the JSON")
    p.add_argument("--out", default="docs/bench/export_int8_cpu_b32.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        fp32, int8 = Path(tmp) / "fp32.onnx", Path(tmp) / "int8.onnx"
        report = ex.onnx(args.run, fp32)
        print("\n".join(report.lines()), flush=True)
        q = ex.quantize_onnx(fp32, int8, data=args.data)
        meta = report.meta
        x = torch.randn(args.batch, meta.in_chans, *meta.img_size).numpy()
        sessions = {"fp32": ex.onnx_session(fp32, threads=args.threads),
                    "int8": ex.onnx_session(int8, threads=args.threads)}
        feeds = {k: {s.get_inputs()[0].name: x} for k, s in sessions.items()}
        fns = {k: (lambda s=s, f=feeds[k]: [s.run(None, f) for _ in range(args.calls)]) for k, s in sessions.items()}
        times = round_robin_times(fns, torch.device("cpu"), warmup=args.warmup, runs=args.runs)
    r, lo, hi = paired_ratio(times, "int8", "fp32")
    img_s = {k: args.batch * args.calls / statistics.median(v) for k, v in times.items()}
    out = {"machine": machine(), "run": args.run, "model": meta.model, "img_size": meta.img_size,
           "batch": args.batch, "threads": args.threads, "warmup": args.warmup, "runs": args.runs,
           "calls_per_run": args.calls,
           "onnx_max_abs_diff": report.max_abs_diff, "quantize": q, "img_per_s": img_s,
           "int8_speedup_vs_fp32": {"median": r, "min": lo, "max": hi}, "times_s": times,
           "note": args.note}
    print(f"{meta.model} on {args.data}: top-1 fp32 {q['top1_fp32']:.2f}% int8 {q['top1_int8']:.2f}% "
          f"({q['top1_change']:+.2f}), size {q['fp32_bytes'] / 2**20:.2f} -> {q['int8_bytes'] / 2**20:.2f} MiB, "
          f"img/s fp32 {img_s['fp32']:.0f} int8 {img_s['int8']:.0f} ({r:.2f}x, {lo:.2f}-{hi:.2f})")
    atomic_write(args.out, json.dumps(out, indent=2).encode())
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
