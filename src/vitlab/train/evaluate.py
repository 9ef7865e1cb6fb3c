"""Task-generic use of a trained checkpoint: ``load_model(checkpoint)``, ``evaluate(checkpoint, data)`` and
``predict(checkpoint, inputs)``. A checkpoint is a run directory (its preferred weights), a checkpoint directory
or a ``model.safetensors`` written by ``vitlab train``; its :class:`~vitlab.train.task.RunRecord` names the task,
and the task rebuilds the model (``Task.load``), scores it (``Task.evaluate``) and runs it (``Task.predict``).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn

from vitlab.train import checkpoint as ck
from vitlab.train.task import RunRecord, Task, create_task, list_tasks, task_class


def load_model(checkpoint: str | Path, weights: str = "auto",
               device: str | torch.device = "cpu") -> tuple[nn.Module, RunRecord, Task]:
    """(model in eval mode with the checkpoint's weights, its run record, its task)."""
    sd, meta = ck.load_weights(checkpoint, weights=weights)
    record = RunRecord.from_meta(meta)
    task = create_task(record.task)
    model = task.load(record)
    model.load_state_dict(sd)
    return model.to(device).eval(), record, task


def run_dir_of(checkpoint: str | Path) -> Path:
    """The run directory a checkpoint belongs to (RUN, RUN/best, RUN/checkpoints/epoch-N[/model.safetensors])."""
    p = Path(checkpoint).resolve()
    if p.is_file():
        p = p.parent
    if p.parent.name == ck.CKPT_DIR:
        return p.parent.parent
    return p


def evaluate(checkpoint: str | Path, data: str | None = None, split: str = "test",
             output_dir: str | Path | None = None, weights: str = "auto", batch_size: int = 256,
             device: str = "cpu", optimize: bool = True) -> dict:
    """The checkpoint's task scores it on ``data`` (default: the data it was trained on) ``split``. Classification:
    top-1 / top-5 / per-class accuracy and the confusion matrix; segmentation: mIoU; depth: AbsRel, RMSE, ...;
    CLIP: zero-shot top-1 or retrieval recall; self-supervised: k-NN top-1. Files go to ``output_dir`` (default:
    the checkpoint's run directory); the result's ``summary`` is one line for the console."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    model, record, task = load_model(checkpoint, weights=weights, device=device)
    out = Path(output_dir) if output_dir else run_dir_of(checkpoint)
    result = task.evaluate(model, record, data, split, out_dir=out, batch_size=batch_size, device=device,
                           optimize=optimize)
    return {"checkpoint": str(checkpoint), **result}


def predict(checkpoint: str | Path, inputs: list[str | Path], output_dir: str | Path | None = None, topk: int = 5,
            weights: str = "auto", device: str = "cpu", optimize: bool = True, prompt: str | None = None) -> list[dict]:
    """The checkpoint's task run on ``inputs`` (image paths): one row per input, each with ``line`` (what the
    console prints). Classification: the top-k labels with probabilities; segmentation / depth: overlays and maps
    written under ``output_dir`` (default: ``RUN/predictions``); captioning: a caption; VQA: the answer to
    ``prompt`` (a task whose ``takes_prompt`` is set; any other refuses a prompt)."""
    from vitlab.data import check_image_files

    inputs = check_image_files(inputs)
    model, record, task = load_model(checkpoint, weights=weights, device=device)
    if prompt is not None and not task.takes_prompt:
        takers = ", ".join(name for name in list_tasks() if task_class(name).takes_prompt)
        raise ValueError(f"this run's task ({record.task}) takes no prompt; a prompt is for {takers} runs")
    out = Path(output_dir) if output_dir else run_dir_of(checkpoint) / "predictions"
    return task.predict(model, record, inputs, out, topk=topk, device=device, optimize=optimize, prompt=prompt)
