"""Plain eager inference against timm eager, same weights, on the CPU: does the plain model do timm's work?

For each model: vitlab's model and timm's model of the same name carry the same weights (loaded by state dict,
outputs checked equal). Two measurements:

* the operators: one forward of each under ``torch.profiler`` (batch 2), every ATen operator counted with its
  input shapes; ``op_differences`` lists the (operator, shapes) whose counts differ (an extra copy, a
  non-fused projection, attention outside SDPA, another patch-embedding path). Independent of the machine's
  load, so it can be read on a busy machine;
* the time: ``--runs`` paired calls after ``--warmup``, the two models alternating (which goes first flips every
  pair) under ``torch.no_grad()``; the ratio is the median over pairs of timm's time / ours (> 1: ours is
  faster), with its quartiles, and the median milliseconds of each.

``--isa both`` (default) runs the whole measurement twice, each in a fresh process: natively and with the CPU
capped at AVX2 (``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2``, set before
torch loads), and records the CPU model, the ISA in use, the thread count and the load average of each run.

``--processes N`` repeats each ISA's measurement in N fresh processes (the ISAs alternating). The ratio of one
process can sit a few per cent off the next one's with the same operators (most likely where each model's
weights and activations land in memory, which is fixed per process). ``runs`` holds each process's results per
ISA; ``summary`` gives, per ISA and model, each process's median ratio, their median and min-max, and the median
over all pairs of all processes.

    python benchmarks/eager_vs_timm.py --models deit_tiny_patch16_224 --batch-size 32 --json eager_vs_timm.json
    python benchmarks/eager_vs_timm.py --processes 8 --runs 20 --warmup 3 --json eager_vs_timm_processes.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

AVX2_CAPS = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def _stats(values: list[float]) -> dict:
    v = sorted(values)
    q = statistics.quantiles(v, n=4) if len(v) >= 2 else [v[0]] * 3
    return dict(median=round(statistics.median(v), 4), q1=round(q[0], 4), q3=round(q[2], 4), min=round(v[0], 4),
                max=round(v[-1], 4), n=len(v))


def _op_counts(model, x) -> collections.Counter:
    import torch
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        model(x)
    return collections.Counter((e.name, str(e.input_shapes)) for e in prof.events() if e.name.startswith("aten::"))


def op_differences(ours, twin, x) -> list[dict]:
    """(operator, input shapes) whose call counts differ between the two models' forward of ``x``."""
    a, b = _op_counts(ours, x), _op_counts(twin, x)
    return [dict(op=k[0], shapes=k[1], vitlab=a[k], timm=b[k]) for k in sorted(set(a) | set(b)) if a[k] != b[k]]


def paired_times(fns: dict, warmup: int, runs: int) -> dict[str, list[float]]:
    """Seconds per call of each of two callables, called alternately (the first of each pair flips)."""
    import torch

    names = list(fns)
    times: dict[str, list[float]] = {n: [] for n in names}
    with torch.no_grad():
        for i in range(warmup + runs):
            for n in names if i % 2 == 0 else names[::-1]:
                t0 = time.perf_counter()
                fns[n]()
                if i >= warmup:
                    times[n].append(time.perf_counter() - t0)
    return times


def bench_model(name: str, batch_size: int, warmup: int, runs: int) -> dict:
    import timm
    import torch

    import vitlab
    from vitlab.registry import get_model_config

    torch.manual_seed(0)
    ours = vitlab.create_model(name).eval()
    twin = timm.create_model(name, pretrained=False, num_classes=ours.num_classes)
    twin.load_state_dict(ours.state_dict())
    twin.eval()
    size = get_model_config(name).input_size
    small = torch.randn(2, *size)
    with torch.no_grad():
        diff = float((ours(small) - twin(small)).abs().max())
    diffs = op_differences(ours, twin, small)
    x = torch.randn(batch_size, *size)
    times = paired_times({"vitlab": lambda: ours(x), "timm": lambda: twin(x)}, warmup, runs)
    ratios = [t / o for o, t in zip(times["vitlab"], times["timm"])]
    return dict(model=name, batch_size=batch_size, max_abs_diff=diff, op_differences=diffs,
                median_ms={k: round(statistics.median(v) * 1e3, 2) for k, v in times.items()},
                timm_over_vitlab=_stats(ratios), ratios=[round(r, 4) for r in ratios])


