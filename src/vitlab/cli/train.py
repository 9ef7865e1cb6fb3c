"""``vitlab train``, ``vitlab eval`` and ``vitlab predict``: parse, build a ``TrainConfig``, call ``vitlab.train``.

    vitlab train                                   the default model on digits, on the CPU
    vitlab train --model deit_tiny_patch16_224 --data imagefolder:~/data/pets --epochs 30 --amp bf16
    vitlab train --config cfg.yaml --lr 1e-3 --data.img_size 16 --model_kwargs.depth 6   (flags over the file)
    vitlab train --task segment --help             the engine's flags and the segment task's --task_args.*
    vitlab train --resume runs/RUN                 continue where the last checkpoint left off
    torchrun --nproc-per-node 2 -m vitlab train --strategy ddp ...
    vitlab eval --checkpoint runs/RUN              the run's task scores it (top-1, mIoU, zero-shot, k-NN ...)
    vitlab predict --checkpoint runs/RUN img1.png img2.png --topk 3
    vitlab predict --onnx model.onnx img1.png                (ONNX Runtime; file from vitlab export)
    vitlab predict --checkpoint runs/VQA img.png --prompt "how many cats are there"   (a vqa run answers)

The config is built exactly as :meth:`vitlab.train.TrainConfig.for_task` builds it in Python: the engine's
defaults < the task's recipe < ``--config FILE`` < flags. ``eval`` and ``predict`` dispatch on the checkpoint's
run record: no task is named here.
"""

from __future__ import annotations

import json

from vitlab.cli._dataclass_args import ConfigParser, device_arg

# short flags of every task (a task adds its own through Task.aliases)
ALIASES = {"data": "data.dataset", "img_size": "data.img_size", "workers": "data.num_workers"}


def peek(tokens: list[str], *flags: str) -> str | None:
    """The value of the last of ``flags`` in ``tokens`` (``--task segment`` or ``--task=segment``), else None."""
    names = {f.lstrip("-").replace("-", "_") for f in flags}
    found = None
    for i, tok in enumerate(tokens):
        key, eq, value = tok.partition("=")
        if key.startswith("--") and key[2:].replace("-", "_") in names:
            found = value if eq else (tokens[i + 1] if i + 1 < len(tokens) else None)
    return found


def task_of(tokens: list[str]) -> str:
    """The task a ``vitlab train`` command line runs: ``--task`` / ``--method``, else the ``--config`` file's or
    the resumed run's, else the default."""
    from pathlib import Path

    import yaml

    from vitlab.train.config import DEFAULT_TASK

    task = peek(tokens, "--task", "--method")
    if task:
        return task
    for flag, suffix in (("--config", ""), ("--resume", "config.yaml")):
        path = peek(tokens, flag)
        if path:
            file = Path(path) / suffix if suffix else Path(path)
            try:
                saved = yaml.safe_load(file.read_text()) if file.is_file() else None
            except (OSError, yaml.YAMLError):
                saved = None  # reported by the config loader, with the file's name
            if isinstance(saved, dict) and isinstance(saved.get("task"), str):
                return saved["task"]
    return DEFAULT_TASK


class TaskConfigParser(ConfigParser):
    """``vitlab train`` / ``pretrain``: before parsing, adds the flags of the task the command line names
    (``--task_args.NAME``, the task's short flags), so ``--help`` lists them and they are typed."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.task_added = False

    def parse_known_args(self, args=None, namespace=None):
        import sys

        from vitlab.cli._dataclass_args import add_aliases, add_dataclass_arguments
        from vitlab.train.task import task_class

        tokens = list(sys.argv[1:] if args is None else args)
        if not self.task_added:
            self.task_added = True
            try:
                cls = task_class(task_of(tokens))
            except ValueError as e:  # vitlab pretrain names its tasks methods
                word = "method" if peek(tokens, "--method") else "task"
                raise ValueError(str(e).replace("unknown task", f"unknown {word}", 1)) from None
            keys = add_dataclass_arguments(self, cls.Args, prefix="task_args.",
                                           title=f"task_args: the {cls.name} task's options ({cls.Args.__name__})")
            if cls.aliases:
                add_aliases(self, cls.aliases, keys, title=f"short flags of the {cls.name} task")
            self.set_defaults(config_keys={**self.get_default("config_keys"), **keys})
        return super().parse_known_args(tokens, namespace)


def config_from_args(args):
    """The TrainConfig of a ``vitlab train`` command line: for_task(task) < ``--config FILE`` < flags. With
    ``--resume`` the run's own config.yaml replaces the defaults (:func:`vitlab.train.trainer.resume_config`)."""
    from vitlab.train.config import TrainConfig, parse_overrides
    from vitlab.train.trainer import resume_config

    over = {k: v for k, v in vars(args).items() if k in args.config_keys}
    over.update(parse_overrides(args.extra))  # free dict keys (--model_kwargs.depth 6); unknown keys fail here
    if args.config:
        cfg = TrainConfig.load(args.config)
        if "task" in over and over["task"] != cfg.task:
            raise ValueError(f"{args.config} is a {cfg.task} config; --task {over['task']} does not apply to it")
        cfg = cfg.with_overrides(over)
    elif over.get("resume"):
        cfg = TrainConfig.for_task(task_of(["--resume", over["resume"]])).with_overrides(over)
    else:
        from vitlab.train.config import DEFAULT_TASK

        cfg = TrainConfig.for_task(over.pop("task", DEFAULT_TASK)).with_overrides(over)
    if cfg.resume:
        cfg = resume_config(cfg)
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
                 batch_size=args.batch_size, device=args.device, optimize=not args.no_optimize)
    if args.json:
        print(json.dumps({k: v for k, v in r.items() if k != "confusion_matrix"}, indent=2))
        return 0
    print(r["summary"])
    print("written: " + "  ".join(r.get("files", [])))
    return 0


