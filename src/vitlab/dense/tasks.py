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
- Decoder sizing: without ``head_kwargs`` a decoder over a backbone narrower than its own 256 channels is sized
  to the backbone (:func:`default_head_kwargs`), so a width-64 ViT does not carry a 19.5M-parameter DPT.

Options (``--task_args.KEY VALUE``): see :class:`SegmentArgs` / :class:`DepthArgs`; unknown keys are refused. The
run record carries the built model's spec, so ``vitlab eval`` / ``vitlab predict`` (:mod:`vitlab.dense.infer`)
rebuild it from the checkpoint alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

import vitlab
from vitlab.dense import infer
from vitlab.dense import metrics as M
from vitlab.dense.backbone import feature_specs, num_levels
from vitlab.dense.data import build_dense
from vitlab.dense.model import create, get_config, list_models
from vitlab.train.common import add_sums, model_kwargs, prepare_model
from vitlab.train.config import to_plain
from vitlab.train.recipe import WarmupCosine
from vitlab.train.task import RunRecord, Task, register_task


class WarmupPoly(WarmupCosine):
    """Linear warm-up, then poly decay ``min_lr + (base - min_lr) * (1 - t) ** power`` (t: 0 -> 1)."""

    power = 0.9

    def lr(self, step: int | None = None) -> float:
        step = self.step_count if step is None else step
        if self.warmup_steps > 0 and step < self.warmup_steps:
            return super().lr(step)
        t = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        return self.min_lr + (self.base_lr - self.min_lr) * (1.0 - t) ** self.power


# ---------------------------------------------------------------- decoder sizing

# the channels the papers give their decoders (DPT's fusion, ViTDet's pyramid): sized for ViT-B-wide backbones
DECODER_WIDTH = 256


def _vitdet_sfp_small(width: int, depth: int) -> dict:
    # global attention in every block: on the demo's 16 x 16 grid the windowed ViTDet backbone (8 x 8 windows in
    # blocks 0 and 2 of 4) scored 0.795 mIoU against 0.803 in the same 1,500 steps
    return {"out_channels": width, "channels": min(128, width), "global_blocks": list(range(depth))}


