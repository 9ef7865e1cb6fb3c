"""The embedded segmentation demo of ``vitlab.dense``: SETR-PUP, Segmenter (mask transformer), DPT and the
ViTDet simple feature pyramid, each trained from scratch by ``vitlab.train.fit`` (``--task segment``) on the
offline ``shapes`` scenes (scikit-image / scikit-learn shapes on textures, 4 classes) with the same backbone
(``vit_pico_patch4_32``: width 64, 4 blocks, patch 4), crop 64, then scored on the 100 test scenes (96 x 96,
sliding windows) from one confusion matrix.

    python benchmarks/dense_demo.py                      # writes docs/bench/dense_demo.json
    python benchmarks/dense_demo.py --epochs 2 --threads 2

Decoders are slimmed to the tiny backbone (64 channels instead of 256; DPT's reassemble widths 32..256).
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

HEADS = {
    "setr_pup": {"channels": 64},
    "segmenter_mask": {},
    "dpt": {"hidden": [32, 64, 128, 256], "fusion": 64},
    "vitdet_sfp": {"out_channels": 64, "channels": 64, "window_size": 8},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", nargs="*", default=list(HEADS))
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--train", type=int, default=800, help="training scenes")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1.6e-2, help="at global batch 512 (scaled linearly)")
    ap.add_argument("--out", default="docs/bench/dense_demo.json")
    args = ap.parse_args()

    from vitlab.train import TrainConfig, fit

    rows, t_all = [], time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for head in args.heads:
            cfg = TrainConfig.from_dict({
                "task": "segment", "model": "vit_pico_patch4_32", "data": {"dataset": "shapes", "img_size": 64},
                "task_args": {"head": head, "head_kwargs": HEADS[head], "shapes_train": args.train},
                "epochs": args.epochs, "batch_size": args.batch_size, "lr": args.lr, "warmup_epochs": 0.3,
                "drop_path": 0.0, "threads": args.threads, "output_dir": str(Path(tmp) / head), "quiet": True})
            t0, c0 = time.perf_counter(), time.process_time()
            s = fit(cfg)
            rows.append({"head": head, "params_m": s["params_m"], "test_miou": s["test_miou"],
                         "test_pixel_acc": s["test_pixel_acc"], "best_val_miou": s["best_val_miou"],
                         "wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0})
            print(json.dumps(rows[-1]), flush=True)
    result = {"benchmark": "dense_demo", "backbone": "vit_pico_patch4_32", "epochs": args.epochs,
              "train_scenes": args.train, "threads": args.threads, "batch_size": args.batch_size,
              "total_wall_s": time.perf_counter() - t_all, "cpu": platform.processor() or platform.machine(),
              "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
