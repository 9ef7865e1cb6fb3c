"""Measure ``make demo`` over seeds: run the default ``vitlab train`` recipe once per seed, report test top-1 and time.

``make demo`` runs ``vitlab train`` with no flags; this script runs exactly that, adding only ``--seed S --quiet
--output_dir RUN`` (a temporary run directory, removed afterwards unless ``--keep-runs``), one fresh process per
seed. It prints one line per seed and the mean / std / min / max of the test top-1 over the seeds, with the CPU
model, the ISA PyTorch dispatches to and the load average (the times are only comparable on a quiet machine), and
writes the same as JSON to ``docs/bench/demo_seeds.json`` (atomically).

    python scripts/demo_seeds.py                       # seeds 0-4 of the default recipe -> docs/bench/demo_seeds.json
    python scripts/demo_seeds.py --seeds 0 1 2         # other seeds
    python scripts/demo_seeds.py -- --epochs 60        # the default recipe with overrides (vitlab train flags)
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
        python scripts/demo_seeds.py --out docs/bench/demo_seeds_avx2.json   # what an AVX2-only machine computes

Times per seed: ``train_s`` is the sum of the epochs' training time (``epoch_time_s`` in the run's metrics, no
validation), ``fit_s`` the whole ``fit`` (data, validation every epoch, checkpoints, test; ``wall_time_s`` of the
run's summary), ``process_s`` the subprocess including Python and torch start-up. The target:
mean >= 98.5 %, every seed >= 98.0 %, <= 90 s of training on 2 cores; ``--check`` exits 1 when the accuracy part of
it is missed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from datetime import datetime, timezone
from pathlib import Path

from vitlab.train import read_metrics  # imported before any timed run starts

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "docs" / "bench" / "demo_seeds.json"
TARGET_MEAN, TARGET_MIN, TARGET_TRAIN_S = 98.5, 98.0, 90.0
ISA_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "OMP_NUM_THREADS",
           "MKL_NUM_THREADS")


def cpu_info() -> dict:
    """CPU model, logical CPUs, the vector-ISA flags that matter to PyTorch on CPU, and what torch dispatches to."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and model in ("", platform.machine(), platform.processor()):
                model = value.strip()
            elif key == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    isa_flags = [f for f in ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
                             "amx_tile", "amx_bf16") if f in flags]
    info = {"model": model, "logical_cpus": os.cpu_count(), "affinity_cpus": len(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity") else None, "isa_flags": isa_flags,
            "env": {k: os.environ[k] for k in ISA_ENV if k in os.environ}}
    # What torch picks under this environment (ATEN_CPU_CAPABILITY lowers it), asked the way the runs see it.
    probe = ("import json, torch; print(json.dumps({'torch': torch.__version__, "
             "'aten_capability': torch.backends.cpu.get_cpu_capability(), 'torch_threads': torch.get_num_threads(), "
             "'mkldnn': torch.backends.mkldnn.is_available()}))")
    try:
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=300)
        info.update(json.loads(out.stdout.strip().splitlines()[-1]))
    except (subprocess.SubprocessError, ValueError, IndexError) as e:
        info["probe_error"] = str(e).splitlines()[0] if str(e) else type(e).__name__
    return info


def run_seed(seed: int, extra: list[str], run_dir: Path, timeout: float | None) -> dict:
    """``vitlab train --seed SEED --quiet --output_dir RUN_DIR EXTRA...`` in a fresh process; its numbers."""
    cmd = [sys.executable, "-m", "vitlab", "train", "--seed", str(seed), "--quiet", "--output_dir", str(run_dir),
           *extra]
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    process_s = time.perf_counter() - t0
    load_after = os.getloadavg()[0]
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"seed {seed}: {' '.join(cmd)} exited {proc.returncode}:\n  " + "\n  ".join(tail))
    summary = json.loads((run_dir / "summary.json").read_text())
    metrics = read_metrics(run_dir, "epoch")
    if summary.get("test_top1") is None:
        raise RuntimeError(f"seed {seed}: the run in {run_dir} reports no test accuracy")
    epoch_times = [m["epoch_time_s"] for m in metrics]
    return {"seed": seed, "test_top1": summary["test_top1"],
            "best_val_top1": summary.get("best_val_top1"), "best_epoch": summary.get("best_epoch"),
            "best_weights": summary.get("best_weights"), "epochs": summary.get("epochs"),
            "train_s": round(sum(epoch_times), 2),
            "median_epoch_s": round(statistics.median(epoch_times), 3) if epoch_times else None,
            "fit_s": round(summary.get("wall_time_s", float("nan")), 2), "process_s": round(process_s, 2),
            "loadavg_1min": [round(load_before, 2), round(load_after, 2)], "params_m": summary.get("params_m")}


