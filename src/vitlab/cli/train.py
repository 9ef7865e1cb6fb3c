"""``vitlab train``, ``vitlab eval`` and ``vitlab predict``: parse, build a ``TrainConfig``, call ``vitlab.train``.

    vitlab train                                   the default model on digits, on the CPU
    vitlab train --model deit_tiny_patch16_224 --data imagefolder:~/data/pets --epochs 30 --amp bf16
    vitlab train --config cfg.yaml --lr 1e-3 --data.img_size 16 --model_kwargs.depth 6   (flags over the file)
    vitlab train --help                            every TrainConfig / DataConfig / DistillConfig field as a flag
    vitlab train --resume runs/RUN                 continue where the last checkpoint left off
    torchrun --nproc-per-node 2 -m vitlab train --strategy ddp ...
    vitlab eval --checkpoint runs/RUN --data digits
    vitlab predict --checkpoint runs/RUN img1.png img2.png --topk 3
    vitlab predict --onnx model.onnx img1.png                (ONNX Runtime; file from vitlab export)
    vitlab train --task segment --data shapes --model vit_pico_patch4_32 --task_args.head dpt
    vitlab eval --task segment --checkpoint runs/RUN          vitlab predict --task depth --checkpoint RUN a.png
"""

from __future__ import annotations

import json

from vitlab._console import console

# short flags kept from earlier releases (every TrainConfig field also has its own flag)
ALIASES = {"data": "data.dataset", "img_size": "data.img_size", "workers": "data.num_workers",
           "teacher": "distill.teacher", "distill": "distill.kind", "download": "data.download",
           "skip_bad_images": "data.skip_bad_images"}


def config_from_args(args):
    """The TrainConfig of a ``vitlab train`` command line: defaults < ``--config`` < flags. With ``--resume`` the
    run's own config.yaml replaces the defaults (:func:`vitlab.train.trainer.resume_config`)."""
    from vitlab.data import DataConfig
    from vitlab.train.config import TrainConfig, parse_overrides
    from vitlab.train.trainer import resume_config

    cfg = TrainConfig.load(args.config) if args.config else TrainConfig()
    over = {k: v for k, v in vars(args).items() if k in args.config_keys}
    if not args.config and not over.get("resume"):
        cfg = cfg.with_overrides(task_recipe(over.get("task", cfg.task), over, parse_overrides(args.extra)))
    new_data = over.get("data.dataset")
    if new_data is not None and new_data != cfg.data.dataset:
        # another dataset: start from its own defaults, not the previous dataset's resolved knobs
        cfg.data = DataConfig(dataset=new_data, batch_size=cfg.data.batch_size, seed=cfg.data.seed)
    over.update(parse_overrides(args.extra))  # free dict keys (--model_kwargs.depth 6); unknown keys fail here
    cfg = cfg.with_overrides(over)
    if cfg.resume:
        cfg = resume_config(cfg)
    return cfg


def task_recipe(task: str, flags: dict, extra: dict) -> dict:
    """The defaults a task brings in place of the classification ones (its class attribute ``recipe``: dotted
    TrainConfig keys, e.g. ``--task segment``'s embedded demo recipe). Its ``task_args.*`` keys travel together
    (the decoder options belong to its head): they are left out when the command line names ``task_args.head``
    or ``task_args.head_kwargs``."""
    from vitlab.train.task import create_task, list_tasks

    if task not in list_tasks():  # an unknown task is refused later, by the command that knows its own words
        return {}
    recipe = dict(getattr(create_task(task), "recipe", {}))
    if any(k.split(".")[:2] in (["task_args", "head"], ["task_args", "head_kwargs"]) for k in (*flags, *extra)):
        recipe = {k: v for k, v in recipe.items() if not k.startswith("task_args.")}
    return recipe


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


def _task_of(args) -> str:
    """The checkpoint's task (its metadata: dense runs record 'segment' / 'depth'); --task must agree."""
    from vitlab.train.checkpoint import load_weights

    task = load_weights(args.checkpoint, weights=args.weights)[1].get("task", "classify")
    if args.task is not None and args.task != task:
        raise ValueError(f"{args.checkpoint} is a {task} checkpoint; --task {args.task} does not apply")
    return task


def cmd_eval(args) -> int:
    if _task_of(args) != "classify":
        return _dense_eval(args)
    from vitlab.train import evaluate

    r = evaluate(args.checkpoint, args.data, split=args.split, output_dir=args.output_dir, weights=args.weights,
                 batch_size=args.batch_size, device=args.device, optimize=not args.no_optimize)
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


def _dense_eval(args) -> int:
    from vitlab.dense.infer import evaluate

    r = evaluate(args.checkpoint, args.data, split=args.split, output_dir=args.output_dir, weights=args.weights,
                 device=args.device)
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    head = f"{r['model']} on {r['dataset']} ({r['split']}, {r['num_images']} images): "
    if r["task"] == "segment":
        console.print(head + f"mIoU {r['miou']:.4f}  pixel acc {r['pixel_acc']:.4f}", highlight=False)
        for name, iou in r["per_class_iou"].items():
            console.print(f"  {name:<20} IoU {'-' if iou is None else f'{iou:.4f}'}", highlight=False)
    else:
        console.print(head + "  ".join(f"{k} {r[k]:.4f}" for k in ("abs_rel", "rmse", "log10", "delta1", "delta2",
                                                                   "delta3")), highlight=False)
    console.print(f"written: {r['json_path']}", highlight=False, soft_wrap=True)
    return 0


