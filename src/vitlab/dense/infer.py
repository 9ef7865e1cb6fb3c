"""Inference for dense models from a run's :class:`~vitlab.train.task.RunRecord`: sliding windows over images
larger than the training crop, :func:`load_dense` (the model a record describes), :func:`evaluate` (mIoU,
per-class IoU, pixel accuracy / depth errors on a split) and :func:`predict` (colour overlays and index masks, or
depth maps, written as PNG). The ``segment`` / ``depth`` tasks answer ``vitlab.train.evaluate(checkpoint)`` and
``vitlab.train.predict(checkpoint, images)`` (``vitlab eval`` / ``vitlab predict``) with these.

Sliding window (SETR Sec. 4.1 / Segmenter Sec. 4.1, mmseg's ``slide_inference``): windows of the training crop
at ``stride`` (default 2/3 of the crop), the last window of a row / column aligned with the border, an image
smaller than the crop zero-padded (the normalised mean colour); outputs of overlapping windows are averaged.
"""

from __future__ import annotations

import io
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torchvision import tv_tensors

from vitlab._io import atomic_write, write_json
from vitlab.data import DataConfig
from vitlab.dense import metrics as M
from vitlab.dense.data import build_dense, joint_transform
from vitlab.dense.model import DenseModel, create
from vitlab.train.common import add_sums
from vitlab.train.task import RunRecord, TaskError


