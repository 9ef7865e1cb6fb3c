"""``vitlab train``, ``vitlab eval`` and ``vitlab predict``: parse, build a ``TrainConfig``, call ``vitlab.train``.

    vitlab train                                   the default model on digits, on the CPU
    vitlab train --model deit_tiny_patch16_224 --data imagefolder:~/data/pets --epochs 30 --amp bf16
    vitlab train --config cfg.yaml --lr 1e-3 --data.img_size 16 --model_kwargs.depth 6     (--key value overrides)
    vitlab train --resume runs/RUN                 continue where the last checkpoint left off
    torchrun --nproc-per-node 2 -m vitlab train --strategy ddp ...
    vitlab eval --checkpoint runs/RUN --data digits
    vitlab predict --checkpoint runs/RUN img1.png img2.png --topk 3
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vitlab._console import console


class _OverrideParser(argparse.ArgumentParser):
    """Keeps unknown ``--key value`` pairs as config overrides instead of rejecting them."""

    def parse_known_args(self, args=None, namespace=None):
        ns, extra = super().parse_known_args(args, namespace)
        ns.overrides = list(getattr(ns, "overrides", None) or []) + list(extra)
        return ns, []


# named flag -> TrainConfig key (dotted for nested fields)
_FLAGS = {
    "model": "model", "data": "data.dataset", "epochs": "epochs", "batch_size": "batch_size", "lr": "lr",
    "output_dir": "output_dir", "strategy": "strategy", "amp": "amp", "device": "device", "seed": "seed",
    "ema_decay": "ema_decay", "img_size": "data.img_size", "workers": "data.num_workers",
    "teacher": "distill.teacher", "distill": "distill.kind", "accum_steps": "accum_steps", "threads": "threads",
    "stop_after": "stop_after",
}
_SWITCHES = {"quiet": "quiet", "compile": "compile", "channels_last": "channels_last",
             "grad_checkpointing": "grad_checkpointing", "download": "data.download",
             "skip_bad_images": "data.skip_bad_images"}


def config_from_args(args):
    """The TrainConfig of a ``vitlab train`` command line (defaults < --config < flags < --key value)."""
    from vitlab.train.config import TrainConfig, parse_overrides

    if args.resume:
        run = Path(args.resume)
        if not (run / "config.yaml").is_file():
            raise FileNotFoundError(f"no run to resume at {run} (expected {run / 'config.yaml'})")
        cfg = TrainConfig.load(run / "config.yaml")
    elif args.config:
        cfg = TrainConfig.load(args.config)
    else:
        cfg = TrainConfig()
    over: dict[str, object] = {}
    for flag, key in _FLAGS.items():
        v = getattr(args, flag)
        if v is not None:
            over[key] = v
    for flag, key in _SWITCHES.items():
        if getattr(args, flag):
            over[key] = True
    if args.data and cfg.data.dataset != args.data:
        # another dataset: start from its own defaults, not the previous dataset's resolved knobs
        from vitlab.data import DataConfig

        cfg.data = DataConfig(dataset=args.data, batch_size=cfg.data.batch_size, seed=cfg.data.seed)
    over.update(parse_overrides(args.overrides))
    cfg = cfg.with_overrides(over)
    if args.resume:
        cfg.resume = str(args.resume)
        cfg.output_dir = str(args.resume)
    return cfg


def cmd_train(args) -> int:
    from vitlab.train import fit

    cfg = config_from_args(args)
    if args.print_config:
        print(cfg.to_yaml(), end="")
        return 0
    summary = fit(cfg)
    if args.json:
        print(json.dumps(summary, indent=2))
    return 0


def cmd_eval(args) -> int:
    from vitlab.train import evaluate

    r = evaluate(args.checkpoint, args.data, split=args.split, output_dir=args.output_dir, weights=args.weights,
                 batch_size=args.batch_size, device=args.device)
    if args.json:
        print(json.dumps({k: v for k, v in r.items() if k != "confusion_matrix"}, indent=2))
        return 0
    from rich.table import Table

    console.print(f"{r['model']} on {r['dataset']} ({r['split']}, {r['num_images']} images): "
                  f"top-1 {r['top1']:.2f}%  top-5 {r['top5']:.2f}%  loss {r['loss']:.4f}", highlight=False)
    t = Table(title="per-class top-1 (%)")
    t.add_column("class")
    t.add_column("top-1", justify="right")
    for name, acc in r["per_class_top1"].items():
        t.add_row(name, f"{acc:.1f}")
    console.print(t)
    console.print(f"written: {r['json_path']}  {r['png_path']}", highlight=False, soft_wrap=True)
    return 0


def cmd_predict(args) -> int:
    from vitlab.train import predict

    rows = predict(args.checkpoint, args.images, topk=args.topk, weights=args.weights, device=args.device)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        tops = "  ".join(f"{label} {p:.3f}" for label, p in r["top"])
        print(f"{r['image']}: {tops}")
    return 0


def register(sub) -> None:
    old = sub._parser_class
    sub._parser_class = _OverrideParser
    try:
        t = sub.add_parser("train", help="train a model (default: the default model on digits, on the CPU)",
                           description="Train a model. Any TrainConfig field can be set with --key value "
                                       "(dotted for nested: --data.img_size 16, --distill.alpha 0.5).",
                           allow_abbrev=False)
    finally:
        sub._parser_class = old
    t.add_argument("--model", default=None, help="a registered model (default: vit_pico_patch8_32)")
    t.add_argument("--data", default=None, help="digits | fake | imagefolder:PATH | cifar10:PATH | cifar100:PATH")
    t.add_argument("--config", default=None, help="a YAML TrainConfig (e.g. a run's config.yaml)")
    t.add_argument("--epochs", type=int, default=None)
    t.add_argument("--batch-size", type=int, default=None, help="per process")
    t.add_argument("--lr", type=float, default=None, help="learning rate at global batch 512 (scaled linearly)")
    t.add_argument("--output-dir", default=None, help="the run directory (default: runs/<model>-<data>-<time>)")
    t.add_argument("--resume", default=None, metavar="RUN_DIR", help="continue a run from its last checkpoint")
    t.add_argument("--stop-after", type=int, default=None, metavar="EPOCH",
                   help="end this invocation after EPOCH (resume later)")
    t.add_argument("--strategy", default=None, choices=["none", "ddp", "fsdp"], help="under torchrun")
    t.add_argument("--amp", default=None, choices=["none", "bf16", "fp16"])
    t.add_argument("--device", default=None, help="auto | cpu | cuda | cuda:N")
    t.add_argument("--seed", type=int, default=None)
    t.add_argument("--ema-decay", type=float, default=None)
    t.add_argument("--accum-steps", type=int, default=None)
    t.add_argument("--img-size", type=int, default=None)
    t.add_argument("--workers", type=int, default=None, help="data loader worker processes")
    t.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    t.add_argument("--teacher", default=None, help="distillation teacher: model name, timm:NAME or checkpoint")
    t.add_argument("--distill", default=None, choices=["none", "hard", "soft", "feature"])
    for sw in ("quiet", "compile", "channels-last", "grad-checkpointing", "download", "skip-bad-images"):
        t.add_argument(f"--{sw}", action="store_true")
    t.add_argument("--json", action="store_true", help="print the summary as JSON at the end")
    t.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    t.set_defaults(func=cmd_train)

    e = sub.add_parser("eval", help="evaluate a checkpoint: top-1, top-5, per-class accuracy, confusion matrix")
    e.add_argument("--checkpoint", required=True, help="a run directory, checkpoint directory or .safetensors")
    e.add_argument("--data", default=None, help="default: the data the checkpoint was trained on")
    e.add_argument("--split", default="test", choices=["train", "val", "test"])
    e.add_argument("--output-dir", default=None, help="where eval-<split>.json and confusion-<split>.png go")
    e.add_argument("--weights", default="auto", choices=["auto", "raw", "ema"])
    e.add_argument("--batch-size", type=int, default=256)
    e.add_argument("--device", default="cpu")
    e.add_argument("--json", action="store_true")
    e.set_defaults(func=cmd_eval)

    p = sub.add_parser("predict", help="top-k labels with probabilities for images")
    p.add_argument("--checkpoint", required=True, help="a run directory, checkpoint directory or .safetensors")
    p.add_argument("images", nargs="+", metavar="IMAGE")
    p.add_argument("--topk", type=int, default=5)
    p.add_argument("--weights", default="auto", choices=["auto", "raw", "ema"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_predict)
