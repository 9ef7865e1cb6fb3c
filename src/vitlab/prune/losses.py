"""The training losses token pruning adds to the task's classification loss.

- DynamicViT (Rao et al., NeurIPS 2021, Sec. 3.4, the authors' ``DistillDiffPruningLoss``): the keep-ratio loss
  ``sum_s mean_b (mean_i D_s[b, i] - rho_s)^2 / S`` with ``rho_s = keep_rate ** (s + 1)`` (Eq. 12), the KL
  divergence of the class predictions from the full model's (Eq. 11) and the MSE of the kept tokens' final
  features to the full model's (Eq. 10); weights 2.0 (ratio) and 0.5 (each distillation), the paper's for DeiT.
- Adaptive pruning (``"adaptive"``): the threshold ``t`` is trained by the same kind of keep-ratio loss on a soft
  indicator of the importances above it, ``mean_i sigmoid((s_i - sigmoid(t)) / tau)`` against ``keep_rate``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vitlab.prune.patch import PruneInfo

RATIO_WEIGHT = 2.0
DISTILL_WEIGHT = 0.5
ADAPTIVE_TAU = 0.1  # temperature of the soft "above the threshold" indicator


def dynamicvit_loss(info: PruneInfo, logits: torch.Tensor, tokens: torch.Tensor, teacher_logits: torch.Tensor,
                    teacher_tokens: torch.Tensor) -> torch.Tensor:
    """Ratio + distillation terms of one training forward (``info.aux`` from it); ``tokens`` / ``teacher_tokens``
    are the final normalised patch tokens (B, N, C) of the pruned and the full model."""
    stages = info.aux["stages"]
    rho = info.rate(training=True)  # the warm-up's current rate, when one runs
    ratio = sum(((d.mean(dim=1) - rho ** (s + 1)) ** 2).mean() for s, d in enumerate(stages))
    cls_kl = F.kl_div(F.log_softmax(logits.float(), dim=-1), F.log_softmax(teacher_logits.float(), dim=-1),
                      reduction="batchmean", log_target=True)
    keep = info.aux["mask"].reshape(-1) > 0.5
    C = tokens.shape[-1]
    if keep.any():
        token_mse = (tokens.reshape(-1, C)[keep].float() - teacher_tokens.reshape(-1, C)[keep].float()).pow(2).mean()
    else:
        token_mse = tokens.sum() * 0.0
    return RATIO_WEIGHT * ratio / len(stages) + DISTILL_WEIGHT * cls_kl + DISTILL_WEIGHT * token_mse


def adaptive_loss(info: PruneInfo) -> torch.Tensor:
    """The keep-ratio loss that learns the adaptive thresholds (one per stage)."""
    terms = []
    for imp, threshold in info.aux["stages"]:
        frac = torch.sigmoid((imp - torch.sigmoid(threshold)) / ADAPTIVE_TAU).mean(dim=1)
        terms.append(((frac - info.rate(training=True)) ** 2).mean())
    return RATIO_WEIGHT * sum(terms) / len(terms)
