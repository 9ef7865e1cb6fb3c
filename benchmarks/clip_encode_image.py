"""``encode_image`` throughput: vitlab's CLIP against open_clip's, same weights, paired timing in one process.

open_clip's random-init model (``open_clip.create_model(NAME, pretrained=None)``, no download) is loaded into
vitlab's twin through ``checkpoint_path=`` (the embeddings are checked equal first). Both run eager under
``torch.no_grad()`` (CPU fp32, or CUDA bf16 autocast with ``--device cuda --amp bf16``); ``vitlab.optimize`` of
the image tower is timed beside them on CPU (its choice measured on this batch). Calls alternate in round robin
(the order reversed every other run); each ratio is the median over runs of the paired ratio open_clip time /
ours (> 1: ours is faster), with min, max and quartiles.

    python benchmarks/clip_encode_image.py --model clip_vit_base_patch16 --batch-size 8 \\
        --json docs/bench/clip_encode_image_cpu_fp32.json
    python benchmarks/clip_encode_image.py --device cuda --amp bf16 --batch-size 256 \\
        --json docs/bench/clip_encode_image_cuda_bf16.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import tempfile
from pathlib import Path


def _stats(ratios: list[float]) -> dict:
    r = sorted(ratios)
    q = statistics.quantiles(r, n=4) if len(r) >= 2 else [r[0], r[0], r[0]]
    return dict(median=round(statistics.median(r), 4), min=round(r[0], 4), max=round(r[-1], 4),
                q1=round(q[0], 4), q3=round(q[2], 4), n=len(r))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="clip_vit_base_patch16")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--amp", default="none", choices=["none", "bf16"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--no-optimize", action="store_true", help="skip vitlab.optimize (CPU)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import open_clip
    import torch

    import vitlab
    from vitlab._io import atomic_write
    from vitlab.timing import round_robin_times

    if args.threads:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    torch.manual_seed(0)
    oc_name = vitlab.get_model_config(args.model).extra["openclip"]
    ref = open_clip.create_model(oc_name, pretrained=None).eval()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "w.pt"
        torch.save(ref.state_dict(), path)
        ours = vitlab.create_model(args.model, checkpoint_path=str(path)).eval()
    ref, ours = ref.to(dev), ours.to(dev)
    x = torch.randn(args.batch_size, 3, 224, 224, device=dev)
    amp = torch.autocast(dev.type, dtype=torch.bfloat16) if args.amp == "bf16" else contextlib.nullcontext()
    with torch.no_grad():
        diff = (ours.encode_image(x) - ref.encode_image(x)).abs().max().item()
    fns = {"vitlab": lambda: ours.encode_image(x), "open_clip": lambda: ref.encode_image(x)}
    if dev.type == "cpu" and args.amp == "none" and not args.no_optimize:
        fast = vitlab.optimize.optimize(ours.visual, x, tune=True)
        with torch.no_grad():
            diff_opt = (fast(x) - ours.encode_image(x)).abs().max().item()
        fns["vitlab.optimize"] = lambda: fast(x)
    else:
        diff_opt = None
    with torch.no_grad(), amp:
        times = round_robin_times(fns, dev, args.warmup, args.runs)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratios = {f"open_clip/{k}": _stats([o / t for o, t in zip(times["open_clip"], times[k])])
              for k in fns if k != "open_clip"}
    out = {"model": args.model, "open_clip": oc_name, "open_clip_version": open_clip.__version__,
           "torch": torch.__version__, "device": str(dev) if dev.type == "cpu" else torch.cuda.get_device_name(dev),
           "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
           "batch_size": args.batch_size, "amp": args.amp, "warmup": args.warmup, "runs": args.runs,
           "max_abs_diff_vs_open_clip_fp32": diff, "max_abs_diff_optimize": diff_opt,
           "median_ms": {k: round(v * 1e3, 2) for k, v in med.items()},
           "img_per_s": {k: round(args.batch_size / v, 2) for k, v in med.items()}, "ratios": ratios}
    print(json.dumps(out, indent=2))
    if args.json:
        atomic_write(args.json, (json.dumps(out, indent=2) + "\n").encode())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
