"""A user's vitlab plugin, outside the package: it registers a task, a dataset, a dense head and a
self-supervised method (SimSiam) without editing vitlab. Loaded by ``vitlab --import vitlab_toy_plugin ...`` or
through the entry-point group ``vitlab.plugins``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image, ImageDraw
from torch.utils.data import Dataset

import vitlab.data
import vitlab.dense
import vitlab.ssl
from vitlab.train import RunRecord, Task, register_task
from vitlab.train.common import build_image_data

# ---------------------------------------------------------------- a dataset: PIL images of three shapes

SHAPES = ("circle", "square", "triangle")


class ToyShapes(Dataset):
    """Grey 24-pixel PIL images of a white circle, square or triangle at a position drawn from ``seed``."""

    classes = list(SHAPES)

    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.items = [(int(i % 3), *torch.randint(4, 12, (2,), generator=g).tolist()) for i in range(n)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        label, x, y = self.items[i]
        img = Image.new("RGB", (24, 24), (40, 40, 40))
        d = ImageDraw.Draw(img)
        box = (x, y, x + 10, y + 10)
        if label == 0:
            d.ellipse(box, fill=(255, 255, 255))
        elif label == 1:
            d.rectangle(box, fill=(255, 255, 255))
        else:
            d.polygon([(x, y + 10), (x + 10, y + 10), (x + 5, y)], fill=(255, 255, 255))
        return img, label


@vitlab.data.register_dataset("toy_shapes")
def toy_shapes(split: str, root: str | None, n: int = 48, **options) -> Dataset:
    """``--data toy_shapes``: ``n`` training images, a quarter of that each for val and test."""
    count = n if split == "train" else max(3, n // 4)
    return ToyShapes(count, seed={"train": 0, "val": 1, "test": 2}[split])


# ---------------------------------------------------------------- a dense head


@vitlab.dense.register_head("toy_head")
class ToyHead(nn.Module):
    """A 1x1 convolution of the last feature map to the class logits."""

    def __init__(self, in_channels: list[int], num_classes: int, **kwargs):
        super().__init__()
        self.proj = nn.Conv2d(in_channels[-1], num_classes, 1)

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        return self.proj(features[-1])


# ---------------------------------------------------------------- an SSL method: SimSiam (Chen & He, 2021)


@vitlab.ssl.register_method("simsiam")
class SimSiam(vitlab.ssl.SSLMethod):
    """Two views, a projector, a predictor and a stop-gradient; the negative cosine of prediction and target."""

    views = vitlab.ssl.ViewSpec(global_views=2)

    def __init__(self, backbone: nn.Module, dim: int = 64, pred_dim: int = 16):
        super().__init__(backbone)
        width = backbone.num_features
        self.projector = nn.Sequential(nn.Linear(width, dim), nn.BatchNorm1d(dim), nn.ReLU(), nn.Linear(dim, dim))
        self.predictor = nn.Sequential(nn.Linear(dim, pred_dim), nn.ReLU(), nn.Linear(pred_dim, dim))

    def objective(self, views: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        z1, z2 = (self.projector(self.features(v)) for v in views[:2])
        p1, p2 = self.predictor(z1), self.predictor(z2)
        loss = -(F.cosine_similarity(p1, z2.detach()).mean() + F.cosine_similarity(p2, z1.detach()).mean()) / 2
        return {"loss": loss}


# ---------------------------------------------------------------- a task: regress an image's brightness


@dataclass
class BrightnessArgs:
    hidden: int = 8          # width of the MLP
    scale: float = 1.0       # target = scale * mean brightness


@register_task("toy_brightness_plugin")
class BrightnessTask(Task):
    """Predict an image's mean brightness (MSE, lower is better); ``evaluate`` reports the MSE, no ``predict``."""

    monitor = "mse"
    monitor_mode = "min"
    Args = BrightnessArgs

    def build(self, cfg, device):
        self.cfg, self.device, self.args = cfg, device, cfg.task_args
        self.data = build_image_data(cfg, vitlab.get_model_config(cfg.model))
        n = self.data.in_chans * self.data.img_size ** 2
        self.model = self.module = self._mlp(n, self.args.hidden).to(device)

    @staticmethod
    def _mlp(n: int, hidden: int) -> nn.Module:
        return nn.Sequential(nn.Flatten(), nn.Linear(n, hidden), nn.GELU(), nn.Linear(hidden, 1))

    def _xy(self, batch, device):
        x = batch[0].to(device)
        return x, self.args.scale * x.mean(dim=(1, 2, 3))

    def training_step(self, batch, forward):
        x, y = self._xy(batch, self.device)
        return F.mse_loss(forward(x).squeeze(-1), y), {}

    def validation_step(self, batch, forward):
        x, y = self._xy(batch, self.device)
        err = (forward(x).squeeze(-1).float() - y) ** 2
        return {"sq": err.sum().double().cpu(), "n": torch.tensor(float(len(y)), dtype=torch.float64)}

    def validation_metrics(self, sums):
        return {"mse": (sums["sq"] / sums["n"]).item()}

    def record(self):
        b = self.data
        return RunRecord(task=self.name, model=self.cfg.model, task_args={"hidden": self.args.hidden,
                                                                        "scale": self.args.scale},
                         data=b.config.to_dict(), img_size=b.img_size, in_chans=b.in_chans)

    def summary(self):
        return {"model": "brightness MLP", "dataset": self.data.name}

    def load(self, record):
        self.args = BrightnessArgs(**record.task_args)
        return self._mlp(record.in_chans * record.img_size ** 2, self.args.hidden)

    def evaluate(self, model, record, data, split, *, out_dir: Path, batch_size=256, device="cpu", optimize=True):
        from vitlab.data import DataConfig, build

        bundle = build(DataConfig(**record.data), in_chans=record.in_chans)
        self.device = torch.device(device)
        sums = None
        with torch.no_grad():
            for batch in bundle.loader(split if getattr(bundle, split) is not None else "val", batch_size):
                s = self.validation_step(batch, model)
                sums = s if sums is None else {k: sums[k] + s[k] for k in s}
        mse = self.validation_metrics(sums)["mse"]
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "eval-brightness.json").write_text(json.dumps({"mse": mse}))
        return {"mse": mse, "summary": f"brightness MSE {mse:.5f}", "files": [str(out_dir / "eval-brightness.json")]}
