"""``TrainConfig``: every knob of a training run in one typed, YAML-serialisable dataclass -- the single source of
truth: the CLI's flags, their help (the comment after each field) and their choices (``Literal`` types) are
generated from these dataclasses (:mod:`vitlab.cli.config_args`).

Precedence when the CLI builds one: dataclass defaults < ``--config cfg.yaml`` < flags (``--epochs 3``; dotted
flags reach nested fields: ``--data.img_size 16``, ``--model_kwargs.depth 6``, ``--distill.alpha 0.5``). Values
are converted to the field's declared type, so ``--lr 1e-3`` is a float.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml

from vitlab.data import DataConfig

Amp = Literal["none", "bf16", "fp16"]
StrategyName = Literal["none", "ddp", "fsdp"]
DistillKind = Literal["none", "hard", "soft", "feature"]
TestWeights = Literal["last", "best"]
AMP_MODES = typing.get_args(Amp)
STRATEGIES = typing.get_args(StrategyName)
DISTILL_KINDS = typing.get_args(DistillKind)
DEFAULT_MODEL = "vit_pico_patch8_32"


@dataclass
class DistillConfig:
    """DeiT distillation through the distillation token (hard: teacher's argmax; soft: KL at ``tau``), or feature
    distillation (seed 001's FeatureDistillation: student features projected to the teacher's width, MSE)."""

    kind: DistillKind = "none"         # hard: teacher's argmax; soft: KL at tau; feature: projected features, MSE
    teacher: str | None = None         # a vitlab model name, 'timm:NAME', or a checkpoint (run dir / dir / file)
    teacher_checkpoint: str | None = None  # weights for a teacher given by name
    teacher_kwargs: dict = field(default_factory=dict)  # create_model kwargs of a teacher given by name
    alpha: float = 0.5                 # weight of the distillation loss (1 - alpha on the class loss)
    tau: float = 1.0                   # soft distillation temperature
    student_layers: list[int] = field(default_factory=lambda: [-1])  # feature: block indices (negatives ok)
    teacher_layers: list[int] = field(default_factory=lambda: [-1])  # feature: the teacher's block indices
    feature_weight: float = 1.0        # feature: weight of the MSE added to the class loss


@dataclass
class TrainConfig:
    """A training run. ``lr`` is the learning rate at a global batch of 512 (``lr * batch / 512`` is used)."""

    task: str = "classify"             # what is trained: a registered Task (vitlab.train.list_tasks())
    task_args: dict = field(default_factory=dict)  # the task's own options, e.g. {mask_ratio: 0.75}
    model: str = DEFAULT_MODEL         # a registered model (vitlab models)
    model_kwargs: dict = field(default_factory=dict)  # extra create_model kwargs, e.g. {depth: 6}
    data: DataConfig = field(default_factory=DataConfig)
    epochs: int = 100                  # the schedule's length
    batch_size: int = 32               # per process, per micro-step
    accum_steps: int = 1               # gradient accumulation: global batch = batch_size * accum_steps * world
    lr: float = 1.6e-2                 # at global batch 512 (DeiT: 5e-4; tuned for the tiny default model)
    min_lr: float = 1e-5               # at global batch 512, the cosine's floor
    warmup_epochs: float = 2.0         # linear warm-up, then cosine (per optimiser step)
    warmup_lr: float = 1e-6            # at global batch 512
    weight_decay: float = 0.05         # not on norms, biases, tokens, position embeddings
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW
    label_smoothing: float = 0.1       # of the class loss
    drop_path: float = 0.1             # stochastic depth rate
    clip_grad: float | None = 1.0      # max gradient norm (None = off)
    ema_decay: float = 0.0             # EMA of the weights, evaluated beside them (0 = off; DeiT: 0.99996)
    ema_warmup: bool = True            # decay min(ema_decay, (1 + step) / (10 + step)): early EMA tracks faster
    amp: Amp = "none"                  # mixed precision (fp16 uses a GradScaler)
    compile: bool = False              # torch.compile the training forward
    channels_last: bool = False        # channels-last memory format for model and images
    grad_checkpointing: bool = False   # recompute blocks in backward to save memory
    device: str = "auto"               # 'auto' (cuda when available) | 'cpu' | 'cuda' | 'cuda:1' ...
    threads: int | None = None         # torch.set_num_threads on CPU (None = torch's default)
    seed: int = 0                      # model initialisation, augmentation and drop-path streams
    distill: DistillConfig = field(default_factory=DistillConfig)
    tome_r: int = 0                    # ToMe: tokens merged per block (vitlab.tome; 0 = off)
    prune: str | None = None           # token pruning METHOD:KEEP_RATE (evit, dynamicvit, topk, adaptive): evit:0.7
    prune_shrink_start: float = 0.0    # keep-rate warm-up (EViT): epochs at keep rate 1 before it shrinks (paper: 10)
    prune_shrink_epochs: float = 0.0   # epochs of the cosine from keep rate 1 to --prune's (paper: 100; 0 = none)
    strategy: StrategyName = "none"    # ddp / fsdp (FSDP2) under torchrun
    output_dir: str | None = None      # None -> runs/<model>-<dataset>-<timestamp>
    resume: str | None = None          # a run directory to continue (its model, data and recipe)
    init: str | None = None            # start from this run's / checkpoint's backbone (e.g. vitlab pretrain)
    layer_decay: float | None = None   # layer-wise lr decay (None: off; 0.65 when --init is an MAE run)
    stop_after: int | None = None      # end this invocation after this epoch (the schedule still spans `epochs`)
    eval_every: int = 1                # validate every N epochs (and after the last)
    test_weights: TestWeights = "last"  # scored on the test split: the last epoch's, or the best on validation
    quiet: bool = False                # only the final summary line

    def __post_init__(self):
        if isinstance(self.data, dict):
            self.data = DataConfig(**self.data)
        if isinstance(self.distill, dict):
            self.distill = DistillConfig(**self.distill)
        self.betas = tuple(float(b) for b in self.betas)
        self.validate()

    def validate(self) -> None:
        """ValueError (one line) for a value that cannot work."""
        checks = [
            (bool(self.task), "task must be a registered task name, e.g. 'classify'"),
            (self.amp in AMP_MODES, f"amp must be one of {AMP_MODES}, got {self.amp!r}"),
            (self.strategy in STRATEGIES, f"strategy must be one of {STRATEGIES}, got {self.strategy!r}"),
            (self.distill.kind in DISTILL_KINDS,
             f"distill.kind must be one of {DISTILL_KINDS}, got {self.distill.kind!r}"),
            (self.epochs >= 1, f"epochs must be >= 1, got {self.epochs}"),
            (self.batch_size >= 1, f"batch_size must be >= 1, got {self.batch_size}"),
            (self.accum_steps >= 1, f"accum_steps must be >= 1, got {self.accum_steps}"),
            (self.lr > 0, f"lr must be > 0, got {self.lr}"),
            (self.warmup_epochs >= 0, f"warmup_epochs must be >= 0, got {self.warmup_epochs}"),
            (0.0 <= self.ema_decay < 1.0, f"ema_decay must be in [0, 1), got {self.ema_decay}"),
            (0.0 <= self.label_smoothing < 1.0, f"label_smoothing must be in [0, 1), got {self.label_smoothing}"),
            (0.0 <= self.distill.alpha <= 1.0, f"distill.alpha must be in [0, 1], got {self.distill.alpha}"),
            (self.distill.tau > 0, f"distill.tau must be > 0, got {self.distill.tau}"),
            (self.distill.kind == "none" or self.distill.teacher,
             f"distill.kind={self.distill.kind!r} needs a teacher (--teacher MODEL|CHECKPOINT)"),
            (self.tome_r >= 0, f"tome_r must be >= 0, got {self.tome_r}"),
            (self.prune_shrink_start >= 0 and self.prune_shrink_epochs >= 0,
             f"prune_shrink_start and prune_shrink_epochs must be >= 0 epochs, got {self.prune_shrink_start} and "
             f"{self.prune_shrink_epochs}"),
            (self.prune or not (self.prune_shrink_start or self.prune_shrink_epochs),
             "prune_shrink_start / prune_shrink_epochs warm up a pruning keep rate; they need --prune METHOD:KEEP"),
            (self.prune_shrink_start + self.prune_shrink_epochs <= self.epochs,
             f"the pruning keep-rate warm-up ends at epoch {self.prune_shrink_start + self.prune_shrink_epochs:g}, "
             f"after the run's {self.epochs} epochs (the model would never train at its keep rate)"),
            (self.stop_after is None or self.stop_after >= 1, f"stop_after must be >= 1, got {self.stop_after}"),
            (self.layer_decay is None or 0.0 < self.layer_decay <= 1.0,
             f"layer_decay must be in (0, 1], got {self.layer_decay}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)

    # ---- serialisation ----------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["data"] = self.data.to_dict()
        d["betas"] = list(self.betas)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        d = dict(d or {})
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"unknown TrainConfig key(s): {', '.join(unknown)}")
        for sub, sub_cls in (("data", DataConfig), ("distill", DistillConfig)):
            if isinstance(d.get(sub), dict):
                bad = sorted(set(d[sub]) - {f.name for f in dataclasses.fields(sub_cls)})
                if bad:
                    raise ValueError(f"unknown {sub} key(s): {', '.join(bad)}")
                d[sub] = sub_cls(**d[sub])
        return cls(**d)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_yaml(cls, text: str) -> TrainConfig:
        d = yaml.safe_load(text)
        if d is not None and not isinstance(d, dict):
            raise ValueError("a training config must be a YAML mapping of keys to values")
        return cls.from_dict(d or {})

    def save(self, path: str | Path) -> Path:
        from vitlab.train.checkpoint import atomic_write

        return atomic_write(path, self.to_yaml().encode())

    @classmethod
    def load(cls, path: str | Path) -> TrainConfig:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config file not found: {path}")
        try:
            text = path.read_text()
            return cls.from_yaml(text)
        except yaml.YAMLError as e:
            raise ValueError(f"{path} is not valid YAML: {str(e).splitlines()[0]}") from None
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: {e}") from None

    def with_overrides(self, overrides: dict[str, object]) -> TrainConfig:
        """A copy with dotted ``key: value`` overrides applied; string values are converted to the field's type."""
        d = self.to_dict()
        for key, value in overrides.items():
            parts = key.replace("-", "_").split(".")
            target, owner = d, type(self)
            for p in parts[:-1]:
                sub_type = _field_type(owner, p)
                if not isinstance(target.get(p), dict):
                    raise ValueError(f"unknown config key {key!r}")
                target = target[p]
                owner = sub_type if dataclasses.is_dataclass(sub_type) else None
            last = parts[-1]
            if owner is not None:
                if last not in {f.name for f in dataclasses.fields(owner)}:
                    raise ValueError(f"unknown config key {key!r}")
                value = coerce(value, _field_type(owner, last), key)
            elif isinstance(value, str):  # free-form dict (model_kwargs): let YAML type it
                value = yaml.safe_load(value)
            target[last] = value
        return type(self).from_dict(d)


def parse_task_args(raw: dict, cls):
    """``TrainConfig.task_args`` -> the task's own dataclass ``cls``: values converted to the field types (the
    CLI gives strings), an unknown key a one-line ValueError."""
    names = {f.name for f in dataclasses.fields(cls)}
    bad = sorted(set(raw) - names)
    if bad:
        raise ValueError(f"unknown --task_args key(s) {', '.join(bad)}; {cls.__name__} takes "
                         f"{', '.join(sorted(names))}")
    hints = typing.get_type_hints(cls)
    return cls(**{k: coerce(v, hints[k], f"task_args.{k}") for k, v in raw.items()})


def _field_type(cls, name: str):
    if cls is None:
        return None
    hints = typing.get_type_hints(cls)
    if name not in hints:
        raise ValueError(f"unknown config key {name!r}")
    return hints[name]


def coerce(value, tp, key: str = "value"):
    """Convert a CLI string to the annotated type ``tp`` (int, float, bool, str, Optional, tuple, list, dict)."""
    if not isinstance(value, str):
        return value
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        if value in args:
            return value
        raise ValueError(f"{key}: expected one of {', '.join(map(str, args))}, got {value!r}")
    if origin in (typing.Union, types.UnionType):
        if value.lower() in ("none", "null", "~"):
            return None
        inner = [a for a in args if a is not type(None)]
        errors = []
        for t in inner:
            try:
                return coerce(value, t, key)
            except ValueError as e:
                errors.append(str(e))
        if len(inner) == 1:
            raise ValueError(errors[0])
        raise ValueError(f"{key}: cannot read {value!r} as {type_name(tp)}")
    try:
        if tp is bool:
            low = value.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if tp is int:
            return int(value)
        if tp is float:
            return float(value)
        if tp is str:
            return value
        if origin in (tuple, list) or tp in (tuple, list):
            parsed = yaml.safe_load(value if value.strip().startswith("[") else f"[{value}]")
            if args and args[0] in (int, float):
                parsed = [args[0](v) for v in parsed]
            return tuple(parsed) if origin is tuple else list(parsed)
        if origin is dict or tp is dict:
            parsed = yaml.safe_load(value)
            if not isinstance(parsed, dict):
                raise ValueError
            return parsed
    except (ValueError, TypeError, yaml.YAMLError):
        raise ValueError(f"{key}: cannot read {value!r} as {type_name(tp)}") from None
    return yaml.safe_load(value)


def type_name(tp) -> str:
    """``int``, ``float | None``, ``list[int]``, ``{a,b}`` for Literals: how a type reads in help and errors."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "{" + ",".join(map(str, args)) + "}"
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if tp is type(None):
        return "None"
    if origin is not None:
        return f"{getattr(origin, '__name__', origin)}[{', '.join(type_name(a) for a in args)}]"
    return getattr(tp, "__name__", str(tp))


def field_help(cls) -> dict[str, str]:
    """The comment after each field of dataclass ``cls`` (its documentation, read from the source)."""
    import ast
    import inspect
    import io
    import tokenize

    try:
        src = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    comments = {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO(src).readline) if tok.type == tokenize.COMMENT}
    body = ast.parse(src).body[0].body
    out = {}
    for node in body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            text = comments.get(node.end_lineno) or comments.get(node.lineno)
            if text:
                out[node.target.id] = text
    return out


def parse_overrides(tokens: list[str]) -> dict[str, str]:
    """``['--lr', '1e-3', '--data.img_size=16']`` -> ``{'lr': '1e-3', 'data.img_size': '16'}``."""
    out: dict[str, str] = {}
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if not tok.startswith("--") or len(tok) == 2:
            raise ValueError(f"unexpected argument {tok!r}; overrides are --key value or --key=value")
        key = tok[2:]
        if "=" in key:
            key, value = key.split("=", 1)
            i += 1
        elif i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
            value = tokens[i + 1]
            i += 2
        else:
            value = "true"  # a bare flag: --compile
            i += 1
        out[key] = value
    return out
