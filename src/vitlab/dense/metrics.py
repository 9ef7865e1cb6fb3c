"""Dense-prediction metrics and losses.

Segmentation (the ADE20K / Pascal VOC protocol, e.g. SETR Sec. 4, Segmenter Sec. 4.1): every score comes from one
confusion matrix ``C`` (rows: true class, columns: predicted class) accumulated over all valid pixels of the
split -- pixels whose target is ``ignore_index`` (255) are left out. IoU_c = C_cc / (sum_j C_cj + sum_i C_ic -
C_cc); mIoU averages IoU over the classes that occur in the target or the prediction (a class absent from both
has an undefined IoU and is skipped, as mmseg and torchmetrics' ``JaccardIndex(average='macro')`` do); pixel
accuracy = trace(C) / sum(C).

Depth (Eigen et al., 2014, "Depth Map Prediction from a Single Image using a Multi-Scale Deep Network", Sec. 4;
the table columns of DPT, Ranftl et al., 2021, Table 2): over valid pixels (target > 0 and finite),
AbsRel = mean |d - d*| / d*, RMSE = sqrt(mean (d - d*)^2), log10 = mean |log10 d - log10 d*|,
delta_k = fraction with max(d / d*, d* / d) < 1.25^k (k = 1, 2, 3). The sums are additive, so they accumulate
over batches and ranks like the confusion matrix.

SILog (Eigen et al., 2014, Eq. 4; the lambda = 0.85 and x10 scale of BTS / AdaBins / DINOv2's depth heads):
with g = log d - log d*, ``sqrt(mean g^2 - lambda (mean g)^2) * scale``.
"""

from __future__ import annotations

import torch
from torch import Tensor

IGNORE_INDEX = 255


def confusion_matrix(pred: Tensor, target: Tensor, num_classes: int, ignore_index: int | None = IGNORE_INDEX) -> Tensor:
    """(num_classes, num_classes) int64 counts (rows: true class) of the pixels of ``pred`` / ``target`` (class
    indices of any equal shape); pixels whose target is ``ignore_index`` are left out. A target value outside
    [0, num_classes) that is not ``ignore_index`` is a ValueError (a silently wrong mIoU otherwise)."""
    if pred.shape != target.shape:
        raise ValueError(f"prediction shape {tuple(pred.shape)} differs from target shape {tuple(target.shape)}")
    pred, target = pred.reshape(-1).long(), target.reshape(-1).long()
    keep = target != ignore_index if ignore_index is not None else torch.ones_like(target, dtype=torch.bool)
    pred, target = pred[keep], target[keep]
    if target.numel() and (target.min() < 0 or target.max() >= num_classes):
        bad = target[(target < 0) | (target >= num_classes)][0].item()
        raise ValueError(f"target label {bad} is outside [0, {num_classes}) and is not ignore_index {ignore_index}")
    if pred.numel() and (pred.min() < 0 or pred.max() >= num_classes):
        raise ValueError(f"predicted class outside [0, {num_classes})")
    return torch.bincount(target * num_classes + pred, minlength=num_classes ** 2).view(num_classes, num_classes)


def iou_from_confusion(conf: Tensor) -> Tensor:
    """Per-class IoU (float64, NaN for a class absent from target and prediction)."""
    conf = conf.double()
    tp = conf.diag()
    union = conf.sum(0) + conf.sum(1) - tp
    return torch.where(union > 0, tp / union.clamp_min(1), torch.full_like(tp, float("nan")))


def segmentation_scores(conf: Tensor) -> dict:
    """mIoU, per-class IoU (list, None where undefined) and pixel accuracy of a confusion matrix."""
    iou = iou_from_confusion(conf)
    valid = ~torch.isnan(iou)
    total = conf.sum().item()
    return {"miou": iou[valid].mean().item() if valid.any() else float("nan"),
            "per_class_iou": [None if torch.isnan(v) else v.item() for v in iou],
            "pixel_acc": conf.diag().sum().item() / total if total else float("nan")}


