"""Self-supervised pre-training under torchrun with two gloo processes on CPU (DINO: EMA teacher, centre averaged
over the ranks, freeze_last_layer): an interrupted and resumed two-process run continues where it stopped and
ends exactly where an uninterrupted one does (losses, backbone, teacher, centre, schedules). Three launches of a
tiny model (2 steps an epoch), about a minute on 2 busy cores: ``slow``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vitlab.train import checkpoint as ck
from vitlab.train import read_metrics

ROOT = Path(__file__).resolve().parents[2]
# 32 fake 16x16 images, 2 processes x batch 8: 2 optimiser steps an epoch; a 1-block, 32-wide ViT at patch 8
# (2x2 tokens) with two 8-pixel local crops (one token each).
COMMON = ["--method", "dino", "--model", "vit_pico_patch8_32", "--data", "fake", "--data.fake_num_samples", "32",
          "--data.fake_img_size", "16", "--data.fake_num_classes", "4", "--model_kwargs.depth", "1",
          "--model_kwargs.embed_dim", "32", "--model_kwargs.num_heads", "2", "--epochs", "2", "--batch-size", "8",
          "--lr", "5e-3", "--warmup_epochs", "1", "--drop_path", "0", "--strategy", "ddp", "--quiet",
          "--task_args.out_dim", "64", "--task_args.hidden_dim", "32", "--task_args.bottleneck_dim", "16",
          "--task_args.local_crops", "2", "--task_args.local_crop_size", "8",
          "--task_args.warmup_teacher_temp_epochs", "2"]


def _launch(*args: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "vitlab", "pretrain", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def _rows(run: Path) -> list[dict]:
    return read_metrics(run, "epoch")


@pytest.mark.slow
def test_two_process_ddp_pretraining_resumes_exactly(tmp_path):
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    _launch(*COMMON, "--output-dir", str(straight))
    _launch(*COMMON, "--output-dir", str(cut), "--stop_after", "1")
    assert [r["epoch"] for r in _rows(cut)] == [1]
    _launch("--resume", str(cut), "--output-dir", str(cut))
    a, b = _rows(straight), _rows(cut)
    assert [r["epoch"] for r in b] == [1, 2]  # the resumed run continued with epoch 2
    assert [r["train_loss"] for r in a] == pytest.approx([r["train_loss"] for r in b], rel=1e-6, abs=1e-7)
    assert json.loads((cut / "summary.json").read_text())["world_size"] == 2
    wa, wb = load_file(str(straight / "last" / "model.safetensors")), load_file(str(cut / "last" / "model.safetensors"))
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=1e-6)
    sa, sb = ck.load_trainer_state(straight / "last"), ck.load_trainer_state(cut / "last")
    assert int(sa["progress"]["step"]) == int(sb["progress"]["step"]) == 4
    for part in ("teacher", "center"):
        for k in sa[part]:
            torch.testing.assert_close(sa[part][k], sb[part][k], rtol=0, atol=1e-6)
