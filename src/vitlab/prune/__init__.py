"""Token pruning: EViT (Liang et al., 2022), DynamicViT (Rao et al., 2021), and top-k / adaptive pruning.

    vitlab.prune.apply(model, method="evit", keep_rate=0.7)             # blocks 3, 6, 9 (0-based) by default
    vitlab.prune.apply(model, method="dynamicvit", keep_rate=0.7, locations=[3, 6, 9])
    vitlab.prune.apply(model, method="topk" | "adaptive", keep_rate=0.7)
    vitlab.prune.set_keep_rate(model, 0.5)                             # in place (train_only=True: training only)
    vitlab.prune.keep_rate_at(step, steps_per_epoch, 0.7, shrink_start=10, shrink_epochs=100)  # EViT's warm-up
    vitlab.prune.remove(model)

:mod:`~vitlab.prune.patch` holds the methods; :mod:`~vitlab.prune.losses` the training losses of DynamicViT and
the adaptive threshold; :mod:`~vitlab.prune.warmup` EViT's keep-rate warm-up; :mod:`~vitlab.prune.tasks` hooks
pruning into ``vitlab train --prune evit:0.7 [--prune_shrink_start 10 --prune_shrink_epochs 100]``.
"""

from vitlab.prune.patch import (
    METHODS,
    ImportancePredictor,
    PredictorLG,
    PruneInfo,
    apply,
    is_applied,
    pruned_info,
    remove,
    set_keep_rate,
)
from vitlab.prune.warmup import KeepRateWarmup, keep_rate_at

__all__ = ["METHODS", "ImportancePredictor", "KeepRateWarmup", "PredictorLG", "PruneInfo", "apply", "is_applied",
           "keep_rate_at", "pruned_info", "remove", "set_keep_rate"]