def _dpt_small(width: int, depth: int) -> dict:
    # DINOv2's DPT heads (Oquab et al., 2024): reassemble to width / 8, / 4, / 2, width (ViT-B: DPT's 96, 192, 384,
    # 768); fusion at the backbone's width instead of 256
    return {"hidden": [max(1, width // 2 ** (3 - i)) for i in range(4)], "fusion": width}


# head -> its options over a backbone narrower than DECODER_WIDTH, from (width of the last map, blocks / stages)
SMALL_BACKBONE_HEAD_KWARGS: dict[str, Callable[[int, int], dict]] = {
    "vitdet_sfp": _vitdet_sfp_small, "dpt": _dpt_small}


def default_head_kwargs(head: str, backbone: str, backbone_kwargs: dict | None = None) -> dict:
    """The decoder options of ``head`` over ``backbone`` when a run names none: sized to a backbone narrower than
    :data:`DECODER_WIDTH` channels (:data:`SMALL_BACKBONE_HEAD_KWARGS`), else the head's own (the paper's)."""
    sizing = SMALL_BACKBONE_HEAD_KWARGS.get(head)
    if sizing is None:
        return {}
    with torch.device("meta"):  # the shape only: no memory, no initialisation
        bb = vitlab.create_model(backbone, num_classes=0, **(backbone_kwargs or {}))
    depth = num_levels(bb)
    width = feature_specs(bb, [depth - 1])[0][0]
    return sizing(width, depth) if width < DECODER_WIDTH else {}


# ---------------------------------------------------------------- options


@dataclass
class SegmentArgs:
    """The segmentation task's options (``--task_args.NAME``)."""

    head: str = "setr_pup"                     # a vitlab.dense head (ignored when --model is a dense config)
    num_classes: int | None = None             # default: the data's (segfolder: classes.txt or largest label + 1)
    ignore_index: int = 255                    # target value left out of loss and metrics
    schedule: Literal["poly", "cosine"] = "poly"
    indices: list[int] | None = None           # blocks / stages the head reads (default: the head's)
    head_kwargs: dict | None = None            # decoder options, e.g. {readout: add} (None: sized to the backbone)
    stride: int | None = None                  # sliding-window stride (default 2/3 of the crop)
    shapes_train: int | None = None            # shapes: number of training scenes (default 800)
    shapes_eval: int | None = None             # shapes: validation and test scenes each (default 100)
    shapes_size: int = 64                      # shapes: scene side in pixels (also the default crop: one window)


@dataclass
class DepthArgs:
    """The depth task's options (``--task_args.NAME``)."""

    head: str = "dpt"                          # 'dpt' or 'linear_depth' (ignored for a dense config --model)
    loss: Literal["silog", "l1"] = "silog"
    silog_lambda: float = 0.85                 # SILog's variance weight, in [0, 1]
    depth_scale: float = 1000.0                # depthfolder 16-bit PNGs: depth (m) = value / depth_scale
    schedule: Literal["poly", "cosine"] = "poly"
    indices: list[int] | None = None           # blocks / stages the head reads (default: the head's)
    head_kwargs: dict | None = None            # decoder options (None: sized to the backbone)
    stride: int | None = None                  # sliding-window stride (default 2/3 of the crop)
    shapes_train: int | None = None            # shapes: number of training scenes (default 800)
    shapes_eval: int | None = None             # shapes: validation scenes (default 100)
    shapes_size: int | None = None             # shapes: scene side in pixels (default 96)


# ---------------------------------------------------------------- the tasks


class _DenseTask(Task):
    """What segment and depth share: the model (a head over a backbone, or a dense configuration), the data, the
    sliding-window validation, the schedule and the run record."""

    kind: ClassVar[Literal["segment", "depth"]] = "segment"   # what the model predicts (vitlab.dense.create's task)
    test_keys: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def check(cls, cfg) -> None:
        a = cfg.task_args
        checks = [
            (a.stride is None or a.stride >= 1, f"stride must be >= 1, got {a.stride}"),
            (all(n is None or n >= 1 for n in (a.shapes_train, a.shapes_eval)),
             f"shapes_train and shapes_eval must be >= 1, got {a.shapes_train} and {a.shapes_eval}"),
            (a.shapes_size is None or a.shapes_size >= 8, f"shapes_size must be >= 8 pixels, got {a.shapes_size}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)

    def build(self, cfg, device: torch.device) -> None:
        """The dense data of ``cfg.data`` (``shapes``, or ``segfolder:PATH`` / ``depthfolder:PATH``; another
        dataset is a one-line DataError) normalised for the backbone, and the model over it."""
        self.cfg, self.device, self.args = cfg, device, cfg.task_args
        a = self.args
        dense_cfg = cfg.model in list_models()
        mcfg = get_config(cfg.model) if dense_cfg else vitlab.get_model_config(cfg.model)
        mean, std = tuple(mcfg.mean)[:3] * (3 // len(mcfg.mean)), tuple(mcfg.std)[:3] * (3 // len(mcfg.std))
        self.data = b = build_dense(cfg.data, self.kind, mean, std, num_classes=getattr(a, "num_classes", None),
                                    depth_scale=getattr(a, "depth_scale", 1000.0), shapes_train=a.shapes_train,
                                    shapes_eval=a.shapes_eval, shapes_size=a.shapes_size)
        spec: dict[str, Any] = {"task": self.kind, "img_size": b.img_size}
        if self.kind == "segment":
            spec["num_classes"] = b.num_classes
        if dense_cfg:
            spec["head"] = cfg.model
        else:
            bk = model_kwargs(cfg)
            hk = default_head_kwargs(a.head, cfg.model, bk) if a.head_kwargs is None else dict(a.head_kwargs)
            spec.update(head=a.head, backbone=cfg.model, backbone_kwargs=bk, head_kwargs=hk, indices=a.indices)
        self.spec = spec
        model = create(drop_path_rate=cfg.drop_path, **spec)
        self.num_params = sum(p.numel() for p in model.parameters())
        self.model = self.module = prepare_model(model, cfg, device)

    def scheduler(self, optimizer, total_steps: int, warmup_steps: int, base_lr: float, min_lr: float,
                  warmup_lr: float):
        """Poly (``schedule: poly``, the default) or cosine after the linear warm-up."""
        cls = WarmupPoly if self.args.schedule == "poly" else WarmupCosine
        return cls(optimizer, total_steps=total_steps, warmup_steps=warmup_steps, base_lr=base_lr, min_lr=min_lr,
                   warmup_lr=warmup_lr)

    def _batch(self, batch):
        x, y = batch
        x = x.to(self.device, non_blocking=True)
        if self.cfg.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x, y.to(self.device, non_blocking=True)

    def _slide(self, x, forward):
        return infer.slide(forward, x, self.data.img_size, self.model.num_classes, self.args.stride)

    def summary(self) -> dict:
        b = self.data
        return {"model": infer.dense_name(self.spec), "dataset": b.name, "params_m": self.num_params / 1e6,
                "img_size": b.img_size, "train_images": len(b.train), "val_images": len(b.val)}

    def test(self, run_dir: Path, batch_size: int, checkpoint: str = "last") -> dict:
        """The test split (shapes: 100 scenes; depth: the Middlebury motorcycle) with ``checkpoint``'s weights."""
        from vitlab.train.evaluate import load_model

        run_dir = Path(run_dir)
        if self.data.test is None or not (run_dir / checkpoint).exists():
            return {f"test_{k}": None for k in self.test_keys}
        model, _, _ = load_model(run_dir / checkpoint, device=self.device)
        sums = None
        with torch.no_grad():
            for batch in self.data.loader("test", batch_size=min(batch_size, 32)):
                sums = add_sums(sums, self.validation_step(batch, model))
        r = self.validation_metrics(sums)
        return {f"test_{k}": r[k] for k in self.test_keys}

    # ---- the run record ----------------------------------------------------------------------------------
    def record(self) -> RunRecord:
        b, a = self.data, self.args
        return RunRecord(task=self.name, model=self.cfg.model, model_kwargs=model_kwargs(self.cfg),
                         task_args=to_plain(a), data=b.config.to_dict(), num_classes=b.num_classes,
                         class_names=list(b.class_names), img_size=b.img_size, in_chans=3, mean=list(b.mean),
                         std=list(b.std), params=self.num_params,
                         extra={"dense": self.spec, "depth_scale": getattr(a, "depth_scale", 1000.0),
                                "shapes_eval": a.shapes_eval, "shapes_size": a.shapes_size})

    def load(self, record: RunRecord) -> nn.Module:
        return infer.load_dense(record)

    def evaluate(self, model: nn.Module, record: RunRecord, data: str | None, split: str, *, out_dir: Path,
                 batch_size: int = 256, device: str = "cpu", optimize: bool = True) -> dict:
        """:func:`vitlab.dense.infer.evaluate` at the run's sliding-window stride: every image at its own size,
        one at a time and eager (``batch_size`` and ``optimize`` do not apply)."""
        return infer.evaluate(model, record, data, split, out_dir=out_dir, device=device,
                              stride=record.task_args.get("stride"))

    def predict(self, model: nn.Module, record: RunRecord, inputs: list[str], out_dir: Path, *, topk: int = 5,
                device: str = "cpu", optimize: bool = True, prompt: str | None = None) -> list[dict]:
        """:func:`vitlab.dense.infer.predict` at the run's sliding-window stride (``topk`` and ``optimize`` do not
        apply): masks and overlays, or depth maps, under ``out_dir``."""
        return infer.predict(model, record, inputs, out_dir, device=device, stride=record.task_args.get("stride"))


@register_task("segment")
class SegmentTask(_DenseTask):
    """Semantic segmentation: cross-entropy with ignore_index; mIoU picks the best checkpoint."""

    monitor = "miou"
    Args = SegmentArgs
    kind = "segment"
    test_keys = ("miou", "pixel_acc")

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """The embedded demo's recipe (ViTDet-SFP over a width-64 ViT on 64-pixel shapes scenes, 1,500 steps),
        measured by benchmarks/dense_demo.py (docs/benchmarks.md)."""
        return {"model": "vit_pico_patch4_32", "epochs": 30, "batch_size": 16, "lr": 6.4e-2, "warmup_epochs": 0.5,
                "drop_path": 0.0, "eval_every": 5, "data.dataset": "shapes", "data.img_size": 64,
                "data.scale": [0.5, 1.0], "task_args.head": "vitdet_sfp"}

    @classmethod
    def check(cls, cfg) -> None:
        super().check(cfg)
        if not 0 <= cfg.task_args.ignore_index <= 255:
            raise ValueError(f"ignore_index must be in [0, 255] (masks are 8-bit), got {cfg.task_args.ignore_index}")

    def training_step(self, batch, forward) -> tuple[torch.Tensor, dict]:
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

    def validation_metrics(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        s = M.segmentation_scores(sums["confusion"])
        return {"miou": s["miou"], "pixel_acc": s["pixel_acc"],
                "loss": sums["loss"].item() / max(int(sums["confusion"].sum()), 1)}


@register_task("depth")
class DepthTask(_DenseTask):
    """Monocular depth: SILog (or L1) on valid pixels; AbsRel (lower is better) picks the best checkpoint."""

    monitor = "abs_rel"
    monitor_mode = "min"
    Args = DepthArgs
    kind = "depth"
    test_keys = ("abs_rel", "rmse", "log10", "delta1", "delta2", "delta3")

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """The embedded shapes scenes' depth twin (tested on the real Middlebury motorcycle)."""
        return {"data.dataset": "shapes"}

    @classmethod
    def check(cls, cfg) -> None:
        super().check(cfg)
        a = cfg.task_args
        if not 0.0 <= a.silog_lambda <= 1.0:
            raise ValueError(f"silog_lambda must be in [0, 1], got {a.silog_lambda}")
        if a.depth_scale <= 0:
            raise ValueError(f"depth_scale must be > 0, got {a.depth_scale}")

    def training_step(self, batch, forward) -> tuple[torch.Tensor, dict]:
        x, y = self._batch(batch)
        pred = forward(x).float()[:, 0]
        if self.args.loss == "silog":
            return M.silog_loss(pred, y, lam=self.args.silog_lambda), {}
        m = M.valid_depth(y)
        return (pred[m] - y[m]).abs().mean() if m.any() else pred.sum() * 0.0, {}

    def validation_step(self, batch, forward) -> dict[str, torch.Tensor]:
        x, y = self._batch(batch)
        return M.depth_sums(self._slide(x, forward)[:, 0].cpu(), y.cpu())

    def validation_metrics(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        return M.depth_scores(sums)
