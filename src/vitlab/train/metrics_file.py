"""``RUN/metrics.jsonl``: the one record of a training run's figures, a JSON object per line, each with a
``"kind"``:

- ``"step"``: one line per optimiser step -- ``step``, ``epoch`` (fractional: 1.5 is half-way through the second
  epoch), ``loss``, ``lr``, ``grad_norm``, ``img_per_s``, ``tokens_per_s``, ``step_time_s``, ``data_wait``,
  ``mfu``, peak memory (see :mod:`vitlab.train.mfu`);
- ``"epoch"``: one line per epoch -- ``epoch`` (1-based), ``step``, ``train_loss``, ``lr``, the epoch's
  throughput, MFU and memory, and the validation metrics as ``val_*`` (``ema_val_*``) when it was evaluated.

Lines are appended and flushed as they happen, so a killed run keeps every line it logged (at worst the last one
half-written, which :func:`read_metrics` skips). A resumed run first rewrites the file atomically without the lines
logged after the checkpoint it resumes from, so every step and every epoch is there once. The trackers of
``--log`` receive the same values (:mod:`vitlab.train.trackers`)::

    from vitlab.train import read_metrics
    steps = read_metrics("runs/my-run", kind="step")     # [{"step": 1, "epoch": 0.11, "loss": 2.3, ...}, ...]
    epochs = read_metrics("runs/my-run", kind="epoch")   # [{"epoch": 1, "step": 9, "val_top1": 41.2, ...}, ...]
"""

from __future__ import annotations

import json
from pathlib import Path

from vitlab._io import atomic_write

METRICS_FILE = "metrics.jsonl"
KINDS = ("step", "epoch")


def _path(run: str | Path) -> Path:
    path = Path(run)
    return path / METRICS_FILE if path.is_dir() else path


def read_metrics(run: str | Path, kind: str | None = None) -> list[dict]:
    """The lines of a run's ``metrics.jsonl`` (``run``: the run directory or the file), in the order they were
    written. ``kind="step"`` or ``"epoch"``: only the lines of that kind, without their ``"kind"`` key (an epoch
    line as ``Trainer.metrics`` holds it); ``None``: every line, ``"kind"`` included. A half-written last line (a
    run killed while writing it) is skipped."""
    if kind not in (None, *KINDS):
        raise ValueError(f"unknown kind {kind!r} of metrics line (known: {', '.join(KINDS)}, or None for all)")
    path = _path(run)
    if not path.is_file():
        raise FileNotFoundError(f"no metrics file at {path}")
    lines = path.read_text().splitlines()
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:  # the line a killed run was writing
                break
            row = None
        if not isinstance(row, dict):
            raise ValueError(f"{path}, line {i + 1}: not a JSON object")
        if kind is None:
            rows.append(row)
        elif row.get("kind") == kind:
            rows.append({k: v for k, v in row.items() if k != "kind"})
    return rows


class MetricsWriter:
    """Appends the lines of ``RUN/metrics.jsonl`` (rank 0). A fresh run starts an empty file; a run resumed from a
    checkpoint after optimiser step ``step`` and ``epochs`` completed epochs keeps the step lines up to ``step`` and
    the epoch lines up to ``epochs`` -- dropping what the interrupted run logged after its checkpoint, among them an
    epoch line written just before the checkpoint that never came -- in one atomic rewrite."""

    def __init__(self, run_dir: str | Path, resume_at: tuple[int, int] | None = None):
        path = Path(run_dir) / METRICS_FILE
        kept = []
        if resume_at is not None and path.is_file():
            step, epochs = resume_at
            kept = [r for r in read_metrics(path) if (r.get("kind") == "step" and r["step"] <= step)
                    or (r.get("kind") == "epoch" and r["epoch"] <= epochs)]
        atomic_write(path, "".join(json.dumps(r) + "\n" for r in kept).encode())
        self.file = open(path, "a")  # noqa: SIM115  (closed by close())

    def write(self, kind: str, row: dict) -> None:
        """One line of ``kind`` (``"step"`` or ``"epoch"``), flushed: a killed run keeps it."""
        self.file.write(json.dumps({"kind": kind, **row}) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


__all__ = ["KINDS", "METRICS_FILE", "MetricsWriter", "read_metrics"]
