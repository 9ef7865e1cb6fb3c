"""DPT-B/16 at 384 (``dpt_vit_base_patch16_384_depth``) against Hugging Face transformers'
``DPTForDepthEstimation`` with the same random weights (moved through ``checkpoint_path=``): inference forward,
batch 2, fp32 on the CPU (bf16 autocast on CUDA with ``--device cuda``).

Paired: every round times both models once (``--calls`` forwards each, per-call time) in alternating order;
the ratio transformers / vitlab is taken within the round, summarised by its median and quartiles over the
rounds after ``--warmup`` rounds. Outputs are checked equal (fp32: within 1e-4) before timing.

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
    ratios, t_hf, t_ours = [], [], []
    for r in range(args.warmup + args.rounds):
        order = [("hf", run_hf), ("ours", run_ours)][:: 1 if r % 2 == 0 else -1]
        t = {name: _time(fn, args.calls, sync) for name, fn in order}
        if r >= args.warmup:
            ratios.append(t["hf"] / t["ours"])
            t_hf.append(t["hf"])
            t_ours.append(t["ours"])
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    result = {"benchmark": "dpt_vs_transformers", "model": "dpt_vit_base_patch16_384_depth", "device": str(dev),
              "dtype": "bf16 autocast" if dev.type == "cuda" else "fp32", "batch": args.batch,
              "threads": torch.get_num_threads(), "rounds": args.rounds, "max_abs_diff": err,
              "speedup_median": statistics.median(ratios), "speedup_q1": q[0], "speedup_q3": q[2],
              "vitlab_s_median": statistics.median(t_ours), "transformers_s_median": statistics.median(t_hf),
              "cpu": platform.processor() or platform.machine(),
              "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else None}
    out = Path(args.out or f"docs/bench/dpt_vs_transformers_{dev.type}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
