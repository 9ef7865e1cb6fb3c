"""Inference for dense models: sliding windows over images larger than the training crop, ``evaluate`` (mIoU,
per-class IoU, pixel accuracy / depth errors of a checkpoint on a split) and ``predict`` (colour overlays and
index masks, or depth maps, written as PNG).

Sliding window (SETR Sec. 4.1 / Segmenter Sec. 4.1, mmseg's ``slide_inference``): windows of the training crop
at ``stride`` (default 2/3 of the crop), the last window of a row / column aligned with the border, an image
smaller than the crop zero-padded (the normalised mean colour); outputs of overlapping windows are averaged.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torchvision import tv_tensors

from vitlab._io import atomic_write
from vitlab.dense import metrics as M
from vitlab.dense.data import build_dense, joint_transform
from vitlab.dense.model import DenseModel, create


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


def load_dense(checkpoint, weights: str = "auto", device: str | torch.device = "cpu") -> tuple[DenseModel, dict]:
    """(model in eval mode, meta) of a checkpoint written by ``vitlab train --task segment|depth``."""
    from vitlab.train import checkpoint as ck

    sd, meta = ck.load_weights(checkpoint, weights=weights)
    if meta.get("task") not in ("segment", "depth"):
        raise ValueError(f"{checkpoint} is not a dense checkpoint (task {meta.get('task', 'classify')!r}); "
                         f"use vitlab eval / predict without --task")
    model = create(**meta["dense"])
    model.load_state_dict(sd)
    return model.to(device).eval(), meta


def evaluate(checkpoint, data: str | None = None, split: str = "test", output_dir=None, weights: str = "auto",
             device: str = "cpu", stride: int | None = None) -> dict:
    """mIoU / per-class IoU / pixel accuracy (segment) or AbsRel, RMSE, log10, delta (depth) of a checkpoint on
    ``split`` of ``data`` (default: its training data), each image at its own size through sliding windows.
    Writes ``eval-<task>-<split>.json`` to ``output_dir`` (default: the run directory)."""
    from dataclasses import replace

    from vitlab.data import DataConfig
    from vitlab.train.evaluate import _default_out

    model, meta = load_dense(checkpoint, weights, device)
    task = meta["task"]
    dcfg = DataConfig(**meta["data"])
    if data is not None and data != dcfg.dataset:
        dcfg = DataConfig(dataset=data, img_size=meta["img_size"])
    dcfg = replace(dcfg, img_size=meta["img_size"])
    bundle = build_dense(dcfg, task, meta["mean"], meta["std"], num_classes=meta["num_classes"] if task == "segment"
                         else None, depth_scale=meta.get("depth_scale", 1000.0), native_eval=True,
                         shapes_train=1, shapes_eval=meta.get("shapes_eval"),
                         shapes_size=meta.get("shapes_size"))
    ds = getattr(bundle, split, None) if split != "test" else (bundle.test or bundle.val)
    if ds is None:
        raise ValueError(f"dataset {bundle.name} has no {split} split")
    split = split if split != "test" or bundle.test is not None else "val"
    dev = torch.device(device)
    conf, dsums = None, None
    for i in range(len(ds)):
        x, y = ds[i]
        out = slide(model, x[None].to(dev), meta["img_size"], model.num_classes, stride)[0].cpu()
        if task == "segment":
            c = M.confusion_matrix(out.argmax(0), y, model.num_classes)
            conf = c if conf is None else conf + c
        else:
            s = M.depth_sums(out[0], y)
            dsums = s if dsums is None else {k: dsums[k] + s[k] for k in s}
    result = {"checkpoint": str(checkpoint), "task": task, "model": meta["dense"].get("head"),
              "backbone": meta["dense"].get("backbone"), "dataset": bundle.name, "split": split,
              "num_images": len(ds)}
    if task == "segment":
        s = M.segmentation_scores(conf)
        result.update(miou=s["miou"], pixel_acc=s["pixel_acc"],
                      per_class_iou=dict(zip(bundle.class_names, s["per_class_iou"], strict=True)))
    else:
        result.update(M.depth_scores(dsums))
    out_dir = Path(output_dir) if output_dir else _default_out(Path(checkpoint))
    path = out_dir / f"eval-{task}-{split}.json"
    atomic_write(path, json.dumps(result, indent=2).encode())
    result["json_path"] = str(path)
    return result


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


def predict(checkpoint, images: list, output_dir="predictions", weights: str = "auto", device: str = "cpu",
            stride: int | None = None, alpha: float = 0.5) -> list[dict]:
    """For each image: segment -> ``<stem>_mask.png`` (class indices) and ``<stem>_overlay.png`` (palette colours
    blended over the image); depth -> ``<stem>_depth.png`` (colour-mapped, near = bright) and
    ``<stem>_depth16.png`` (16-bit, millimetres). Returns one row per image with the written paths."""
    from matplotlib import colormaps

    from vitlab.data import load_image

    if not images:
        raise ValueError("no images given")
    for p in images:
        if not Path(p).is_file():
            raise FileNotFoundError(f"image not found: {p}")
    model, meta = load_dense(checkpoint, weights, device)
    tf = joint_transform(meta["img_size"], False, meta["mean"], meta["std"])
    out_dir = Path(output_dir)
    rows = []
    for p in images:
        raw = load_image(p, 3)
        x = tf(tv_tensors.Image(raw)).as_subclass(torch.Tensor)
        out = slide(model, x[None].to(device), meta["img_size"], model.num_classes, stride)[0].cpu()
        rgb = raw.permute(1, 2, 0).numpy()
        stem = Path(p).stem
        row = {"image": str(p)}
        if meta["task"] == "segment":
            cls = out.argmax(0).numpy().astype(np.uint8)
            col = palette(max(256, model.num_classes))[cls]
            overlay = (rgb * (1 - alpha) + col * alpha).astype(np.uint8)
            atomic_write(out_dir / f"{stem}_mask.png", _png(cls))
            atomic_write(out_dir / f"{stem}_overlay.png", _png(overlay))
            names = meta.get("class_names") or [str(i) for i in range(model.num_classes)]
            counts = np.bincount(cls.ravel(), minlength=model.num_classes) / cls.size
            row.update(mask=str(out_dir / f"{stem}_mask.png"), overlay=str(out_dir / f"{stem}_overlay.png"),
                       classes={names[i]: float(f) for i, f in enumerate(counts) if f > 0})
        else:
            d = out[0].numpy()
            lo, hi = float(d.min()), float(d.max())
            inv = 1.0 - (d - lo) / max(hi - lo, 1e-6)  # near = bright
            colour = (colormaps["magma"](inv)[..., :3] * 255).astype(np.uint8)
            atomic_write(out_dir / f"{stem}_depth.png", _png(colour))
            atomic_write(out_dir / f"{stem}_depth16.png",
                         _png(np.clip(d * 1000.0, 0, 65535).astype(np.uint16)))
            row.update(depth=str(out_dir / f"{stem}_depth.png"), depth16=str(out_dir / f"{stem}_depth16.png"),
                       min_m=lo, max_m=hi)
        rows.append(row)
    return rows