def cmd_predict(args) -> int:
    if (args.checkpoint is None) == (args.onnx is None):
        raise ValueError("predict needs exactly one of --checkpoint RUN and --onnx FILE")
    if args.topk < 1:
        raise ValueError(f"--topk must be >= 1, got {args.topk}")
    if args.onnx is not None:  # ONNX Runtime, preprocessing from the file's metadata (vitlab.export)
        from vitlab.export import predict_onnx

        rows = predict_onnx(args.onnx, args.images, topk=args.topk)
        for r in rows:
            r["line"] = f"{r['image']}: " + "  ".join(f"{label} {p:.3f}" for label, p in r["top"])
    else:
        from vitlab.train import predict

        rows = predict(args.checkpoint, args.images, output_dir=args.output_dir, topk=args.topk,
                       weights=args.weights, device=args.device, optimize=not args.no_optimize, prompt=args.prompt)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        print(r["line"])
    return 0


def add_config_command(sub, name: str, exclude: tuple[str, ...] = (), **parser_kw):
    """A subcommand whose flags are every TrainConfig field and the task's options (plus --config, --json,
    --print_config and the short flags): ``vitlab train``, and ``vitlab pretrain`` (vitlab.cli.pretrain)."""
    from vitlab.cli._dataclass_args import add_aliases, add_dataclass_arguments
    from vitlab.train.config import TrainConfig

    old = sub._parser_class
    sub._parser_class = TaskConfigParser
    try:
        t = sub.add_parser(name, allow_abbrev=False, **parser_kw)
    finally:
        sub._parser_class = old
    t.add_argument("--config", default=None, metavar="FILE",
                   help="a YAML TrainConfig (e.g. a run's config.yaml); flags apply on top")
    t.add_argument("--json", action="store_true", help="print the summary as JSON at the end")
    t.add_argument("--print_config", action="store_true", help="print the resolved config as YAML and exit")
    keys = add_dataclass_arguments(t, TrainConfig, exclude=("task_args", *exclude),
                                   metavars={"task": "TASK"})
    add_aliases(t, ALIASES, keys)
    t.set_defaults(config_keys={**keys, "task": str})  # --task, or pretrain's --method
    return t


def register(sub) -> None:
    t = add_config_command(
        sub, "train",
        description="Train a model. Every TrainConfig field is a flag (dotted for nested configs: --data.img_size 16; "
                    "dashes or underscores), and so is every option of the task (--task_args.NAME; --task TASK "
                    "--help lists them; vitlab.train.list_tasks() names the tasks); precedence: defaults < the "
                    "task's recipe < --config FILE < flags.",
        usage="vitlab train [--task TASK] [--config FILE] [--resume RUN] [--FIELD VALUE ...] "
              "[--data.FIELD VALUE ...] [--task_args.NAME VALUE ...]")
    t.set_defaults(func=cmd_train)

    e = sub.add_parser("eval")  # the help lines of the commands are vitlab.cli.COMMANDS's
    e.add_argument("--checkpoint", required=True, help="a run directory, checkpoint directory or .safetensors")
    e.add_argument("--data", default=None, help="default: the data the checkpoint was trained on")
    e.add_argument("--split", default="test", choices=["train", "val", "test"])
    e.add_argument("--output-dir", default=None, help="where the results go (default: the run directory)")
    e.add_argument("--weights", default="auto", choices=["auto", "raw", "ema"])
    e.add_argument("--batch-size", type=int, default=256)
    e.add_argument("--device", default="cpu", type=device_arg)
    e.add_argument("--no-optimize", action="store_true",
                   help="run the model as built (eager) instead of through vitlab.optimize")
    e.add_argument("--json", action="store_true")
    e.set_defaults(func=cmd_eval)

    p = sub.add_parser("predict")
    p.add_argument("--checkpoint", default=None, help="a run directory, checkpoint directory or .safetensors")
    p.add_argument("--onnx", default=None, metavar="FILE",
                   help="instead of --checkpoint: an ONNX file from vitlab export, run with ONNX Runtime")
    p.add_argument("images", nargs="+", metavar="IMAGE")
    p.add_argument("--topk", type=int, default=5, help="labels per image (classification, zero-shot)")
    p.add_argument("--prompt", default=None, help="the question a vision-language run answers about each image")
    p.add_argument("--weights", default="auto", choices=["auto", "raw", "ema"])
    p.add_argument("--device", default="cpu", type=device_arg)
    p.add_argument("--no-optimize", action="store_true",
                   help="run the model as built (eager) instead of through vitlab.optimize")
    p.add_argument("--output-dir", default=None,
                   help="where pictures go (segmentation overlays, depth maps; default RUN/predictions)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_predict)



