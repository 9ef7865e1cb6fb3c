"""Token pruning (seed 001 section 21.5): EViT, DynamicViT and seed 001's DynamicTokenPruning / AdaptiveTokenPruning.

    vitlab.prune.apply(model, method="evit", keep_rate=0.7)             # blocks 3, 6, 9 (0-based) by default
    vitlab.prune.apply(model, method="dynamicvit", keep_rate=0.7, locations=[3, 6, 9])
    vitlab.prune.apply(model, method="topk" | "adaptive", keep_rate=0.7)
    vitlab.prune.remove(model)

:mod:`~vitlab.prune.patch` holds the methods; :mod:`~vitlab.prune.losses` the training losses of DynamicViT and
the adaptive threshold; :mod:`~vitlab.prune.tasks` hooks pruning into ``vitlab train --prune evit:0.7``.
"""

from vitlab.prune.patch import METHODS, ImportancePredictor, PredictorLG, PruneInfo, apply, remove

__all__ = ["METHODS", "ImportancePredictor", "PredictorLG", "PruneInfo", "apply", "remove"]
