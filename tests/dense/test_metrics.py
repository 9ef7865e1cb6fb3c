"""Dense metrics against torchmetrics (segmentation: JaccardIndex / Accuracy with ignored pixels; depth: MSE) and
against the formulas written out in numpy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchmetrics.classification import MulticlassAccuracy, MulticlassJaccardIndex
from torchmetrics.regression import MeanSquaredError

from vitlab.dense import metrics as M


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mean_iou_equals_torchmetrics_with_ignored_pixels(seed):
    g = torch.Generator().manual_seed(seed)
    C = 7
    pred = torch.randint(0, C, (3, 24, 40), generator=g)
    target = torch.randint(0, C, (3, 24, 40), generator=g)
    target[torch.rand(target.shape, generator=g) < 0.2] = 255
    target[target == 6] = 255  # class 6 absent from the target ...
    pred[pred == 6] = 2        # ... and from the prediction: undefined IoU, skipped by both
    ours = M.mean_iou(pred, target, C, ignore_index=255)
    ref = MulticlassJaccardIndex(C, ignore_index=255, average="macro")(pred, target).item()
    assert ours == pytest.approx(ref, abs=1e-6)
    per = M.per_class_iou(pred, target, C)
    ref_per = MulticlassJaccardIndex(C, ignore_index=255, average="none")(pred, target)
    torch.testing.assert_close(per[:6].float(), ref_per[:6], rtol=0, atol=1e-6)
    assert torch.isnan(per[6])
    acc = MulticlassAccuracy(C, ignore_index=255, average="micro")(pred, target).item()
    assert M.pixel_accuracy(pred, target, C) == pytest.approx(acc, abs=1e-6)


def test_confusion_accumulates_and_rejects_bad_labels():
    g = torch.Generator().manual_seed(3)
    pred, target = torch.randint(0, 4, (2, 8, 8), generator=g), torch.randint(0, 4, (2, 8, 8), generator=g)
    whole = M.confusion_matrix(pred, target, 4)
    parts = M.confusion_matrix(pred[:1], target[:1], 4) + M.confusion_matrix(pred[1:], target[1:], 4)
    assert torch.equal(whole, parts) and whole.sum() == 128
    target[0, 0, 0] = 9
    with pytest.raises(ValueError, match="target label 9"):
        M.confusion_matrix(pred, target, 4)
    with pytest.raises(ValueError, match="shape"):
        M.confusion_matrix(pred[0], target, 4)


def test_depth_metrics_match_formulas_and_torchmetrics():
    g = torch.Generator().manual_seed(0)
    t = torch.rand(2, 16, 16, generator=g) * 9 + 0.5
    p = t * torch.exp(torch.randn(2, 16, 16, generator=g) * 0.2)
    t[0, :2] = 0  # invalid: left out
    t[1, 0, 0] = float("nan")
    r = M.depth_metrics(p, t)
    m = torch.isfinite(t) & (t > 0)
    pn, tn = p[m].double().numpy(), t[m].double().numpy()
    assert r["abs_rel"] == pytest.approx(np.mean(np.abs(pn - tn) / tn), rel=1e-9)
    assert r["rmse"] == pytest.approx(MeanSquaredError(squared=False)(p[m], t[m]).item(), rel=1e-5)
    assert r["log10"] == pytest.approx(np.mean(np.abs(np.log10(pn) - np.log10(tn))), rel=1e-9)
    ratio = np.maximum(pn / tn, tn / pn)
    for k in (1, 2, 3):
        assert r[f"delta{k}"] == pytest.approx(np.mean(ratio < 1.25 ** k), rel=1e-9)
    assert M.depth_metrics(t.nan_to_num(1.0).clamp_min(1.0), t.nan_to_num(1.0).clamp_min(1.0))["delta1"] == 1.0


def test_silog_is_scale_invariant_at_lambda_one_and_matches_eq4():
    g = torch.Generator().manual_seed(1)
    t = torch.rand(2, 8, 8, generator=g) + 0.5
    p = torch.rand(2, 8, 8, generator=g) + 0.5
    d = (p.log() - t.log()).flatten().double()
    expect = 10 * torch.sqrt((d ** 2).mean() - 0.85 * d.mean() ** 2)
    assert M.silog_loss(p, t).item() == pytest.approx(expect.item(), rel=1e-5)
    # lambda = 1: a global scale of the prediction changes nothing (Eigen et al.'s scale invariance)
    assert M.silog_loss(3 * p, t, lam=1.0).item() == pytest.approx(M.silog_loss(p, t, lam=1.0).item(), rel=1e-4)
    p.requires_grad_(True)
    M.silog_loss(p, torch.zeros_like(t)).backward()  # no valid pixel: zero loss, a gradient of zeros
    assert torch.equal(p.grad, torch.zeros_like(p))