@torch.no_grad()
def slide(forward, x: torch.Tensor, window: int, out_channels: int, stride: int | None = None) -> torch.Tensor:
    """``forward`` over (B, C, H, W) ``x`` in ``window`` x ``window`` tiles -> (B, out_channels, H, W) averaged."""
    B, _, H, W = x.shape
    stride = stride or max(1, window * 2 // 3)
    Hp, Wp = max(H, window), max(W, window)
    if (Hp, Wp) != (H, W):
        x = F.pad(x, (0, Wp - W, 0, Hp - H))
    out = x.new_zeros(B, out_channels, Hp, Wp)
    count = x.new_zeros(1, 1, Hp, Wp)
    ny = max(Hp - window + stride - 1, 0) // stride + 1
    nx = max(Wp - window + stride - 1, 0) // stride + 1
    for i in range(ny):
        for j in range(nx):
            y1, x1 = min(i * stride, Hp - window), min(j * stride, Wp - window)
            out[:, :, y1:y1 + window, x1:x1 + window] += forward(x[:, :, y1:y1 + window, x1:x1 + window]).float()
            count[:, :, y1:y1 + window, x1:x1 + window] += 1
    return (out / count)[:, :, :H, :W]


def dense_name(spec: dict) -> str:
    """How a dense model reads: ``vitdet_sfp on vit_pico_patch4_32``, or a registered configuration's name."""
    return spec["head"] + (f" on {spec['backbone']}" if spec.get("backbone") else "")


def load_dense(record: RunRecord) -> DenseModel:
    """The model of a ``segment`` / ``depth`` run record, with fresh weights (the caller loads the checkpoint's)."""
    if "dense" not in record.extra:
        raise TaskError(f"the {record.task} run record carries no dense model spec (not written by vitlab train "
                        f"--task segment|depth)")
    return create(**record.extra["dense"])


def evaluate(model: nn.Module, record: RunRecord, data: str | None = None, split: str = "test", *, out_dir: Path,
             device: str = "cpu", stride: int | None = None) -> dict:
    """mIoU / per-class IoU / pixel accuracy (segment) or AbsRel, RMSE, log10, delta (depth) of ``model`` (built
    from ``record``) on ``split`` of ``data`` (default: the data it was trained on; ``test`` falls back to ``val``
    when the data has none), each image at its own size through sliding windows, the run's ``ignore_index`` left
    out. Writes ``eval-<task>-<split>.json`` to ``out_dir``; returns the metrics with ``summary`` (one line) and
    ``files``."""
    spec, ex = record.extra["dense"], record.extra
    kind = spec["task"]
    trained = DataConfig(**record.data)
    dcfg = replace(trained if data in (None, trained.dataset) else DataConfig(dataset=data), img_size=record.img_size)
    bundle = build_dense(dcfg, kind, record.mean, record.std,
                         num_classes=record.num_classes if kind == "segment" else None,
                         depth_scale=ex.get("depth_scale", 1000.0), native_eval=True, shapes_train=1,
                         shapes_eval=ex.get("shapes_eval"), shapes_size=ex.get("shapes_size"))
    if split == "test" and bundle.test is None:
        split = "val"
    ds = getattr(bundle, split, None)
    if ds is None:
        raise ValueError(f"dataset {bundle.name} has no {split} split")
    ignore = record.task_args.get("ignore_index", M.IGNORE_INDEX)  # as the run's validation
    sums = None
    for i in range(len(ds)):
        x, y = ds[i]
        out = slide(model, x[None].to(device), record.img_size, model.num_classes, stride)[0].cpu()
        sums = add_sums(sums, {"confusion": M.confusion_matrix(out.argmax(0), y, model.num_classes, ignore)}
                        if kind == "segment" else M.depth_sums(out[0], y))
    result = {"task": record.task, "model": spec["head"], "backbone": spec.get("backbone"), "dataset": bundle.name,
              "split": split, "num_images": len(ds)}
    head = f"{dense_name(spec)} on {bundle.name} ({split}, {len(ds)} images): "
    if kind == "segment":
        s = M.segmentation_scores(sums["confusion"])
        per_class = dict(zip(bundle.class_names, s["per_class_iou"], strict=True))
        result.update(miou=s["miou"], pixel_acc=s["pixel_acc"], per_class_iou=per_class)
        worst = sorted(((k, v) for k, v in per_class.items() if v is not None), key=lambda kv: kv[1])[:3]
        summary = (head + f"mIoU {s['miou']:.4f}  pixel acc {s['pixel_acc']:.4f}  (weakest IoU: "
                   + ", ".join(f"{name} {iou:.4f}" for name, iou in worst) + ")")
    else:
        result.update(M.depth_scores(sums))
        summary = head + "  ".join(f"{k} {result[k]:.4f}" for k in ("abs_rel", "rmse", "log10", "delta1", "delta2",
                                                                    "delta3"))
    path = Path(out_dir) / f"eval-{kind}-{split}.json"
    write_json(path, result)
    return {**result, "summary": summary, "files": [str(path)]}


def palette(n: int) -> np.ndarray:
    """(n, 3) uint8 colours: Pascal VOC's bit-interleaved palette (class 0 black)."""
    pal = np.zeros((n, 3), np.uint8)
    for i in range(n):
        c, r, g, b = i, 0, 0, 0
        for k in range(8):
            r |= ((c >> 0) & 1) << (7 - k)
            g |= ((c >> 1) & 1) << (7 - k)
            b |= ((c >> 2) & 1) << (7 - k)
            c >>= 3
        pal[i] = (r, g, b)
    return pal


def _png(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def predict(model: nn.Module, record: RunRecord, images: list[str], out_dir: Path, *, device: str = "cpu",
            stride: int | None = None, alpha: float = 0.5) -> list[dict]:
    """For each image, ``model`` (built from ``record``) through sliding windows at the image's size: segment ->
    ``<stem>_overlay.png`` (palette colours blended over the image, ``alpha``) and ``<stem>_mask.png`` (class
    indices); depth -> ``<stem>_depth.png`` (colour-mapped, near = bright) and ``<stem>_depth16.png`` (16-bit,
    millimetres), under ``out_dir``. One row per image: the written paths, the class fractions or the depth
    range, and ``line`` (the image and its files)."""
    from matplotlib import colormaps

    from vitlab.data import load_image

    kind = record.extra["dense"]["task"]
    tf = joint_transform(record.img_size, False, record.mean, record.std)
    out_dir = Path(out_dir)
    rows = []
    for p in images:
        raw = load_image(p, 3)
        x = tf(tv_tensors.Image(raw)).as_subclass(torch.Tensor)
        out = slide(model, x[None].to(device), record.img_size, model.num_classes, stride)[0].cpu()
        stem = Path(p).stem
        row: dict = {"image": str(p)}
        if kind == "segment":
            cls = out.argmax(0).numpy().astype(np.uint8)
            col = palette(max(256, model.num_classes))[cls]
            overlay = (raw.permute(1, 2, 0).numpy() * (1 - alpha) + col * alpha).astype(np.uint8)
            files = {"overlay": out_dir / f"{stem}_overlay.png", "mask": out_dir / f"{stem}_mask.png"}
            atomic_write(files["overlay"], _png(overlay))
            atomic_write(files["mask"], _png(cls))
            names = record.class_names or [str(i) for i in range(model.num_classes)]
            counts = np.bincount(cls.ravel(), minlength=model.num_classes) / cls.size
            row["classes"] = {names[i]: float(f) for i, f in enumerate(counts) if f > 0}
        else:
            d = out[0].numpy()
            lo, hi = float(d.min()), float(d.max())
            inv = 1.0 - (d - lo) / max(hi - lo, 1e-6)  # near = bright
            files = {"depth": out_dir / f"{stem}_depth.png", "depth16": out_dir / f"{stem}_depth16.png"}
            atomic_write(files["depth"], _png((colormaps["magma"](inv)[..., :3] * 255).astype(np.uint8)))
            atomic_write(files["depth16"], _png(np.clip(d * 1000.0, 0, 65535).astype(np.uint16)))
            row.update(min_m=lo, max_m=hi)
        row.update({k: str(v) for k, v in files.items()})
        row["line"] = f"{p}: " + "  ".join(str(v) for v in files.values())
        rows.append(row)
    return rows
