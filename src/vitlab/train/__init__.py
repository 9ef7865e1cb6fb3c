"""The training engine: ``fit(TrainConfig) -> summary``, and task-generic ``evaluate(checkpoint)`` /
``predict(checkpoint, inputs)``.

    from vitlab.train import TrainConfig, fit, read_metrics
    summary = fit(TrainConfig.for_task("classify"))   # the default model on digits, on the CPU
    summary["test_top1"], summary["run_dir"]
    fit(TrainConfig(resume=summary["run_dir"], epochs=60))   # continue the run (its own model and data)
    read_metrics(summary["run_dir"], kind="step")            # per optimiser step: loss, lr, grad_norm, mfu...

Modules: ``task`` (the Task spec, its RunRecord, the task and model-transform registries), ``config``
(TrainConfig, YAML, ``for_task``), ``trainer`` (Trainer, fit), ``callbacks`` (the Callback protocol, the tracker
registry), ``trackers`` (TensorBoard, MLflow, W&B), ``mfu`` (MFU, throughput, peak memory), ``common`` (what
every task shares: autocast, metric sums, model placement, image data), ``strategy`` (SingleDevice, DDP, FSDP2
under torchrun; the loaders), ``recipe`` (parameter groups, AdamW, warm-up + cosine, losses, EMA), ``checkpoint``
(atomic saves, last/best, step checkpoints), ``metrics_file`` (``RUN/metrics.jsonl``, a line per step and per
epoch, and ``read_metrics``), ``evaluate`` (load_model, evaluate, predict from a checkpoint's run record),
``plots``, ``progress``.
"""

from vitlab.train.callbacks import Callback, Tracker, register_tracker
from vitlab.train.config import TrainConfig
from vitlab.train.evaluate import evaluate, load_model, predict
from vitlab.train.metrics_file import read_metrics
from vitlab.train.strategy import DDP, FSDP2, SingleDevice, Strategy
from vitlab.train.task import (
    RunRecord,
    Task,
    TaskError,
    list_tasks,
    register_model_transform,
    register_task,
    task_class,
)
from vitlab.train.trackers import list_trackers
from vitlab.train.trainer import Trainer, fit

__all__ = ["DDP", "FSDP2", "Callback", "RunRecord", "SingleDevice", "Strategy", "Task", "TaskError", "Tracker",
           "TrainConfig", "Trainer", "evaluate", "fit", "list_tasks", "list_trackers", "load_model", "predict",
           "read_metrics", "register_model_transform", "register_task", "register_tracker", "task_class"]
