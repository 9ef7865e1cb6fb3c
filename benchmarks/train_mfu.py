"""Training throughput and model FLOPs utilisation (MFU, PaLM: Chowdhery et al., 2022, Appendix B) of one short
``vitlab.train.fit`` run: images/s, tokens/s, step time, data-wait share, MFU and peak memory as the run's
``summary.json`` reports them (:mod:`vitlab.train.mfu`), with the steps of the first epoch's warm-up left out
(``--skip`` steps: compilation, allocator growth).

    python benchmarks/train_mfu.py                                      # ViT-B/16 on synthetic images
    python benchmarks/train_mfu.py --model vit_base_patch16_224 --amp bf16 --batch-size 256 --steps 60
    python benchmarks/train_mfu.py --data wds:/data/shards/train-{0000..0063}.tar --workers 8

Synthetic data (``fake``: random images made in the loader) gives the GPU's ceiling; the same run on real data
(an image folder, WebDataset shards) shows what the input pipeline costs (``data_wait``). Prints one JSON object;
``--out FILE`` writes it too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="vit_base_patch16_224")
    p.add_argument("--data", default="fake", help="a dataset spec (default: synthetic images at the model's size)")
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--steps", type=int, default=40, help="optimiser steps (synthetic data: one epoch of them)")
    p.add_argument("--skip", type=int, default=10, help="first steps left out of the figures")
    p.add_argument("--amp", default="bf16", choices=["none", "bf16", "fp16"])
    p.add_argument("--compile", action="store_true")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    from vitlab.train import TrainConfig, fit, read_metrics

    data = {"dataset": args.data, "num_workers": args.workers, "img_size": args.img_size}
    if args.data == "fake":
        data.update(fake_num_samples=args.batch_size * args.steps + 1, fake_img_size=args.img_size,
                    fake_num_classes=1000)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = TrainConfig.for_task("classify", model=args.model, data=data, epochs=1, batch_size=args.batch_size,
                                   amp=args.amp, compile=args.compile, device=args.device, threads=args.threads,
                                   warmup_epochs=0.0, quiet=True, output_dir=str(Path(tmp) / "run"))
        summary = fit(cfg)
        rows = read_metrics(Path(tmp) / "run", "step")
    steady = rows[args.skip:] or rows
    keys = ("img_per_s", "tokens_per_s", "step_time_s", "data_wait", "mfu")
    result = {"model": args.model, "data": args.data, "batch_size": args.batch_size, "amp": args.amp,
              "compile": args.compile, "device": summary["device"], "steps": len(rows),
              "steps_measured": len(steady),
              **{k: statistics.median(r[k] for r in steady) for k in keys if k in steady[0]},
              **{k: summary[k] for k in ("gmacs_per_image", "tokens_per_image", "peak_tflops", "peak_source",
                                         "peak_mem_allocated_gb", "peak_mem_reserved_gb", "peak_rss_gb")
                 if k in summary}}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
