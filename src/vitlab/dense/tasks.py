"""Trainer tasks ``segment`` and ``depth`` (``vitlab train --task segment|depth``): the same run directory,
checkpoints, resume, EMA, AMP and DDP / FSDP strategies as classification; the model is a
:class:`vitlab.dense.model.DenseModel` (``--task_args.head`` over the backbone ``--model``, or a registered dense
configuration as ``--model``).

- segment: pixel-wise cross-entropy with ``ignore_index`` 255 (SETR / Segmenter / DPT's loss; label smoothing
  off); validation and test by sliding windows, scored from one confusion matrix (mIoU, which picks the best
  checkpoint, per-class IoU, pixel accuracy).
- depth: the scale-invariant log loss (Eigen et al., 2014, Eq. 4; lambda 0.85, x10) or L1; AbsRel (picks the
  best, lower is better), RMSE, log10, delta < 1.25^k.
- Schedule: ``poly`` (the segmentation standard since DeepLab, Chen et al., 2017, Sec. 4.1: lr (1 - t)^0.9
  after the warm-up) or the engine's ``cosine``.

Options (``--task_args.KEY VALUE``): see :class:`SegmentArgs` / :class:`DepthArgs`; unknown keys are refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F

from vitlab.dense import metrics as M
from vitlab.dense.data import build_dense
from vitlab.dense.infer import slide
from vitlab.dense.model import create, get_config, list_models
from vitlab.train.classification import prepare_model
from vitlab.train.config import parse_task_args
from vitlab.train.recipe import WarmupCosine, param_groups
from vitlab.train.task import register_task


class WarmupPoly(WarmupCosine):
    """Linear warm-up, then poly decay ``min_lr + (base - min_lr) * (1 - t) ** power`` (t: 0 -> 1)."""

    power = 0.9

    def lr(self, step: int | None = None) -> float:
        step = self.step_count if step is None else step
        if self.warmup_steps > 0 and step < self.warmup_steps:
            return super().lr(step)
        t = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        return self.min_lr + (self.base_lr - self.min_lr) * (1.0 - t) ** self.power


@dataclass
class SegmentArgs:
    head: str = "setr_pup"                     # a vitlab.dense head (ignored when --model is a dense config)
    num_classes: int | None = None             # default: the data's (segfolder: classes.txt or largest label + 1)
    ignore_index: int = 255                    # target value left out of loss and metrics
    schedule: Literal["poly", "cosine"] = "poly"
    indices: list[int] | None = None           # blocks / stages the head reads (default: the head's)
    head_kwargs: dict = field(default_factory=dict)  # decoder options, e.g. {readout: add, window_size: 8}
    stride: int | None = None                  # sliding-window stride (default 2/3 of the crop)
    shapes_train: int | None = None            # shapes: number of training scenes (default 800)
    shapes_eval: int | None = None             # shapes: validation and test scenes each (default 100)
    shapes_size: int = 64                      # shapes: scene side in pixels (also the default crop: one window)


@dataclass
class DepthArgs:
    head: str = "dpt"                          # 'dpt' or 'linear_depth' (ignored for a dense config --model)
    loss: Literal["silog", "l1"] = "silog"
    silog_lambda: float = 0.85
    depth_scale: float = 1000.0                # depthfolder 16-bit PNGs: depth (m) = value / depth_scale
    schedule: Literal["poly", "cosine"] = "poly"
    indices: list[int] | None = None
    head_kwargs: dict = field(default_factory=dict)
    stride: int | None = None
    shapes_train: int | None = None
    shapes_eval: int | None = None
    shapes_size: int | None = None


class _DenseTask:
    kind = "segment"
    args_cls = SegmentArgs

    def build(self, cfg, device: torch.device) -> None:
        self.cfg, self.device = cfg, device
        self.args = a = parse_task_args(cfg.task_args, self.args_cls)
        data_cfg = cfg.data if cfg.data.dataset != "digits" else replace(cfg.data, dataset="shapes")
        dense_cfg = cfg.model in list_models()
        if dense_cfg:
            mcfg = get_config(cfg.model)
            mean, std = mcfg.mean, mcfg.std
        else:
            import vitlab

            mcfg = vitlab.get_model_config(cfg.model)
            mean, std = mcfg.mean, mcfg.std
        mean, std = tuple(mean)[:3] * (3 // len(mean)), tuple(std)[:3] * (3 // len(std))
        self.data = build_dense(data_cfg, self.kind, mean, std,
                                num_classes=getattr(a, "num_classes", None),
                                depth_scale=getattr(a, "depth_scale", 1000.0), shapes_train=a.shapes_train,
                                shapes_eval=a.shapes_eval, shapes_size=a.shapes_size)
        b = self.data
        spec = {"task": self.kind, "img_size": b.img_size}
        if self.kind == "segment":
            spec["num_classes"] = b.num_classes
        if dense_cfg:
            spec["head"] = cfg.model
        else:
            spec.update(head=a.head, backbone=cfg.model, backbone_kwargs=dict(cfg.model_kwargs),
                        head_kwargs=dict(a.head_kwargs), indices=a.indices)
        self.spec = spec
        model = create(drop_path_rate=cfg.drop_path, **spec)
        self.num_params = sum(p.numel() for p in model.parameters())
        self.model = self.module = prepare_model(model, cfg, device)
        self.scheduler_class = WarmupPoly if a.schedule == "poly" else WarmupCosine

    def param_groups(self, weight_decay: float) -> list[dict]:
        return param_groups(self.model, weight_decay)

    def _batch(self, batch):
        x, y = batch
        x = x.to(self.device, non_blocking=True)
        if self.cfg.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x, y.to(self.device, non_blocking=True)

    def _slide(self, x, forward):
        return slide(forward, x, self.data.img_size, self.model.num_classes, self.args.stride)

    def description(self) -> dict:
        b = self.data
        return {"model": self.cfg.model, "task": self.kind, "dense": self.spec, "num_classes": b.num_classes,
                "class_names": b.class_names, "in_chans": 3, "img_size": b.img_size, "mean": list(b.mean),
                "std": list(b.std), "data": b.config.to_dict(), "params": self.num_params,
                "depth_scale": getattr(self.args, "depth_scale", 1000.0), "shapes_eval": self.args.shapes_eval,
                "shapes_size": self.args.shapes_size}

    def summary(self) -> dict:
        b = self.data
        name = self.spec["head"] + ("" if self.spec["head"] == self.cfg.model else f" on {self.cfg.model}")
        return {"model": name, "dataset": b.name, "params_m": self.num_params / 1e6, "img_size": b.img_size,
                "train_images": len(b.train), "val_images": len(b.val)}

    def test(self, run_dir, batch_size: int, checkpoint: str = "last") -> dict:
        """The test split (shapes: 100 scenes; depth: the Middlebury motorcycle) with ``checkpoint``'s weights."""
        from vitlab.dense.infer import load_dense

        keys = self.test_keys
        run_dir = Path(run_dir)
        if self.data.test is None or not (run_dir / checkpoint).exists():
            return {f"test_{k}": None for k in keys}
        model, _ = load_dense(run_dir / checkpoint, device=self.device)
        sums = None
        with torch.no_grad():
            for batch in self.data.loader("test", batch_size=min(batch_size, 32)):
                s = self.validation_step(batch, model)
                sums = s if sums is None else {k: sums[k] + s[k] for k in s}
        r = self.validation_metrics(sums)
        return {f"test_{k}": r[k] for k in keys}