def measure(args) -> dict:
    import torch

    from vitlab.optimize import cpu

    if args.threads:
        torch.set_num_threads(args.threads)
    machine = dict(cpu=cpu.cpu_model(), isa=cpu.isa(), isa_env=cpu.isa_caps(), threads=torch.get_num_threads(),
                   torch=torch.__version__, loadavg_start=[round(v, 2) for v in os.getloadavg()])
    print(json.dumps(machine), flush=True)
    results = []
    for name in args.models:
        r = bench_model(name, args.batch_size, args.warmup, args.runs)
        r["loadavg_after"] = [round(v, 2) for v in os.getloadavg()]
        results.append(r)
        s = r["timm_over_vitlab"]
        print(f"{machine['isa']:8s} {name:28s} timm/vitlab {s['median']:.3f} [{s['q1']:.3f}-{s['q3']:.3f}]  "
              f"{r['median_ms']} ms  {len(r['op_differences'])} (op, shapes) differ", flush=True)
    return dict(machine=machine, results=results)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["deit_tiny_patch16_224"])
    p.add_argument("--isa", choices=["both", "native", "avx2"], default="both")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    p.add_argument("--processes", type=int, default=1, help="fresh processes per ISA (default 1)")
    p.add_argument("--json", help="write the results here (atomically)")
    args = p.parse_args(argv)
    if args.processes < 1:
        p.error("--processes must be at least 1")

    if args.isa == "both" or args.processes > 1:
        isas = ("native", "avx2") if args.isa == "both" else (args.isa,)
        runs: dict[str, list[dict]] = {isa: [] for isa in isas}
        for _ in range(args.processes):
            for isa in isas:
                runs[isa].append(_fresh_process(argv if argv is not None else sys.argv[1:], isa))
        payload = dict(benchmark="eager_vs_timm", command=" ".join(["python", *sys.argv]),
                       date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), processes=args.processes,
                       runs=runs, summary=_summary(runs))
        for isa, models in payload["summary"].items():
            for name, s in models.items():
                print(f"{isa:8s} {name:28s} per-process medians {s['per_process']}: median "
                      f"{s['over_processes']['median']:.3f} [{s['over_processes']['min']:.3f}-"
                      f"{s['over_processes']['max']:.3f}], all pairs {s['all_pairs']['median']:.3f}")
    else:
        if args.isa == "avx2" and any(os.environ.get(k) != v for k, v in AVX2_CAPS.items()):
            p.error("--isa avx2 needs the caps set before torch loads: use --isa both, or set "
                    + " ".join(f"{k}={v}" for k, v in AVX2_CAPS.items()))
        payload = dict(benchmark="eager_vs_timm", isa=args.isa, **measure(args))
    if args.json:
        from vitlab._io import atomic_write

        atomic_write(args.json, (json.dumps(payload, indent=2) + "\n").encode())
        print(f"wrote {args.json}")
    return 0


def _fresh_process(argv: list[str], isa: str) -> dict:
    """One ISA's measurement in a fresh Python process (the AVX2 caps set before torch loads)."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "run.json")
        cmd = [sys.executable, __file__, *_forward(argv), "--isa", isa, "--processes", "1", "--json", out]
        subprocess.run(cmd, env={**os.environ, **(AVX2_CAPS if isa == "avx2" else {})}, check=True)
        with open(out) as f:
            return json.load(f)


def _summary(runs: dict[str, list[dict]]) -> dict:
    """Per ISA and model: each process's median ratio, their statistics, and the statistics of all pairs."""
    out: dict[str, dict] = {}
    for isa, payloads in runs.items():
        for i, name in enumerate(r["model"] for r in payloads[0]["results"]):
            per = [p["results"][i]["timm_over_vitlab"]["median"] for p in payloads]
            pairs = [v for p in payloads for v in p["results"][i]["ratios"]]
            out.setdefault(isa, {})[name] = dict(per_process=per, over_processes=_stats(per),
                                                 all_pairs=_stats(pairs))
    return out


def _forward(argv: list[str]) -> list[str]:
    """The command line without ``--isa``, ``--processes`` and ``--json`` (and their values), for the runs in
    fresh processes."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--isa", "--json", "--processes"):
            skip = True
        elif not a.startswith(("--isa=", "--json=", "--processes=")):
            out.append(a)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
