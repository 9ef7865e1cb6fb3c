"""The embedded segmentation demo of ``vitlab.dense``: SETR-PUP, Segmenter (mask transformer), DPT and the
ViTDet simple feature pyramid, each trained from scratch by ``vitlab.train.fit`` (``--task segment``) with the
recipe that ``vitlab train --task segment`` defaults to (:meth:`vitlab.dense.tasks.SegmentTask.defaults`: the
offline ``shapes`` scenes, 4 classes, on ``vit_pico_patch4_32``), the same number of optimiser steps for every
head, then scored on the 100 held-out test scenes from one confusion matrix (mIoU, per-class IoU).

    python benchmarks/dense_demo.py                      # writes docs/bench/dense_demo.json
    python benchmarks/dense_demo.py --heads dpt --epochs 8 --threads 2

The budget is counted in optimiser steps (epochs x scenes / batch); the wall time and the process CPU time of
each head's ``fit`` (scene drawing, training, validation and test) are recorded beside the machine's load
average, since a shared machine stretches the wall time but not the CPU time. Decoders are slimmed to the tiny
backbone (64 channels instead of 256; DPT's reassemble widths 32..256).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

# the decoders slimmed to the width-64 backbone; the ViTDet simple feature pyramid reads a plain, globally attending
# backbone (the recipe's: on the 16 x 16 grid of a 64-pixel scene windows cost accuracy, see docs/benchmarks.md)
HEADS = {
    "setr_pup": {"channels": 64},
    "segmenter_mask": {},
    "dpt": {"hidden": [32, 64, 128, 256], "fusion": 64},
    "vitdet_sfp": {"out_channels": 64, "channels": 64, "global_blocks": [0, 1, 2, 3]},
}


def run_head(head: str, args, tmp: str) -> dict:
    from vitlab.train import TrainConfig, fit, read_metrics

    over = {"task_args.head": head, "task_args.head_kwargs": HEADS[head], "threads": args.threads,
            "seed": args.seed, "data.seed": args.seed, "output_dir": str(Path(tmp) / head), "quiet": True}
    for key in ("epochs", "batch_size", "lr"):
        if getattr(args, key) is not None:
            over[key] = getattr(args, key)
    cfg = TrainConfig.for_task("segment").with_overrides(over)
    load0 = os.getloadavg()[0]
    t0, c0 = time.perf_counter(), time.process_time()
    s = fit(cfg)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    rows = read_metrics(s["run_dir"], "epoch")
    from vitlab.train import evaluate

    ev = evaluate(Path(s["run_dir"]) / "last", split="test", output_dir=tmp)  # the weights fit's test score used
    return {"head": head, "head_kwargs": HEADS[head], "params_m": s["params_m"], "test_miou": s["test_miou"],
            "test_pixel_acc": s["test_pixel_acc"], "test_per_class_iou": ev["per_class_iou"],
            "eval_miou": ev["miou"],
            "best_val_miou": s["best_val_miou"], "epochs": cfg.epochs, "batch_size": cfg.batch_size,
            "steps": cfg.epochs * (len_train(cfg) // cfg.batch_size),
            "train_wall_s": sum(r.get("epoch_time_s", 0.0) for r in rows), "wall_s": wall, "cpu_s": cpu,
            "loadavg_1min": [load0, os.getloadavg()[0]],
            "val_miou_curve": [(r["epoch"], r["val_miou"]) for r in rows if r.get("val_miou") is not None]}


def len_train(cfg) -> int:
    return int(cfg.task_args.shapes_train or 800)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", nargs="*", default=list(HEADS), choices=list(HEADS))
    ap.add_argument("--epochs", type=int, default=None, help="default: the recipe's")
    ap.add_argument("--batch_size", type=int, default=None, help="default: the recipe's")
    ap.add_argument("--lr", type=float, default=None, help="at global batch 512 (default: the recipe's)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="docs/bench/dense_demo.json")
    args = ap.parse_args()

    from vitlab.dense.tasks import SegmentTask

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for head in args.heads:
            rows.append(run_head(head, args, tmp))
            print(json.dumps(rows[-1]), flush=True)
    result = {"benchmark": "dense_demo", "recipe": SegmentTask.defaults(), "threads": args.threads, "seed": args.seed,
              "cpu": platform.processor() or platform.machine(), "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    from vitlab._io import atomic_write

    atomic_write(out, (json.dumps(result, indent=2) + "\n").encode())
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
