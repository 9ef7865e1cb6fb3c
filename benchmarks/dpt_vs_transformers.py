"""DPT-B/16 at 384 (``dpt_vit_base_patch16_384_depth``) against Hugging Face transformers'
``DPTForDepthEstimation`` with the same random weights (moved through ``checkpoint_path=``): inference forward,
batch 2, fp32 on the CPU (bf16 autocast on CUDA with ``--device cuda``). On the CPU ``vitlab.optimize`` of the
model (its choice measured on this batch) is timed beside them unless ``--no-optimize``.

Paired: every round times both models once (``--calls`` forwards each, per-call time) in alternating order;
the ratios transformers / vitlab (and transformers / vitlab.optimize) are taken within the round, summarised
by their median and quartiles over the rounds after ``--warmup`` rounds. Outputs are checked equal (fp32:
within 1e-4) before timing.

    python benchmarks/dpt_vs_transformers.py                  # docs/bench/dpt_vs_transformers_cpu.json
    python benchmarks/dpt_vs_transformers.py --device cuda    # docs/bench/dpt_vs_transformers_cuda.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch


def _time(fn, calls: int, sync) -> float:
    sync()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - t) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--calls", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-optimize", action="store_true", help="skip vitlab.optimize (CPU)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from safetensors.torch import save_file
    from transformers import DPTConfig, DPTForDepthEstimation

    from vitlab.dense import create

    dev = torch.device(args.device)
    torch.manual_seed(0)
    hf = DPTForDepthEstimation(DPTConfig()).eval()  # DPTConfig() is ViT-B/16 at 384, hooks 2, 5, 8, 11
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "dpt.safetensors"
        save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(path))
        ours = create("dpt_vit_base_patch16_384_depth", checkpoint_path=str(path)).eval()
    hf, ours = hf.to(dev), ours.to(dev)
    x = torch.randn(args.batch, 3, 384, 384, device=dev)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else torch.autocast("cpu", enabled=False)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def run_hf():
        with torch.inference_mode(), amp:
            return hf(pixel_values=x).predicted_depth

    def run_ours():
        with torch.inference_mode(), amp:
            return ours(x)[:, 0]

    err = (run_hf().float() - run_ours().float()).abs().max().item()
    fns = [("hf", run_hf), ("ours", run_ours)]
    err_opt = None
    if dev.type == "cpu" and not args.no_optimize:
        import vitlab

        fast = vitlab.optimize.optimize(ours, x, tune=True)

        def run_opt():
            with torch.inference_mode():
                return fast(x)[:, 0]

        err_opt = (run_hf() - run_opt()).abs().max().item()
        fns.append(("optimize", run_opt))
    times: dict[str, list[float]] = {name: [] for name, _ in fns}
    for r in range(args.warmup + args.rounds):
        t = {name: _time(fn, args.calls, sync) for name, fn in fns[:: 1 if r % 2 == 0 else -1]}
        if r >= args.warmup:
            for name in t:
                times[name].append(t[name])

    def summary(name: str) -> dict:
        ratios = [h / o for h, o in zip(times["hf"], times[name])]
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        return {"median": statistics.median(ratios), "q1": q[0], "q3": q[2], "min": min(ratios), "max": max(ratios)}

    eager = summary("ours")
    result = {"benchmark": "dpt_vs_transformers", "model": "dpt_vit_base_patch16_384_depth", "device": str(dev),
              "dtype": "bf16 autocast" if dev.type == "cuda" else "fp32", "batch": args.batch,
              "threads": torch.get_num_threads(), "rounds": args.rounds, "max_abs_diff": err,
              "speedup_median": eager["median"], "speedup_q1": eager["q1"], "speedup_q3": eager["q3"],
              "speedup": eager, "vitlab_s_median": statistics.median(times["ours"]),
              "transformers_s_median": statistics.median(times["hf"]),
              "cpu": platform.processor() or platform.machine(),
              "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else None,
              "isa": torch.backends.cpu.get_cpu_capability()}
    if "optimize" in times:
        result.update(optimize_backend=fast.vitlab_backend, max_abs_diff_optimize=err_opt,
                      speedup_optimize=summary("optimize"), optimize_s_median=statistics.median(times["optimize"]))
    out = Path(args.out or f"docs/bench/dpt_vs_transformers_{dev.type}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
