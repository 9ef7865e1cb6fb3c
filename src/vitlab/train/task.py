"""The ``Task``: the typed spec of what a :class:`~vitlab.train.trainer.Trainer` trains, the run record every
checkpoint carries, and the open registries of tasks and model transforms.

A task builds its modules from the config and says how one batch trains and validates; the Trainer owns
everything else (run directory, strategy, loaders, optimiser, schedule, AMP, accumulation, EMA, checkpoints,
resume, metrics, progress). The split follows torchtitan's ``TrainSpec``: the loop never learns what a model is.
Every member below is declared on :class:`Task` with a typed signature and, where a task may do nothing, a no-op
default; the engine calls them unconditionally (nothing is discovered by ``hasattr``)::

    from dataclasses import dataclass
    from vitlab.train import Task, TrainConfig, fit, register_task

    @dataclass
    class MyArgs:
        margin: float = 0.2      # the task's own option: --task_args.margin 0.3

    @register_task("my_task")
    class MyTask(Task):
        monitor = "top1"         # validation metric (a key of validation_metrics) that picks the best checkpoint
        Args = MyArgs

        def build(self, cfg, device): ...   # sets self.data (.train / .val datasets), self.model, self.module
        def training_step(self, batch, forward): ...
        def validation_step(self, batch, forward): ...
        def validation_metrics(self, sums): ...
        def record(self): ...    # RunRecord: how to rebuild the model from its checkpoint alone

    fit(TrainConfig.for_task("my_task", epochs=3))   # or: vitlab train --task my_task --epochs 3

Conventions: ``model`` is the network whose weights are the run's output (``model.safetensors``, EMA'd,
evaluated). ``module`` is what the strategy wraps and the optimiser trains: the model itself, or a module that
holds it as its attribute ``model`` beside trained extras (projectors, decoders, heads, teachers' centres), whose
states are checkpointed in the trainer state under their attribute names. ``data`` is any object with ``train``
and ``val`` datasets (``test`` optional); the engine builds the loaders.

Capability packages register their tasks in a module ``vitlab/<capability>/tasks.py``; a user's package
registers through the entry-point group ``vitlab.plugins`` or ``vitlab --import MODULE``. :func:`list_tasks` and
:func:`create_task` import all of those on demand.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import importlib.util
import pkgutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
import torch.nn as nn

from vitlab.plugins import load_plugins
from vitlab.train.recipe import WarmupCosine, param_groups


@dataclass
class NoArgs:
    """A task without options of its own."""


class TaskError(ValueError):
    """A task asked for something it cannot do (e.g. a task without ``predict``): one line, exit code 2."""


# ---------------------------------------------------------------- the run record

# keys of a checkpoint's metadata that describe the checkpoint, not the run
_CHECKPOINT_KEYS = ("epoch", "step", "metrics", "preferred_weights", "weights")


@dataclass
class RunRecord:
    """What every checkpoint carries so the model can be rebuilt, evaluated and used without the config: the
    task, the model and its kwargs, the task's options, the data it was trained on, its classes and the input
    preprocessing. ``extra`` holds what a task adds (a dense head's spec, a tokenizer, the SSL method...).

    Stored flat in the checkpoint's metadata (``model.safetensors`` and ``meta.json``): the core fields by
    name, ``extra``'s keys beside them."""

    task: str
    model: str
    model_kwargs: dict = field(default_factory=dict)
    task_args: dict = field(default_factory=dict)
    data: dict = field(default_factory=dict)       # the resolved DataConfig
    num_classes: int = 0
    class_names: list[str] | None = None
    img_size: int | None = None                    # preprocessing: input side, channels, normalisation, crop
    in_chans: int = 3
    mean: list[float] = field(default_factory=lambda: [0.5])
    std: list[float] = field(default_factory=lambda: [0.5])
    crop_pct: float | None = None
    params: int = 0
    extra: dict = field(default_factory=dict)

    def to_meta(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        clash = sorted(set(d) & set(self.extra))
        if clash:
            raise ValueError(f"run record extra keys {clash} shadow its fields")
        return {**d, **self.extra}

    @classmethod
    def from_meta(cls, meta: dict) -> RunRecord:
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        core = {k: v for k, v in meta.items() if k in names}
        if "model" not in core:
            raise TaskError("the checkpoint carries no run record (not written by vitlab train)")
        core.setdefault("task", "classify")
        extra = {k: v for k, v in meta.items() if k not in names and k not in _CHECKPOINT_KEYS}
        return cls(**core, extra=extra)


# ---------------------------------------------------------------- the Task


class Task:
    """The typed spec of a trainable task. Subclass it, set the class members, implement ``build``, the steps,
    ``validation_metrics`` and ``record``; override the hooks that apply. Register with :func:`register_task`."""

    name: ClassVar[str] = ""                            # set by register_task
    monitor: ClassVar[str] = "loss"                     # the validation metric that picks the best checkpoint
    monitor_mode: ClassVar[Literal["max", "min"]] = "max"
    Args: ClassVar[type] = NoArgs                       # the task's own options (a dataclass type)
    aliases: ClassVar[dict[str, str]] = {}              # short CLI flags for its options: {"init": "task_args.init"}
    takes_prompt: ClassVar[bool] = False                # predict answers a text prompt (vitlab predict --prompt)

    data: Any
    model: nn.Module
    module: nn.Module
    args: Any

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """The task's recipe: overrides of :class:`~vitlab.train.config.TrainConfig`'s defaults as dotted keys
        (``{"epochs": 30, "data.dataset": "shapes", "task_args.head": "vitdet_sfp"}``); the caller's values win
        (:meth:`TrainConfig.for_task`)."""
        return {}

    @classmethod
    def check(cls, cfg) -> None:
        """ValueError (one line) when ``cfg.task_args`` cannot work with the engine's fields (default: none)."""

    # ---- training --------------------------------------------------------------------------------------
    def build(self, cfg, device: torch.device) -> None:
        """Set ``data``, ``model`` (on ``device``) and ``module`` from the config (``cfg.task_args`` is an
        instance of ``Args``)."""
        raise NotImplementedError(f"{type(self).__name__}.build")

    def param_groups(self, weight_decay: float) -> list[dict]:
        """The optimiser's parameter groups over ``module`` (no weight decay on norms, biases, tokens)."""
        return param_groups(self.module, weight_decay)

    def training_step(self, batch, forward) -> tuple[torch.Tensor, dict]:
        """(loss, logs) of one micro-batch; ``forward`` is the wrapped ``module`` to call."""
        raise NotImplementedError(f"{type(self).__name__}.training_step")

    def validation_step(self, batch, forward) -> dict[str, torch.Tensor]:
        """Sums over one batch (summed over batches and ranks, then :meth:`validation_metrics`)."""
        raise NotImplementedError(f"{type(self).__name__}.validation_step")

    def validation_metrics(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        """The validation metrics from the summed ``validation_step`` outputs."""
        raise NotImplementedError(f"{type(self).__name__}.validation_metrics")

    def scheduler(self, optimizer, total_steps: int, warmup_steps: int, base_lr: float, min_lr: float,
                  warmup_lr: float):
        """The learning-rate schedule, stepped after every optimiser step (default: linear warm-up + cosine)."""
        return WarmupCosine(optimizer, total_steps=total_steps, warmup_steps=warmup_steps, base_lr=base_lr,
                            min_lr=min_lr, warmup_lr=warmup_lr)

    def before_optimizer_step(self) -> None:
        """After backward and gradient clipping, before the optimiser step (e.g. DINO drops the last layer's
        gradients in the first epoch)."""

    def after_step(self, step: int, total_steps: int, steps_per_epoch: int) -> None:
        """After each optimiser step (0-based ``step``): per-step schedules (EMA teachers, keep rates)."""

    def summary(self) -> dict:
        """Fields of the start line and ``summary.json``: model, dataset, params_m, img_size, train_images,
        val_images."""
        return {}

    def test(self, run_dir: Path, batch_size: int, checkpoint: str = "last") -> dict:
        """The final evaluation of the run's ``checkpoint`` (``last`` or ``best``; rank 0 only), merged into the
        summary as ``test_*`` keys. Default: none."""
        return {}

    # ---- the run record: rebuild, evaluate, predict ----------------------------------------------------
    def record(self) -> RunRecord:
        """The :class:`RunRecord` stored with every checkpoint of this run."""
        raise NotImplementedError(f"{type(self).__name__}.record")

    def load(self, record: RunRecord) -> nn.Module:
        """The model of ``record``, built with fresh weights (the caller loads the checkpoint's)."""
        raise TaskError(f"task {self.name!r} cannot rebuild its model from a checkpoint")

    def evaluate(self, model: nn.Module, record: RunRecord, data: str | None, split: str, *,
                 out_dir: Path, batch_size: int = 256, device: str = "cpu", optimize: bool = True) -> dict:
        """The task's metrics of ``model`` on ``data`` (default: the data of ``record``) ``split``; writes its
        JSON (and PNG where there is a picture) to ``out_dir``. Returns the metrics with ``summary``: one line
        for the console."""
        raise TaskError(f"task {self.name!r} has no evaluate")

    def predict(self, model: nn.Module, record: RunRecord, inputs: list[str], out_dir: Path, *, topk: int = 5,
                device: str = "cpu", optimize: bool = True, prompt: str | None = None) -> list[dict]:
        """One row per input (each with ``line``: what the console prints); files (masks, maps) under
        ``out_dir``. ``prompt``: the question or instruction, for a task with ``takes_prompt`` (``vitlab predict
        --prompt``); the others are never given one."""
        raise TaskError(f"task {self.name!r} has no predict")


# ---------------------------------------------------------------- registries and discovery

TASKS: dict[str, type[Task]] = {}


def register_task(name: str):
    """Class decorator: make a :class:`Task` subclass available as ``TrainConfig.for_task(name)`` /
    ``vitlab train --task name``."""

    def deco(cls: type[Task]) -> type[Task]:
        if not (isinstance(cls, type) and issubclass(cls, Task)):
            raise TypeError(f"register_task({name!r}) needs a subclass of vitlab.train.Task, got {cls!r}")
        if not dataclasses.is_dataclass(cls.Args):
            raise TypeError(f"{cls.__name__}.Args must be a dataclass type")
        if name in TASKS and TASKS[name] is not cls:
            raise ValueError(f"task {name!r} is registered twice")
        TASKS[name] = cls
        cls.name = name
        return cls

    return deco


def _discover() -> None:
    """Import every ``vitlab.<capability>.tasks`` module and the installed plugins, so their tasks and model
    transforms register themselves: the engine names no capability."""
    import vitlab

    for m in pkgutil.iter_modules(vitlab.__path__):
        if m.ispkg and importlib.util.find_spec(f"vitlab.{m.name}.tasks") is not None:
            importlib.import_module(f"vitlab.{m.name}.tasks")
    load_plugins()


def list_tasks() -> list[str]:
    _discover()
    return sorted(TASKS)


def task_class(name: str) -> type[Task]:
    """The registered task class ``name``; an unknown name is a one-line ValueError with close matches."""
    if name not in TASKS:
        _discover()
    if name not in TASKS:
        close = difflib.get_close_matches(str(name), list(TASKS), n=3)
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        raise ValueError(f"unknown task {name!r}{hint} (registered tasks: {', '.join(sorted(TASKS)) or 'none'})")
    return TASKS[name]


def create_task(name: str) -> Task:
    return task_class(name)()


# ---------------------------------------------------------------- model transforms

MODEL_TRANSFORMS: dict[str, Any] = {}


def register_model_transform(name: str):
    """Decorator: a capability's transform of a freshly built model, ``fn(model, spec, training) -> module``,
    applied by a task when its ``Args`` ask for it (classification: ``tome`` for ``tome_r``, ``prune`` for
    ``prune``). It patches ``model`` in place and returns the module to train: the model, or a module holding it
    as ``model`` whose ``forward(x, with_loss=True)`` returns ``(output, extra_loss)``."""

    def deco(fn):
        MODEL_TRANSFORMS[name] = fn
        return fn

    return deco


class TransformedModule(nn.Module):
    """What a model transform returns when it adds to training: the model as ``model``, an extra loss when
    ``adds_loss`` (``forward(x, with_loss=True) -> (output, loss)``) and a per-step hook (a keep-rate warm-up)."""

    adds_loss: bool = False

    def after_step(self, step: int, total_steps: int, steps_per_epoch: int) -> None:
        """After each optimiser step (default: nothing)."""


def model_transform(name: str):
    if name not in MODEL_TRANSFORMS:
        _discover()
    if name not in MODEL_TRANSFORMS:
        raise ValueError(f"no model transform {name!r} is registered")
    return MODEL_TRANSFORMS[name]
