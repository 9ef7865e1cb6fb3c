"""``TrainConfig``: the engine's knobs of a training run in one typed, YAML-serialisable dataclass, with the
task's own options (its ``Args`` dataclass) as ``task_args`` -- the single source of truth: the CLI's flags, their
help (the comment after each field) and their choices (``Literal`` types) are generated from these dataclasses
(:mod:`vitlab.cli._dataclass_args`).

Precedence: the engine's defaults < the task's recipe (``Task.defaults()``) < ``--config cfg.yaml`` < flags
(``--epochs 3``; dotted flags reach nested fields: ``--data.img_size 16``, ``--model_kwargs.depth 6``,
``--task_args.distill.alpha 0.5``). :meth:`TrainConfig.for_task` applies the same order in Python. Values are
converted to the field's declared type, so ``--lr 1e-3`` is a float; a mistyped or unknown key is one line with
close matches.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from vitlab._io import atomic_write
from vitlab.data import DataConfig

Amp = Literal["none", "bf16", "fp16"]
StrategyName = Literal["none", "ddp", "fsdp"]
TestWeights = Literal["last", "best"]
AMP_MODES = typing.get_args(Amp)
STRATEGIES = typing.get_args(StrategyName)
DEFAULT_MODEL = "vit_pico_patch8_32"
DEFAULT_TASK = "classify"


@dataclass
class TrainConfig:
    """A training run: the engine's fields, plus ``task_args``, the task's own options (an instance of the task's
    ``Args`` dataclass; a mapping is read into it). ``lr`` is the learning rate at a global batch of 512
    (``lr * batch / 512`` is used). Start from :meth:`for_task` to get a task's recipe."""

    task: str = DEFAULT_TASK           # what is trained: a registered Task (vitlab.train.list_tasks())
    task_args: Any = None              # the task's own options (its Args dataclass); None -> its defaults
    model: str = DEFAULT_MODEL         # a registered model (vitlab models)
    model_kwargs: dict = field(default_factory=dict)  # extra create_model kwargs, e.g. {depth: 6}
    data: DataConfig = field(default_factory=DataConfig)
    epochs: int = 100                  # the schedule's length
    batch_size: int = 32               # per process, per micro-step
    accum_steps: int = 1               # gradient accumulation: global batch = batch_size * accum_steps * world
    lr: float = 1.6e-2                 # at global batch 512 (DeiT: 5e-4; tuned for the tiny default model)
    min_lr: float = 1e-5               # at global batch 512, the cosine's floor
    warmup_epochs: float = 2.0         # linear warm-up, then the task's schedule (per optimiser step)
    warmup_lr: float = 1e-6            # at global batch 512
    weight_decay: float = 0.05         # not on norms, biases, tokens, position embeddings
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW
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
    strategy: StrategyName = "none"    # ddp / fsdp (FSDP2) under torchrun
    output_dir: str | None = None      # None -> runs/<task>-<model>-<dataset>-<timestamp>
    resume: str | None = None          # a run directory to continue (its model, data and recipe)
    stop_after: int | None = None      # end this invocation after this epoch (the schedule still spans `epochs`)
    eval_every: int = 1                # validate every N epochs (and after the last)
    save_every_steps: int | None = None  # also checkpoint every N optimiser steps, mid-epoch (None = epoch ends)
    save_every_minutes: float | None = None  # also checkpoint when M minutes have passed since the last save
    keep_last: int = 1                 # checkpoints kept: the newest K (plus the one 'best' names)
    log: list[str] = field(default_factory=list)  # trackers beside metrics.jsonl: tensorboard, mlflow, wandb
    mlflow_uri: str | None = None      # MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else RUN/mlruns)
    test_weights: TestWeights = "last"  # scored on the test split: the last epoch's, or the best on validation
    quiet: bool = False                # only the final summary line

    def __post_init__(self):
        if isinstance(self.data, dict):
            self.data = DataConfig(**self.data)
        self.betas = tuple(float(b) for b in self.betas)
        if isinstance(self.log, str):  # "tensorboard,mlflow" as a YAML scalar
            self.log = [t.strip() for t in self.log.split(",") if t.strip()]
        self.task_args = parse_task_args(self.task_args, self.args_class())
        self.validate()

    def args_class(self) -> type:
        """The ``Args`` dataclass of ``task`` (a one-line ValueError for an unknown task)."""
        from vitlab.train.task import task_class

        if not self.task or not isinstance(self.task, str):
            raise ValueError("task must be a registered task name, e.g. 'classify'")
        return task_class(self.task).Args

    @classmethod
    def for_task(cls, name: str = DEFAULT_TASK, **overrides) -> TrainConfig:
        """The config of a ``name`` run: the engine's defaults, under the task's recipe (``Task.defaults()``),
        under ``overrides`` (field names; a dict for a nested config -- ``data``, ``task_args`` -- sets only its
        keys). ``vitlab train --task name ...`` builds its config the same way."""
        from vitlab.train.task import task_class

        bad = sorted(set(overrides) - {f.name for f in dataclasses.fields(cls)} - {"task"})
        if bad:
            raise ValueError(_unknown_keys(bad, [f.name for f in dataclasses.fields(cls)], "TrainConfig"))
        cfg = cls(task=name).with_overrides(task_class(name).defaults())
        flat: dict[str, object] = {}
        for key, value in overrides.items():
            if key == "task":
                continue
            if dataclasses.is_dataclass(value) and not isinstance(value, type):
                value = to_plain(value)
            if isinstance(value, dict) and key in ("data", "task_args"):
                flat.update({f"{key}.{k}": v for k, v in value.items()})
            else:
                flat[key] = value
        return cfg.with_overrides(flat)

    def validate(self) -> None:
        """ValueError (one line) for a value that cannot work."""
        checks = [
            (self.amp in AMP_MODES, f"amp must be one of {AMP_MODES}, got {self.amp!r}"),
            (self.strategy in STRATEGIES, f"strategy must be one of {STRATEGIES}, got {self.strategy!r}"),
            (self.epochs >= 1, f"epochs must be >= 1, got {self.epochs}"),
            (self.batch_size >= 1, f"batch_size must be >= 1, got {self.batch_size}"),
            (self.accum_steps >= 1, f"accum_steps must be >= 1, got {self.accum_steps}"),
            (self.lr > 0, f"lr must be > 0, got {self.lr}"),
            (self.warmup_epochs >= 0, f"warmup_epochs must be >= 0, got {self.warmup_epochs}"),
            (0.0 <= self.ema_decay < 1.0, f"ema_decay must be in [0, 1), got {self.ema_decay}"),
            (self.stop_after is None or self.stop_after >= 1, f"stop_after must be >= 1, got {self.stop_after}"),
            (self.eval_every >= 1, f"eval_every must be >= 1, got {self.eval_every}"),
            (self.save_every_steps is None or self.save_every_steps >= 1,
             f"save_every_steps must be >= 1, got {self.save_every_steps}"),
            (self.save_every_minutes is None or self.save_every_minutes > 0,
             f"save_every_minutes must be > 0, got {self.save_every_minutes}"),
            (self.keep_last >= 1, f"keep_last must be >= 1, got {self.keep_last}"),
            (isinstance(self.log, list) and all(isinstance(t, str) and t for t in self.log),
             f"log must be a list of tracker names, e.g. [tensorboard, mlflow], got {self.log!r}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)
        from vitlab.train.task import task_class

        task_class(self.task).check(self)  # the task's own rules across its options and the engine's

    # ---- serialisation ----------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["data"] = self.data.to_dict()
        d["task_args"] = to_plain(self.task_args)
        d["betas"] = list(self.betas)
        d["model_kwargs"] = dict(self.model_kwargs)
        d["log"] = list(self.log)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        d = dict(d or {})
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(d) - set(names))
        if unknown:
            raise ValueError(_unknown_keys(unknown, names, "TrainConfig"))
        if isinstance(d.get("data"), dict):
            data_names = [f.name for f in dataclasses.fields(DataConfig)]
            bad = sorted(set(d["data"]) - set(data_names))
            if bad:
                raise ValueError(_unknown_keys(bad, data_names, "data"))
            d["data"] = DataConfig(**d["data"])
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
        """A copy with dotted ``key: value`` overrides applied (``data.img_size``, ``task_args.head``,
        ``model_kwargs.depth``); string values are converted to the field's type. A new ``task`` starts its
        options from that task's defaults; a new ``data.dataset`` starts the data knobs from that dataset's."""
        d = self.to_dict()
        if "task" in overrides and overrides["task"] != self.task:
            d["task"], d["task_args"] = overrides["task"], None
        # a new dataset first: the keys beside it (--data.options.n 3) apply to the new dataset's defaults
        ordered = sorted(overrides.items(), key=lambda kv: kv[0].replace("-", "_") != "data.dataset")
        for key, value in ordered:
            parts = key.replace("-", "_").split(".")
            if parts == ["task"]:
                continue
            target: dict = d
            owner: type | None = type(self)
            for i, p in enumerate(parts[:-1]):
                sub_type = _field_type(owner, p, parts[: i + 1], d)
                if p == "task_args" and target.get(p) is None:
                    target[p] = {}
                if not isinstance(target.get(p), dict):
                    raise ValueError(f"unknown config key {key!r}")
                target = target[p]
                owner = sub_type if dataclasses.is_dataclass(sub_type) else None
            last = parts[-1]
            if owner is not None:
                names = [f.name for f in dataclasses.fields(owner)]
                if last not in names:
                    prefix = ".".join(parts[:-1])
                    known = [f"{prefix}.{n}" if prefix else n for n in names]
                    if owner is TrainConfig:  # an option of the task given without its prefix
                        known += [f"task_args.{f.name}" for f in dataclasses.fields(_field_type(
                            TrainConfig, "task_args", ["task_args"], d))]
                    raise ValueError(_unknown_keys([key], known, "config"))
                tp = _field_type(owner, last, parts, d)
                value = coerce(value, tp, key)
                if dataclasses.is_dataclass(value) and not isinstance(value, type):
                    value = to_plain(value)
            elif isinstance(value, str):  # free-form dict (model_kwargs): let YAML type it
                value = yaml.safe_load(value)
            if parts == ["data", "dataset"] and value != target.get("dataset"):
                # another dataset: its own defaults, not the previous dataset's resolved knobs
                keep = {k: target[k] for k in ("batch_size", "num_workers", "seed") if k in target}
                target.clear()
                target.update(keep)
            target[last] = value
        return type(self).from_dict(d)


def to_plain(value):
    """A dataclass instance (or a value holding some) as plain YAML types: dicts, lists, scalars."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    return value


def _unknown_keys(bad: list[str], known: list[str], what: str) -> str:
    """'unknown config key 'epoch'; did you mean epochs?' -- one line with the close matches."""
    parts = []
    for b in bad:
        close = difflib.get_close_matches(b, known, n=3, cutoff=0.6)
        parts.append(f"{b!r}" + (f" (did you mean {' or '.join(close)}?)" if close else ""))
    return f"unknown {what} key(s): {', '.join(parts)}"


def parse_task_args(raw, cls):
    """A task's options as its ``Args`` dataclass ``cls``: ``None`` -> the defaults; an instance -> itself; a
    mapping -> each value converted to its field's type (the CLI gives strings; nested dataclasses take
    mappings), an unknown or ill-typed key a one-line ValueError naming it, with close matches."""
    if raw is None:
        return cls()
    if isinstance(raw, cls):
        return raw
    if dataclasses.is_dataclass(raw) and not isinstance(raw, type):
        raise ValueError(f"task_args is a {type(raw).__name__}, but this task takes {cls.__name__}")
    if not isinstance(raw, dict):
        raise ValueError(f"task_args must be a mapping of option names to values, got {raw!r}")
    names = [f.name for f in dataclasses.fields(cls)]
    bad = sorted(set(raw) - set(names))
    if bad:
        takes = f"; {cls.__name__} takes {', '.join(names)}" if names else f"; {cls.__name__} takes none"
        raise ValueError(_unknown_keys([f"task_args.{b}" for b in bad], [f"task_args.{n}" for n in names],
                                       "task option") + takes)
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for k, v in raw.items():
        tp = hints[k]
        if dataclasses.is_dataclass(tp):
            kwargs[k] = parse_task_args(v, tp) if not isinstance(v, tp) else v
        else:
            kwargs[k] = check_type(coerce(v, tp, f"task_args.{k}"), tp, f"task_args.{k}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"task_args: {e}") from None


def check_type(value, tp, key: str):
    """``value`` (already read from YAML or a string) checked against ``tp``: a mistyped option is one line,
    never a silently wrong run. Tuples and lists of numbers are converted element-wise."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is typing.Any or isinstance(tp, typing.TypeVar):
        return value
    if origin in (typing.Union, types.UnionType):
        for a in args:
            try:
                return check_type(value, a, key)
            except ValueError:
                continue
        raise ValueError(f"{key}: expected {type_name(tp)}, got {value!r}")
    if origin is Literal:
        if value in args:
            return value
        raise ValueError(f"{key}: expected one of {', '.join(map(str, args))}, got {value!r}")
    if tp is type(None):
        if value is None:
            return None
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp in (bool, str):
        if isinstance(value, tp):
            return value
    elif origin in (tuple, list) or tp in (tuple, list):
        if isinstance(value, (tuple, list)):
            inner = args[0] if args else typing.Any
            items = [check_type(v, inner, key) for v in value]
            return tuple(items) if (origin is tuple or tp is tuple) else items
    elif origin is dict or tp is dict:
        if isinstance(value, dict):
            return value
    else:
        return value
    raise ValueError(f"{key}: expected {type_name(tp)}, got {value!r}")


def _field_type(cls, name: str, path: list[str] | None = None, d: dict | None = None):
    """The declared type of field ``name`` of dataclass ``cls``; ``task_args`` is typed by the config's task."""
    if cls is None:
        return None
    if cls is TrainConfig and name == "task_args":
        from vitlab.train.task import task_class

        return task_class((d or {}).get("task") or DEFAULT_TASK).Args
    hints = typing.get_type_hints(cls)
    if name not in hints:
        raise ValueError(f"unknown config key {'.'.join(path or [name])!r}")
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
