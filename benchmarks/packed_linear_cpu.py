"""vitlab's packed fp32 GEMM (:func:`vitlab.optimize.kernels.packed_linear`) against the two packed kernels Inductor
gives a frozen fp32 linear layer: MKL's packed sgemm (``mkl._mkl_linear``) and oneDNN's matmul
(``mkldnn._linear_pointwise``), each with its weight packed once, as in a compiled graph. The weight shapes are
``llama_100m``'s (dim 640, SwiGLU hidden 1,792, vocabulary 32,000; Touvron et al., 2023): the fused q/k/v and
output projections, SwiGLU's fused gate-and-up and down projections, and the output layer; the rows are a
batch-8 prompt of 128 tokens (1,024), a batch-8 decoding step (8) and a batch-1 one (1).

Calls alternate (round robin, order reversed every other run) after warm-up; each ratio is the library's time /
vitlab's in the same run (> 1: vitlab's is faster), summarised by its median and min-max. Run it once per ISA:

    OMP_NUM_THREADS=2 python benchmarks/packed_linear_cpu.py --json packed_linear_cpu.json
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 OMP_NUM_THREADS=2 \\
        python benchmarks/packed_linear_cpu.py --json packed_linear_cpu_avx2.json
"""

from __future__ import annotations

import statistics

import torch
from _kernel_bench import meta, parse

from vitlab._io import write_json
from vitlab.optimize import kernels
from vitlab.optimize.llama import packed_gemms_available
from vitlab.timing import round_robin_times

LAYERS = {"qkv": (640, 1920), "proj": (640, 640), "fc1": (640, 3584), "fc2": (1792, 640), "lm_head": (640, 32000)}
ROWS = (1024, 8, 1)


def main(argv: list[str] | None = None) -> int:
    args = parse(__doc__, argv)
    if not packed_gemms_available():
        raise SystemExit("this torch build lacks MKL or oneDNN: there is no packed library kernel to compare with")
    torch.manual_seed(0)
    rows = []
    code = kernels.isa_code()
    with torch.inference_mode():
        for m in ROWS:
            for name, (k, n) in LAYERS.items():
                x, w = torch.randn(m, k), torch.randn(n, k)
                mkl, dnn = torch.ops.mkl._mkl_reorder_linear_weight(w, m), torch.ops.mkldnn._reorder_linear_weight(w, m)
                own = kernels.pack_linear_weight(w)
                fns = {"mkl": lambda x=x, p=mkl, w=w, m=m: torch.ops.mkl._mkl_linear(x, p, w, None, m),
                       "onednn": lambda x=x, p=dnn: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""),
                       "vitlab": lambda x=x, p=own, n=n: torch.ops.vitlab_kernels.packed_linear(x, p, None, n, code)}
                t = round_robin_times(fns, torch.device("cpu"), warmup=args.warmup, runs=args.runs)
                flop = 2 * m * k * n
                row = {"layer": name, "rows": m, "in": k, "out": n}
                for lib in fns:
                    row[f"{lib}_ms"] = statistics.median(t[lib]) * 1e3
                    row[f"{lib}_gflops"] = flop / statistics.median(t[lib]) / 1e9
                for lib in ("mkl", "onednn"):
                    ratios = [a / b for a, b in zip(t[lib], t["vitlab"])]
                    row[f"{lib}_over_vitlab"] = statistics.median(ratios)
                    row[f"{lib}_over_vitlab_range"] = [min(ratios), max(ratios)]
                rows.append(row)
                print(f"{name:8s} {m:5d} x {k:4d} -> {n:5d}: GFLOP/s MKL {row['mkl_gflops']:6.1f}, oneDNN "
                      f"{row['onednn_gflops']:6.1f}, vitlab {row['vitlab_gflops']:6.1f}; vitlab faster than MKL "
                      f"{row['mkl_over_vitlab']:.2f}x, than oneDNN {row['onednn_over_vitlab']:.2f}x "
                      f"[{row['onednn_over_vitlab_range'][0]:.2f}-{row['onednn_over_vitlab_range'][1]:.2f}]")
    if args.json:
        write_json(args.json, {"benchmark": "packed_linear_cpu", "meta": meta(args), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
