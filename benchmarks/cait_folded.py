"""CaiT's talking-heads attention, direct form (the model) against the folded form (``vitlab.optimize.cait``):
inference time of the whole model, paired in one process, and the largest difference of the outputs.

The folded form computes the same function as one fused SDPA call over h heads of width C = h d (Touvron et al.,
"Going deeper with Image Transformers", ICCV 2021, Sec. 2; Shazeer et al., "Talking-Heads Attention", 2020): 4x
the attention MACs, but no (B, h, N, N) map. Calls alternate (the order reversed every other run); the ratio is
the median over runs of direct time / folded time (> 1: folding is faster), with min and max.

    python benchmarks/cait_folded.py --device cuda --amp bf16 --batch-size 64 --json cait_folded_cuda.json
    python benchmarks/cait_folded.py --batch-size 8 --img-size 224         # CPU, fp32
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys

import torch

import vitlab
from vitlab.optimize.cait import fold_talking_heads
from vitlab.timing import check_counts, paired_ratio, round_robin_times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="cait_xxs24_224")
    ap.add_argument("--img-size", type=int, default=224)
    ap.add_argument("--depth", type=int, default=None, help="self-attention blocks (default: the model's)")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--amp", default="none", choices=["none", "bf16"])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    check_counts(args.batch_size, args.warmup, args.runs)
    device = torch.device(args.device)
    kw = {"img_size": args.img_size} | ({"depth": args.depth} if args.depth else {})
    torch.manual_seed(0)
    direct = vitlab.create_model(args.model, **kw).to(device).eval()
    folded = vitlab.create_model(args.model, **kw).to(device).eval()
    folded.load_state_dict(direct.state_dict())
    n = fold_talking_heads(folded)
    x = torch.randn(args.batch_size, 3, args.img_size, args.img_size, device=device)
    amp = torch.autocast(device.type, torch.bfloat16) if args.amp == "bf16" else contextlib.nullcontext()

    def run(m):
        def call():
            with torch.no_grad(), amp:
                return m(x)
        return call

    with torch.no_grad(), amp:
        diff = float((direct(x).float() - folded(x).float()).abs().max())
    times = round_robin_times({"direct": run(direct), "folded": run(folded)}, device, args.warmup, args.runs)
    med, lo, hi = paired_ratio(times, "folded", "direct")
    row = dict(model=args.model, img_size=args.img_size, batch_size=args.batch_size, device=str(device),
               amp=args.amp, folded_modules=n, max_abs_diff=diff,
               direct_s=statistics.median(times["direct"]), folded_s=statistics.median(times["folded"]),
               speedup_median=round(med, 4), speedup_min=round(lo, 4), speedup_max=round(hi, 4),
               torch=torch.__version__, machine=platform.processor() or platform.machine(),
               gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None)
    print(json.dumps(row, indent=2))
    if args.json:
        from vitlab._io import write_json

        write_json(args.json, row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