def _dense_predict(args) -> int:
    from vitlab.dense.infer import predict

    rows = predict(args.checkpoint, args.images, output_dir=args.output_dir or "predictions", weights=args.weights,
                   device=args.device)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        print(f"{r['image']}: " + "  ".join(v for k, v in r.items() if k in ("overlay", "mask", "depth", "depth16")))
    return 0


def cmd_predict(args) -> int:
    if (args.checkpoint is None) == (args.onnx is None):
        raise ValueError("predict needs exactly one of --checkpoint RUN and --onnx FILE")
    if args.onnx is not None:  # ONNX Runtime, preprocessing from the file's metadata (vitlab.export)
        from vitlab.export import predict_onnx

        rows = predict_onnx(args.onnx, args.images, topk=args.topk)
    elif _task_of(args) != "classify":
        return _dense_predict(args)
    else:
        from vitlab.train import predict

        rows = predict(args.checkpoint, args.images, topk=args.topk, weights=args.weights, device=args.device,
                       optimize=not args.no_optimize)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        tops = "  ".join(f"{label} {p:.3f}" for label, p in r["top"])
        print(f"{r['image']}: {tops}")
    return 0


def add_config_command(sub, name: str, metavars: dict | None = None, **parser_kw):
    """A subcommand whose flags are every TrainConfig field (plus --config, --json, --print_config and the short
    aliases): ``vitlab train``, and ``vitlab pretrain`` (vitlab.cli.pretrain). Returns the parser."""
    from vitlab.cli._dataclass_args import ConfigParser, add_aliases, add_dataclass_arguments
    from vitlab.train.config import TrainConfig

    old = sub._parser_class
    sub._parser_class = ConfigParser
    try:
        t = sub.add_parser(name, allow_abbrev=False, **parser_kw)
    finally:
        sub._parser_class = old
    t.add_argument("--config", default=None, metavar="FILE",
                   help="a YAML TrainConfig (e.g. a run's config.yaml); flags apply on top")
    t.add_argument("--json", action="store_true", help="print the summary as JSON at the end")
    t.add_argument("--print_config", action="store_true", help="print the resolved config as YAML and exit")
    keys = add_dataclass_arguments(t, TrainConfig, metavars=metavars)
    add_aliases(t, ALIASES, keys)
    t.set_defaults(config_keys=keys)
    return t


def register(sub) -> None:
    from vitlab.train.task import list_tasks

    t = add_config_command(
        sub, "train", metavars={"task": "{" + ",".join(list_tasks()) + "}"},
        help="train a model (default: the default model on digits, on the CPU)",
        description="Train a model. Every TrainConfig field is a flag (dotted for nested configs: --data.img_size 16, "
                    "--distill.alpha 0.5; dashes or underscores); precedence: defaults < --config FILE < flags.",
        usage="vitlab train [--config FILE] [--resume RUN] [--FIELD VALUE ...] [--data.FIELD VALUE ...] "
              "[--distill.FIELD VALUE ...]")
    t.set_defaults(func=cmd_train)

    e = sub.add_parser("eval", help="evaluate a checkpoint: top-1, top-5, per-class accuracy, confusion matrix")
    e.add_argument("--checkpoint", required=True, help="a run directory, checkpoint directory or .safetensors")
    e.add_argument("--data", default=None, help="default: the data the checkpoint was trained on")
    e.add_argument("--split", default="test", choices=["train", "val", "test"])
    e.add_argument("--output-dir", default=None, help="where eval-<split>.json and confusion-<split>.png go")
    e.add_argument("--weights", default="auto", choices=["auto", "raw", "ema"])
    e.add_argument("--batch-size", type=int, default=256)
    e.add_argument("--device", default="cpu")
    e.add_argument("--no-optimize", action="store_true",
                   help="run the model as built (eager) instead of through vitlab.optimize")
    e.add_argument("--task", default=None, choices=["classify", "segment", "depth"],
                   help="default: the checkpoint's; segment / depth: sliding windows, mIoU or depth errors")
    e.add_argument("--json", action="store_true")
    e.set_defaults(func=cmd_eval)

    p = sub.add_parser("predict", help="top-k labels with probabilities for images")
    p.add_argument("--checkpoint", default=None, help="a run directory, checkpoint directory or .safetensors")
    p.add_argument("--onnx", default=None, metavar="FILE",
                   help="instead of --checkpoint: an ONNX file from vitlab export, run with ONNX Runtime")
    p.add_argument("images", nargs="+", metavar="IMAGE")
    p.add_argument("--topk", type=int, default=5)
    p.add_argument("--weights", default="auto", choices=["auto", "raw", "ema"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--no-optimize", action="store_true",
                   help="run the model as built (eager) instead of through vitlab.optimize")
    p.add_argument("--task", default=None, choices=["classify", "segment", "depth"],
                   help="default: the checkpoint's; segment: colour overlays + index masks; depth: depth maps "
                        "(PNG, under --output-dir)")
    p.add_argument("--output-dir", default=None, help="segment / depth: where the PNGs go (default predictions/)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_predict)