def mean_iou(pred: Tensor, target: Tensor, num_classes: int, ignore_index: int | None = IGNORE_INDEX) -> float:
    """Mean IoU of class-index maps ``pred`` and ``target`` over the classes present in either."""
    return segmentation_scores(confusion_matrix(pred, target, num_classes, ignore_index))["miou"]


def per_class_iou(pred: Tensor, target: Tensor, num_classes: int, ignore_index: int | None = IGNORE_INDEX) -> Tensor:
    return iou_from_confusion(confusion_matrix(pred, target, num_classes, ignore_index))


def pixel_accuracy(pred: Tensor, target: Tensor, num_classes: int, ignore_index: int | None = IGNORE_INDEX) -> float:
    return segmentation_scores(confusion_matrix(pred, target, num_classes, ignore_index))["pixel_acc"]


# ---------------------------------------------------------------- depth

DEPTH_SUM_KEYS = ("n", "abs_rel", "sq_err", "log10", "d1", "d2", "d3")


def valid_depth(target: Tensor) -> Tensor:
    return torch.isfinite(target) & (target > 0)


def depth_sums(pred: Tensor, target: Tensor, mask: Tensor | None = None, eps: float = 1e-6) -> dict[str, Tensor]:
    """Additive float64 sums over the valid pixels (target > 0 and finite, and ``mask``) from which
    :func:`depth_scores` computes the metrics; predictions are clamped to ``eps`` so the logs and ratios exist."""
    if pred.shape != target.shape:
        raise ValueError(f"prediction shape {tuple(pred.shape)} differs from target shape {tuple(target.shape)}")
    m = valid_depth(target) if mask is None else valid_depth(target) & mask
    p, t = pred[m].double().clamp_min(eps), target[m].double()
    ratio = torch.maximum(p / t, t / p)
    return {"n": torch.tensor(float(m.sum()), dtype=torch.float64), "abs_rel": ((p - t).abs() / t).sum(),
            "sq_err": ((p - t) ** 2).sum(), "log10": (p.log10() - t.log10()).abs().sum(),
            **{f"d{k}": (ratio < 1.25 ** k).double().sum() for k in (1, 2, 3)}}


def depth_scores(sums: dict[str, Tensor]) -> dict[str, float]:
    n = float(sums["n"])
    if n == 0:
        return {k: float("nan") for k in ("abs_rel", "rmse", "log10", "delta1", "delta2", "delta3")}
    return {"abs_rel": float(sums["abs_rel"]) / n, "rmse": (float(sums["sq_err"]) / n) ** 0.5,
            "log10": float(sums["log10"]) / n, **{f"delta{k}": float(sums[f"d{k}"]) / n for k in (1, 2, 3)}}


def depth_metrics(pred: Tensor, target: Tensor, mask: Tensor | None = None) -> dict[str, float]:
    """AbsRel, RMSE, log10 and delta < 1.25^k (k = 1, 2, 3) of ``pred`` against ``target`` over valid pixels."""
    return depth_scores(depth_sums(pred, target, mask))


def silog_loss(pred: Tensor, target: Tensor, mask: Tensor | None = None, lam: float = 0.85, scale: float = 10.0,
               eps: float = 1e-6) -> Tensor:
    """Scale-invariant log loss (Eigen et al. 2014, Eq. 4, as a root with the x10 scale of BTS/AdaBins):
    ``scale * sqrt(mean g^2 - lam * (mean g)^2)``, g = log(pred) - log(target) over valid pixels."""
    m = valid_depth(target) if mask is None else valid_depth(target) & mask
    if not m.any():
        return pred.sum() * 0.0  # keeps the graph: a batch without valid depth contributes nothing
    g = torch.log(pred[m].clamp_min(eps)) - torch.log(target[m])
    return scale * torch.sqrt((g.pow(2).mean() - lam * g.mean().pow(2)).clamp_min(1e-12))
