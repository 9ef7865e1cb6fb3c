"""A task plugs into the Trainer without touching it: a toy regression task (lower is better) trains, validates,
checkpoints and resumes exactly through ``fit``; the registry lists it beside ``classify``."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from vitlab.data import DataConfig, build
from vitlab.train import RunRecord, Task, TrainConfig, fit, list_tasks, read_metrics, register_task
from vitlab.train import checkpoint as ck
from vitlab.train.task import create_task


@register_task("toy_brightness")
class BrightnessTask(Task):
    """Predict an image's mean brightness from its pixels (MSE)."""

    monitor = "mse"
    monitor_mode = "min"

    def build(self, cfg, device):
        self.cfg, self.device = cfg, device
        self.data = build(cfg.data, in_chans=1)
        n = self.data.img_size ** 2
        self.model = self.module = nn.Sequential(nn.Flatten(), nn.Linear(n, 8), nn.GELU(), nn.Linear(8, 1)).to(device)

    def param_groups(self, weight_decay):
        return [{"params": list(self.module.parameters()), "weight_decay": weight_decay}]

    def _xy(self, batch):
        x = batch[0].to(self.device)
        return x, x.mean(dim=(1, 2, 3))

    def training_step(self, batch, forward):
        x, y = self._xy(batch)
        return F.mse_loss(forward(x).squeeze(-1), y), {}

    def validation_step(self, batch, forward):
        x, y = self._xy(batch)
        err = (forward(x).squeeze(-1).float() - y) ** 2
        return {"sq": err.sum().double().cpu(), "n": torch.tensor(float(len(y)), dtype=torch.float64)}

    def validation_metrics(self, sums):
        return {"mse": (sums["sq"] / sums["n"]).item(), "loss": (sums["sq"] / sums["n"]).item()}

    def record(self):
        return RunRecord(task=self.name, model="toy_brightness_mlp")

    def summary(self):
        return {"model": "toy_brightness_mlp", "dataset": self.data.name}


def _cfg(out, **kw):
    data = DataConfig("fake", fake_num_samples=32, fake_num_classes=2, fake_img_size=8, randaugment=False,
                      reprob=0.0, mixup=0.0, cutmix=0.0)
    return TrainConfig(task="toy_brightness", data=data, epochs=3, batch_size=8, lr=0.05, warmup_epochs=0,
                       ema_decay=0.5, quiet=True, output_dir=str(out / "run"), **kw)


def test_a_new_task_trains_and_resumes_through_the_same_trainer(tmp_path):
    assert {"classify", "toy_brightness"} <= set(list_tasks())
    s = fit(_cfg(tmp_path / "a"))
    assert s["task"] == "toy_brightness" and s["finished"] and s["best_val_mse"] is not None
    run = tmp_path / "a" / "run"
    rows = read_metrics(run, "epoch")
    assert [r["epoch"] for r in rows] == [1, 2, 3] and all("val_mse" in r and "ema_val_mse" in r for r in rows)
    best = min(min(r["val_mse"], r["ema_val_mse"]) for r in rows)  # lower is better
    assert s["best_val_mse"] == best
    assert (run / "curves.png").stat().st_size > 0 and (run / "best").exists()
    # exact resume
    fit(_cfg(tmp_path / "b", stop_after=1))
    fit(TrainConfig(resume=str(tmp_path / "b" / "run")))
    rows_b = read_metrics(tmp_path / "b" / "run", "epoch")
    assert [r["train_loss"] for r in rows] == [r["train_loss"] for r in rows_b]
    wa, _ = ck.load_weights(run / "last", weights="raw")
    wb, _ = ck.load_weights(tmp_path / "b" / "run" / "last", weights="raw")
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=0)


def test_unknown_task_is_one_clear_error():
    with pytest.raises(ValueError, match="unknown task 'nope' \\(registered tasks: .*classify"):
        create_task("nope")
    with pytest.raises(ValueError, match="unknown task 'clasify'; did you mean classify"):
        TrainConfig(task="clasify")


def test_capability_tasks_are_discovered_and_classify_refuses_task_args(tmp_path):
    assert {"classify", "mae", "simclr", "mocov3", "dino", "dinov2", "segment", "depth", "clip"} <= set(list_tasks())
    with pytest.raises(ValueError, match="unknown task option key\\(s\\): 'task_args.mask_ratio'"):
        TrainConfig(task="classify", task_args={"mask_ratio": 0.75}, epochs=1, output_dir=str(tmp_path / "r"))
