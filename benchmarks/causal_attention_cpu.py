"""vitlab's fused causal prompt attention (:func:`vitlab.optimize.kernels.causal_attention`) against PyTorch's CPU
SDPA (its flash kernel, ``is_causal=True``), fp32, on a decoder's prompt shapes: ``llama_100m``'s 10 heads of 64
channels (batch 1 and 8) and Llama-2-7B's 32 heads of 128 (Touvron et al., 2023), 32 to 1,024 tokens. q, k and v
are laid out as a fused projection leaves them (strided (B, N, heads, D) views), as in the model.

Calls alternate (round robin, order reversed every other run) after warm-up; the ratio of each run is SDPA's
time / the kernel's (> 1: the kernel is faster), summarised by its median and min-max. Run it once per ISA path:

    OMP_NUM_THREADS=1 python benchmarks/causal_attention_cpu.py --threads 1 --json causal_cpu_avx512.json
    ATEN_CPU_CAPABILITY=avx2 OMP_NUM_THREADS=1 python benchmarks/causal_attention_cpu.py --threads 1 \\
        --json causal_cpu_avx2.json
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F
from _kernel_bench import meta, parse

from vitlab._io import write_json
from vitlab.optimize import kernels
from vitlab.timing import round_robin_times

# (batch, heads, tokens, head width)
SHAPES = [(1, 10, 32, 64), (1, 10, 128, 64), (8, 10, 128, 64), (1, 32, 128, 128), (1, 10, 512, 64),
          (1, 32, 512, 128), (1, 10, 1024, 64), (1, 32, 1024, 128)]


def main(argv: list[str] | None = None) -> int:
    args = parse(__doc__, argv)
    torch.manual_seed(0)
    rows = []
    with torch.inference_mode():
        for b, h, n, d in SHAPES:
            qkv = torch.randn(b, n, 3 * h * d)
            q, k, v = (t.view(b, n, h, d).transpose(1, 2) for t in qkv.split(h * d, dim=-1))
            fns = {"sdpa": lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                   "kernel": lambda q=q, k=k, v=v: kernels.causal_attention(q, k, v)}
            t = round_robin_times(fns, torch.device("cpu"), warmup=args.warmup, runs=args.runs)
            ratios = [a / c for a, c in zip(t["sdpa"], t["kernel"])]
            row = {"batch": b, "heads": h, "tokens": n, "head_dim": d,
                   "sdpa_ms": statistics.median(t["sdpa"]) * 1e3, "kernel_ms": statistics.median(t["kernel"]) * 1e3,
                   "sdpa_over_kernel": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
            rows.append(row)
            print(f"B {b} heads {h:2d} N {n:4d} D {d:3d}: SDPA {row['sdpa_ms']:8.3f} ms, kernel "
                  f"{row['kernel_ms']:8.3f} ms, {row['sdpa_over_kernel']:.2f}x [{row['min']:.2f}-{row['max']:.2f}]")
    if args.json:
        write_json(args.json, {"meta": meta(args), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