def stats(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values)}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Arguments after -- go to every `vitlab train` run (overrides of the recipe).")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON results (default: {DEFAULT_OUT})")
    p.add_argument("--no-write", action="store_true", help="print only")
    p.add_argument("--keep-runs", type=Path, default=None, metavar="DIR",
                   help="keep the run directories under DIR (default: a temporary folder, removed)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per seed before giving up")
    p.add_argument("--jobs", type=int, default=1,
                   help="seeds run side by side (default 1; more only to save wall time: the times then say nothing)")
    p.add_argument("--note", default=None, help="a remark stored in the JSON (e.g. the machine was busy)")
    p.add_argument("--check", action="store_true", help=f"exit 1 unless mean >= {TARGET_MEAN} and min >= {TARGET_MIN}")
    args = p.parse_args(argv)

    cpu = cpu_info()
    isa = cpu.get("aten_capability", "?")
    print(f"CPU: {cpu['model']} ({cpu['logical_cpus']} logical CPUs, torch dispatches {isa}, "
          f"{cpu.get('torch_threads', '?')} torch threads)"
          + (f"  env: {' '.join(f'{k}={v}' for k, v in cpu['env'].items())}" if cpu["env"] else ""), flush=True)
    recipe = "vitlab train" + (" " + " ".join(extra) if extra else "") + " (+ --seed S --quiet --output_dir RUN)"
    print(f"recipe: {recipe}", flush=True)

    base = Path(tempfile.mkdtemp(prefix="demo_seeds-")) if args.keep_runs is None else args.keep_runs
    base.mkdir(parents=True, exist_ok=True)
    runs = []
    try:
        for seed in args.seeds:
            if (base / f"seed{seed}").exists():
                raise SystemExit(f"{base / f'seed{seed}'} exists; remove it or choose another --keep-runs folder")
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            futures = [pool.submit(run_seed, seed, extra, base / f"seed{seed}", args.timeout) for seed in args.seeds]
            for fut in as_completed(futures):
                r = fut.result()
                runs.append(r)
                print(f"seed {r['seed']}: test top-1 {r['test_top1']:.2f}%  (best val {r['best_val_top1']:.2f}% at "
                      f"epoch {r['best_epoch']}, {r['best_weights']})  train {r['train_s']:.1f}s  fit {r['fit_s']:.1f}s"
                      f"  load {r['loadavg_1min'][0]:.1f}->{r['loadavg_1min'][1]:.1f}", flush=True)
    finally:
        if args.keep_runs is None:
            shutil.rmtree(base, ignore_errors=True)
    runs.sort(key=lambda r: args.seeds.index(r["seed"]))

    acc = stats([r["test_top1"] for r in runs])
    train = stats([r["train_s"] for r in runs])
    fit_s = stats([r["fit_s"] for r in runs])
    ok = acc["mean"] >= TARGET_MEAN and acc["min"] >= TARGET_MIN
    print(f"test top-1 over seeds {args.seeds}: mean {acc['mean']:.2f}%  std {acc['std']:.2f}  "
          f"min {acc['min']:.2f}%  max {acc['max']:.2f}%  ({'meets' if ok else 'misses'} mean >= {TARGET_MEAN}, "
          f"min >= {TARGET_MIN})")
    print(f"train seconds: mean {train['mean']:.1f}  min {train['min']:.1f}  max {train['max']:.1f}  "
          f"(fit: mean {fit_s['mean']:.1f}); target <= {TARGET_TRAIN_S:.0f}s on a quiet 2-core machine")

    if not args.no_write:
        from vitlab._io import atomic_write

        doc = {"what": "make demo (vitlab train, default recipe) over seeds: test top-1 of the best-val checkpoint",
               "command": f"python scripts/demo_seeds.py{' -- ' + ' '.join(extra) if extra else ''}",
               "overrides": extra, "seeds": args.seeds, "jobs": args.jobs,
               "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"), "cpu": cpu,
               "python": platform.python_version(),
               "test_top1": acc, "train_s": train, "fit_s": fit_s,
               "target": {"mean_top1": TARGET_MEAN, "min_top1": TARGET_MIN, "train_s_2_cores": TARGET_TRAIN_S},
               "meets_accuracy_target": ok, "runs": runs}
        if args.note:
            doc["note"] = args.note
        atomic_write(args.out, (json.dumps(doc, indent=2) + "\n").encode())
        print(f"wrote {args.out}")
    return 1 if args.check and not ok else 0


if __name__ == "__main__":
    sys.exit(main())
