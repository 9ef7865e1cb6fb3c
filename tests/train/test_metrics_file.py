"""``metrics.jsonl``: the writer's lines and its rewrite on resume, ``read_metrics`` by kind, a half-written last
line skipped, bad input in one line. (Training runs that write and resume it: test_step_checkpoints.py.)"""

from __future__ import annotations

import pytest

from vitlab.train import read_metrics
from vitlab.train.metrics_file import MetricsWriter


def _write(run, lines):
    w = MetricsWriter(run)
    for kind, row in lines:
        w.write(kind, row)
    w.close()


def test_kinds_order_and_the_rewrite_on_resume(tmp_path):
    _write(tmp_path, [("step", {"step": s, "epoch": s / 2, "loss": 1.0 / s}) for s in (1, 2)]
           + [("epoch", {"epoch": 1, "step": 2, "val_top1": 50.0})]
           + [("step", {"step": 3, "epoch": 1.5, "loss": 0.25})])
    assert [r["kind"] for r in read_metrics(tmp_path)] == ["step", "step", "epoch", "step"]
    assert read_metrics(tmp_path / "metrics.jsonl", "epoch") == [{"epoch": 1, "step": 2, "val_top1": 50.0}]
    assert read_metrics(tmp_path, "step")[2] == {"step": 3, "epoch": 1.5, "loss": 0.25}
    # resumed from the checkpoint at step 2 (one epoch done): step 3 goes; then appended after what stays
    w = MetricsWriter(tmp_path, resume_at=(2, 1))
    w.write("step", {"step": 3, "epoch": 1.5, "loss": 0.5})
    w.close()
    assert [(r["kind"], r["step"]) for r in read_metrics(tmp_path)] == [("step", 1), ("step", 2), ("epoch", 2),
                                                                        ("step", 3)]
    assert read_metrics(tmp_path, "step")[2]["loss"] == 0.5
    # resumed from step 1: the epoch line written after step 2 goes too; a fresh run starts an empty file
    MetricsWriter(tmp_path, resume_at=(1, 0)).close()
    assert [(r["kind"], r["step"]) for r in read_metrics(tmp_path)] == [("step", 1)]
    MetricsWriter(tmp_path).close()
    assert read_metrics(tmp_path) == []


def test_a_half_written_last_line_is_skipped_and_bad_input_is_one_line(tmp_path):
    _write(tmp_path, [("step", {"step": 1, "loss": 1.0})])
    path = tmp_path / "metrics.jsonl"
    with path.open("a") as f:
        f.write('{"kind": "step", "step": 2, "lo')
    assert [r["step"] for r in read_metrics(path, "step")] == [1]
    MetricsWriter(tmp_path, resume_at=(5, 0)).close()  # the rewrite drops it: appends start on a line of their own
    assert path.read_text() == '{"kind": "step", "step": 1, "loss": 1.0}\n'
    with path.open("a") as f:
        f.write('{"kind": "st\n{"kind": "step", "step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl, line 2: not a JSON object"):
        read_metrics(path)
    with pytest.raises(ValueError, match=r"unknown kind 'steps' of metrics line \(known: step, epoch"):
        read_metrics(path, "steps")
    with pytest.raises(FileNotFoundError, match="no metrics file at"):
        read_metrics(tmp_path / "elsewhere")
