"""Attention biases of LeViT / EfficientFormer as maps over offsets (LeViT supplementary, Appendix B and Figure 1).

LeViT's attention (Graham et al., ICCV 2021, Eq. 1) adds a learned bias per head and per relative offset,
``A[h, (x, y), (x', y')] = Q K^T / sqrt(D) + B[h, |x - x'|, |y - y'|]``; the table ``attention_biases`` holds
one entry per offset (|dy|, |dx|) of the key grid, in raster order. Reshaped to the grid it is exactly the
bias that the top-left query pixel gives every key (the supplementary's "the center for which the attention is computed
is the upper left pixel of the map"), and by symmetry of |.| the bias of any query at any offset.
"""

from __future__ import annotations

import torch.nn as nn


def find_bias_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    from vitlab.attention import OffsetBiasAttentionBase

    return [(n, m) for n, m in model.named_modules() if isinstance(m, OffsetBiasAttentionBase)]


def bias_maps(model: nn.Module) -> dict:
    """Every offset-bias layer's table as maps (heads, H, W) over offsets, with per-head and per-layer range
    and std. Returns {'layers': [{'name', 'resolution', 'query_stride', 'maps' (heads, H, W), 'min', 'max',
    'std' (per head, lists), 'range' ([min, max] of the layer)}], 'range': [min, max] of the model}."""
    layers = find_bias_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no attention bias over offsets; models with one: levit_*, "
                         f"efficientformer_*")
    rows = []
    for name, m in layers:
        H, W = m.resolution
        maps = m.attention_biases.detach().float().reshape(-1, H, W)  # (heads, |dy|, |dx|)
        flat = maps.flatten(1)
        rows.append(dict(name=name, resolution=[H, W], query_stride=getattr(m, "stride", 1), maps=maps,
                         min=flat.amin(1).tolist(), max=flat.amax(1).tolist(), std=flat.std(1, correction=0).tolist(),
                         range=[float(flat.min()), float(flat.max())]))
    lo, hi = min(r["range"][0] for r in rows), max(r["range"][1] for r in rows)
    return {"layers": rows, "range": [lo, hi]}
