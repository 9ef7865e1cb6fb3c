"""The ``Task`` protocol: what a :class:`~vitlab.train.trainer.Trainer` trains, and the registry of tasks.

A task builds its modules from the config and says how one batch trains and validates; the Trainer owns
everything else (run directory, strategy, optimiser, schedule, AMP, accumulation, EMA, checkpoints, resume,
metrics, progress). The split follows torchtitan's ``TrainSpec``: the loop never learns what a model is, so a
self-supervised, segmentation or CLIP task plugs in by registering itself::

    from vitlab.train import register_task

    @register_task("my_task")
    class MyTask:
        monitor = "top1"            # validation metric that picks the best checkpoint
        monitor_mode = "max"        # optional: "min" when lower is better (a loss, an error)
        def build(self, cfg, device): ...   # sets self.data, self.model, self.module
        ...

    fit(TrainConfig(task="my_task", ...))      # or: vitlab train --task my_task

A capability package registers its tasks in a module ``vitlab/<capability>/tasks.py``; :func:`list_tasks` and
:func:`create_task` import those on demand. A task's own options live in ``TrainConfig.task_args`` (a mapping the
task reads into its own dataclass, so the CLI takes ``--task_args.mask_ratio 0.6``).

Conventions: ``model`` is the network whose weights are the run's output (``model.safetensors``, EMA'd,
evaluated). ``module`` is what the strategy wraps and the optimiser trains: the model itself, or a module that
holds it as its attribute ``model`` beside trained extras (e.g. feature-distillation projectors), whose states
are checkpointed in the trainer state under their attribute names. ``data`` offers ``train`` / ``val`` datasets,
``loader(split, ...)`` and ``config.seed`` / ``config.num_workers`` (a :class:`vitlab.data.DataBundle` does).
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
import torch.nn as nn


@runtime_checkable
class Task(Protocol):
    monitor: ClassVar[str]  # the validation metric (a key of validation_metrics) that picks the best checkpoint
    # optional ``monitor_mode: ClassVar[str] = "min"`` when lower is better (default "max")

    data: Any
    model: nn.Module
    module: nn.Module

    def build(self, cfg, device: torch.device) -> None:
        """Build ``data``, ``model`` (on ``device``) and ``module`` from the config."""

    def param_groups(self, weight_decay: float) -> list[dict]:
        """The optimiser's parameter groups over ``module`` (called after the strategy wrapped it)."""

    def training_step(self, batch, forward) -> tuple[torch.Tensor, dict]:
        """(loss, logs) of one micro-batch; ``forward`` is the wrapped ``module`` to call."""

    def validation_step(self, batch, forward) -> dict[str, torch.Tensor]:
        """Sums over one batch (summed over batches and ranks, then :meth:`validation_metrics`)."""

    def validation_metrics(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        """The validation metrics from the summed ``validation_step`` outputs."""

    def description(self) -> dict:
        """What is stored with every checkpoint so the model can be rebuilt without the config."""

    def summary(self) -> dict:
        """Fields for the start line and ``summary.json`` (model, dataset, params_m, img_size...)."""

    def test(self, run_dir, batch_size: int, checkpoint: str = "last") -> dict:
        """The final evaluation of the run's ``checkpoint`` (``last`` or ``best``; rank 0 only), merged into the
        summary."""

    # optional ``after_step(step, total_steps, steps_per_epoch)``: called after each optimiser step (0-based
    # ``step``), for schedules that move with the step (a self-supervised task's EMA teacher)
    # optional ``before_optimizer_step()``: called after backward and gradient clipping, before the optimiser
    # step, for a task that drops gradients (DINO's frozen last layer in the first epochs)


TASKS: dict[str, type] = {}


def register_task(name: str):
    """Class decorator: make a task available as ``TrainConfig(task=name)`` / ``vitlab train --task name``."""

    def deco(cls: type) -> type:
        if name in TASKS and TASKS[name] is not cls:
            raise ValueError(f"task {name!r} is registered twice")
        TASKS[name] = cls
        cls.task_name = name
        return cls

    return deco


def _discover() -> None:
    """Import every ``vitlab.<capability>.tasks`` module so its tasks register themselves: the engine names no
    capability (``ssl``, ``dense``, ``clip`` ... bring their tasks), yet a run resumed from Python finds its task."""
    import vitlab

    for m in pkgutil.iter_modules(vitlab.__path__):
        if m.ispkg and importlib.util.find_spec(f"vitlab.{m.name}.tasks") is not None:
            importlib.import_module(f"vitlab.{m.name}.tasks")


def list_tasks() -> list[str]:
    _discover()
    return sorted(TASKS)


def create_task(name: str) -> Task:
    if name not in TASKS:
        _discover()
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; registered tasks: {', '.join(list_tasks()) or 'none'}")
    return TASKS[name]()


# ---------------------------------------------------------------- model transforms

MODEL_TRANSFORMS: dict[str, Any] = {}


def register_model_transform(name: str):
    """Decorator: a capability's transform of a freshly built model, ``fn(model, spec, training) -> module``,
    applied by the classification task when the config asks (``tome`` for ``tome_r``, ``prune`` for ``prune``).
    It patches ``model`` in place and returns the module to train: the model, or a module holding it as
    ``model`` whose ``forward(x, with_loss=True)`` returns ``(output, extra_loss)`` (flagged ``adds_loss``)."""

    def deco(fn):
        MODEL_TRANSFORMS[name] = fn
        return fn

    return deco


def model_transform(name: str):
    if name not in MODEL_TRANSFORMS:
        _discover()
    if name not in MODEL_TRANSFORMS:
        raise ValueError(f"no model transform {name!r} is registered")
    return MODEL_TRANSFORMS[name]
