"""Token Merging (ToMe; Bolya et al., "Token Merging: Your ViT But Faster", ICLR 2023).

    vitlab.tome.apply(model, r=8)              # merge 8 tokens per block: ViT, DeiT (distilled), HaLViT, CaiT
    vitlab.tome.apply(model, r=(8, -1))        # the paper's decreasing schedule (mean 8 per block)
    vitlab.tome.apply(model, r=[0, 0, 16, ...], prop_attn=True, trace_source=True)
    vitlab.tome.info(model).source             # after a forward with trace_source: (B, N', N0)
    vitlab.tome.remove(model)                  # exactly the model it was
    png = vitlab.tome.merge_png(model, image)  # the merged regions of an image

:mod:`~vitlab.tome.merge` holds the algorithm (bipartite soft matching, size-weighted merging, sources,
un-merging, schedules); :mod:`~vitlab.tome.patch` patches models from outside through their public token
interface; :mod:`~vitlab.tome.cost` counts the GMACs of a schedule (the paper's closed form);
:mod:`~vitlab.tome.tasks` hooks ToMe into ``vitlab train``.
"""

from vitlab.tome.merge import bipartite_soft_matching, merge_source, merge_wavg, parse_r, unmerge_tokens
from vitlab.tome.patch import ToMeInfo, apply, info, is_applied, remove
from vitlab.tome.vis import merge_png, merge_regions

__all__ = ["ToMeInfo", "apply", "bipartite_soft_matching", "info", "is_applied", "merge_png", "merge_regions",
           "merge_source", "merge_wavg", "parse_r", "remove", "unmerge_tokens"]