@register_task("segment")
class SegmentTask(_DenseTask):
    """Semantic segmentation: cross-entropy with ignore_index; mIoU picks the best checkpoint."""

    # what ``vitlab train --task segment`` defaults to (vitlab.cli.train.task_recipe; flags override it): the
    # embedded demo's recipe, measured by benchmarks/dense_demo.py (docs/benchmarks.md)
    recipe: ClassVar[dict] = {
        "model": "vit_pico_patch4_32", "epochs": 30, "batch_size": 16, "lr": 6.4e-2, "warmup_epochs": 0.5,
        "drop_path": 0.0, "eval_every": 5, "data.dataset": "shapes", "data.img_size": 64,
        "data.scale": [0.5, 1.0],
        "task_args.head": "vitdet_sfp",
        # global attention in all four blocks: the windowed ViTDet backbone (8 x 8 windows in blocks 0 and 2 of
        # the 16 x 16 grid) scored 0.795 against 0.803 in the same 1,500 steps
        "task_args.head_kwargs": {"out_channels": 64, "channels": 64, "global_blocks": [0, 1, 2, 3]}}
    monitor = "miou"
    kind = "segment"
    args_cls = SegmentArgs
    test_keys = ("miou", "pixel_acc")

    def training_step(self, batch, forward):
        x, y = self._batch(batch)
        return F.cross_entropy(forward(x).float(), y.long(), ignore_index=self.args.ignore_index), {}

    def validation_step(self, batch, forward) -> dict[str, torch.Tensor]:
        x, y = self._batch(batch)
        out = self._slide(x, forward)
        y = y.long()
        loss = F.cross_entropy(out, y, ignore_index=self.args.ignore_index, reduction="sum")
        return {"confusion": M.confusion_matrix(out.argmax(1).cpu(), y.cpu(), self.model.num_classes,
                                                self.args.ignore_index),
                "loss": loss.detach().double().cpu()}

    def validation_metrics(self, sums) -> dict[str, float]:
        s = M.segmentation_scores(sums["confusion"])
        return {"miou": s["miou"], "pixel_acc": s["pixel_acc"],
                "loss": sums["loss"].item() / max(int(sums["confusion"].sum()), 1)}


@register_task("depth")
class DepthTask(_DenseTask):
    """Monocular depth: SILog (or L1) on valid pixels; AbsRel (lower is better) picks the best checkpoint."""

    monitor = "abs_rel"
    monitor_mode = "min"
    kind = "depth"
    args_cls = DepthArgs
    test_keys = ("abs_rel", "rmse", "log10", "delta1", "delta2", "delta3")

    def training_step(self, batch, forward):
        x, y = self._batch(batch)
        pred = forward(x).float()[:, 0]
        if self.args.loss == "silog":
            return M.silog_loss(pred, y, lam=self.args.silog_lambda), {}
        m = M.valid_depth(y)
        return (pred[m] - y[m]).abs().mean() if m.any() else pred.sum() * 0.0, {}

    def validation_step(self, batch, forward) -> dict[str, torch.Tensor]:
        x, y = self._batch(batch)
        return M.depth_sums(self._slide(x, forward)[:, 0].cpu(), y.cpu())

    def validation_metrics(self, sums) -> dict[str, float]:
        return M.depth_scores(sums)
