"""Training and evaluation: ``fit(TrainConfig) -> summary``, ``evaluate(checkpoint, data)``,
``predict(checkpoint, images)``.

    from vitlab.train import TrainConfig, fit
    summary = fit(TrainConfig())            # the default model on digits, on the CPU
    summary["test_top1"], summary["run_dir"]
    fit(TrainConfig(resume=summary["run_dir"], epochs=60))   # continue the run (its own model and data)

Modules: ``config`` (TrainConfig, YAML), ``trainer`` (Trainer, fit), ``task`` (the Task protocol and registry),
``classification`` (ClassificationTask: supervised + DeiT distillation), ``strategy`` (SingleDevice, DDP, FSDP2
under torchrun), ``recipe`` (parameter groups, AdamW, warm-up + cosine, losses, EMA), ``checkpoint`` (atomic
saves, last/best), ``evaluate`` (evaluate, predict), ``plots``, ``progress``.
"""

from vitlab.train.classification import ClassificationTask
from vitlab.train.config import DistillConfig, TrainConfig
from vitlab.train.evaluate import evaluate, predict
from vitlab.train.strategy import DDP, FSDP2, SingleDevice, Strategy
from vitlab.train.task import Task, list_tasks, register_task
from vitlab.train.trainer import Trainer, fit

__all__ = ["DDP", "FSDP2", "ClassificationTask", "DistillConfig", "SingleDevice", "Strategy", "Task",
           "TrainConfig", "Trainer", "evaluate", "fit", "list_tasks", "predict", "register_task"]
