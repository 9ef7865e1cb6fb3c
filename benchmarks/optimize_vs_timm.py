"""CPU fp32 inference: ``vitlab.optimize.optimize(model)`` against timm + ``torch.compile`` (Inductor, freezing),
and our plain eager model against timm eager; same weights, paired timing in one process.

For each model: our model and timm's twin carry the same weights (checked by a state-dict round trip);
``vitlab.optimize.optimize(model, x)`` measures its candidates on this batch (``--cache`` to reuse a cached choice) and
timm's twin is compiled as vitlab.optimize compiles (``vitlab.optimize.compile_inference(twin, {"freezing": True,
"cpp.simdlen": ...})``: freezing set where Dynamo reads it)
(``vitlab.optimize.cpu.inductor_options``: the SIMD width Inductor picks anyway, stated so it keys the cache).
Four implementations are then timed in round robin (``--runs`` runs after ``--warmup``, the order reversed every
other run) under ``torch.no_grad()``; each ratio is the median over the runs of the paired ratio peer time / our
time (> 1: ours is faster), with its min, max and quartiles. ``--repeat`` repeats the round robin (fresh blocks,
same models).

``--isa avx2`` emulates an AVX2 machine on an AVX-512 one (``vitlab.optimize.cpu.AVX2_ENV``: ATen, oneDNN and MKL
capped at AVX2, Inductor's C++ built for ``x86-64-v3``, an Inductor cache of its own; set before torch starts: the
script re-runs itself) and records the ISA in use.

    python benchmarks/optimize_vs_timm.py --models deit_tiny_patch16_224 --isa native \\
        --json docs/bench/optimize_vs_timm_xeon/native_deit_tiny_patch16_224.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

MODELS = ["vit_base_patch16_224", "deit_tiny_patch16_224", "swin_tiny_patch4_window7_224", "levit_256",
          "cait_xxs24_224"]


def _stats(ratios: list[float]) -> dict:
    r = sorted(ratios)
    q = statistics.quantiles(r, n=4) if len(r) >= 2 else [r[0], r[0], r[0]]
    return dict(median=round(statistics.median(r), 4), min=round(r[0], 4), max=round(r[-1], 4),
                q1=round(q[0], 4), q3=round(q[2], 4), n=len(r))


def bench_model(name: str, batch_size: int, warmup: int, runs: int, repeat: int, cache: bool) -> dict:
    import copy

    import torch

    import vitlab
    from vitlab.bench.models import _timm_twin
    from vitlab.optimize.compiled import compile_inference
    from vitlab.optimize.cpu import inductor_options
    from vitlab.registry import get_model_config
    from vitlab.timing import round_robin_times

    torch.manual_seed(0)
    ours = vitlab.create_model(name).eval()
    twin = _timm_twin(name, ours).eval()
    eager = copy.deepcopy(ours).eval()  # plain eager, as built (LeViT unfused, like timm's)
    x = torch.randn(batch_size, *get_model_config(name).input_size)
    dev = torch.device("cpu")

    t0 = time.perf_counter()
    fast = vitlab.optimize.optimize(ours, x, cache=cache, tune=True)
    t_opt = time.perf_counter() - t0
    t0 = time.perf_counter()
    timm_c = compile_inference(copy.deepcopy(twin), inductor_options())  # freezing, as vitlab.optimize
    with torch.no_grad():
        ref = twin(x)
        diff_peer = vitlab.optimize.max_abs_diff(timm_c(x), ref)  # the peer must compute the function too
    t_compile = time.perf_counter() - t0
    with torch.no_grad():
        diff = vitlab.optimize.max_abs_diff(fast(x), ref)
        diff_eager = vitlab.optimize.max_abs_diff(eager(x), ref)

    fns = {"vitlab.optimize": lambda: fast(x), "timm+compile": lambda: timm_c(x), "vitlab eager": lambda: eager(x),
           "timm eager": lambda: twin(x)}
    blocks = []
    with torch.no_grad():
        for _ in range(repeat):
            blocks.append(round_robin_times(fns, dev, warmup, runs))
    times = {k: [t for b in blocks for t in b[k]] for k in fns}

    def ratios(ours_k, peer_k):
        return [p / o for o, p in zip(times[ours_k], times[peer_k])]

    return dict(
        model=name, batch_size=batch_size, backend=fast.vitlab_backend, optimize_explain=vitlab.optimize.explain(fast),
        optimize_timings_ms={k: round(v * 1e3, 2) for k, v in fast.vitlab_optimize.timings.items()},
        optimize_s=round(t_opt, 1), timm_compile_s=round(t_compile, 1),
        max_abs_diff_vs_timm=diff, max_abs_diff_eager_vs_timm=diff_eager, max_abs_diff_timm_compile=diff_peer,
        median_ms={k: round(statistics.median(v) * 1e3, 2) for k, v in times.items()},
        img_per_s={k: round(batch_size / statistics.median(v), 2) for k, v in times.items()},
        optimize_vs_timm_compile=_stats(ratios("vitlab.optimize", "timm+compile")),
        eager_vs_timm_eager=_stats(ratios("vitlab eager", "timm eager")),
        per_block={
            "optimize_vs_timm_compile": [round(statistics.median(
                [p / o for o, p in zip(b["vitlab.optimize"], b["timm+compile"])]), 4) for b in blocks],
            "eager_vs_timm_eager": [round(statistics.median(
                [p / o for o, p in zip(b["vitlab eager"], b["timm eager"])]), 4) for b in blocks]})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=MODELS)
    p.add_argument("--isa", choices=["native", "avx2"], default="native")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--cache", action="store_true", help="let vitlab.optimize reuse a cached choice")
    p.add_argument("--json", help="write the results here (atomically)")
    args = p.parse_args(argv)

    from vitlab.optimize import cpu

    cpu.rerun_under(args.isa)  # the caps must be set before torch loads

    import torch

    from vitlab._io import atomic_write

    load = os.getloadavg()
    machine = dict(cpu=cpu.cpu_model(), isa=cpu.isa(), isa_env=cpu.isa_caps(), threads=torch.get_num_threads(),
                   native_bf16=cpu.native_bf16(), torch=torch.__version__, loadavg_start=[round(v, 2) for v in load])
    print(json.dumps(machine), flush=True)
    results = []
    payload = dict(benchmark="optimize_vs_timm", command=" ".join(["python", *sys.argv]),
                   date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), machine=machine,
                   settings=dict(batch_size=args.batch_size, warmup=args.warmup, runs=args.runs, repeat=args.repeat,
                                 dtype="fp32", mode="inference, torch.no_grad"), results=results)
    for name in args.models:
        r = bench_model(name, args.batch_size, args.warmup, args.runs, args.repeat, args.cache)
        r["loadavg_after"] = [round(v, 2) for v in os.getloadavg()]
        results.append(r)
        o, e = r["optimize_vs_timm_compile"], r["eager_vs_timm_eager"]
        print(f"{name:30s} backend {r['backend']:8s} optimize/timm+compile {o['median']:.3f} "
              f"[{o['min']:.3f}-{o['max']:.3f}]  eager/timm eager {e['median']:.3f} [{e['min']:.3f}-{e['max']:.3f}]  "
              f"{r['img_per_s']}", flush=True)
        if args.json:  # after every model: a run cut short keeps what it measured
            atomic_write(args.json, (json.dumps(payload, indent=2) + "\n").encode())
    if args.json:
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
