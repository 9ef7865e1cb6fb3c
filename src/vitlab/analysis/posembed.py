"""Position-embedding similarity (the similarity of each patch's embedding
with all others, which shows the learned 2-D structure; Dosovitskiy et al., ICLR 2021, Figure 7 centre draws
the same grid with cosine similarity).

For each position embedding table (learned ``nn.Parameter`` or the fixed 2-D sin-cos buffer) of shape
(1, prefix + H*W, C), the prefix entries (class / distillation tokens) are dropped and the cosine similarity of
every patch position with every other is returned as (H, W, H, W): ``sim[i, j]`` is the map of patch (i, j).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from vitlab.analysis._common import pick


def _grid(n: int, prefix: int) -> tuple[int, int] | None:
    s = math.isqrt(max(n - prefix, 0))
    return (s, s) if s > 0 and s * s == n - prefix else None


def find_pos_embeds(model: nn.Module) -> list[tuple[str, torch.Tensor, int, tuple[int, int]]]:
    """(name, table (1, L, C), prefix entries, grid) of every position-embedding table in ``model``."""
    out = []
    for mod_name, m in model.named_modules():
        pos = getattr(m, "pos_embed", None)
        if not isinstance(pos, torch.Tensor) or pos.dim() != 3:
            continue
        L = pos.shape[1]
        prefix = 0 if getattr(m, "no_embed_class", False) else int(getattr(m, "num_prefix_tokens", 0) or 0)
        grid = getattr(getattr(m, "patch_embed", None), "grid_size", None)
        grid = tuple(grid) if grid is not None and grid[0] * grid[1] == L - prefix else None
        for k in dict.fromkeys((prefix, 0, 1, 2)):  # the declared prefix first, then what makes a square grid
            grid = grid or _grid(L, k)
            if grid is not None:
                prefix = L - grid[0] * grid[1]
                break
        if grid is not None:
            out.append((f"{mod_name}.pos_embed" if mod_name else "pos_embed", pos, prefix, grid))
    return out


def cosine_similarity_grid(pos: torch.Tensor, grid: tuple[int, int], prefix: int = 0) -> torch.Tensor:
    """(1, prefix + H*W, C) table -> (H, W, H, W) cosine similarity of every patch position with every other."""
    H, W = grid
    p = F.normalize(pos[0, prefix:].detach().float(), dim=-1)  # (H*W, C)
    return (p @ p.t()).reshape(H, W, H, W)


def posembed_similarity(model: nn.Module, table: int = 0) -> dict:
    """The ``table``-th position embedding's similarity grid and facts: {'name', 'grid', 'prefix', 'kind'
    ('learned' or 'fixed'), 'similarity' (H, W, H, W), 'neighbour_mean' (mean similarity of 4-neighbours),
    'far_mean' (mean over pairs more than half the grid apart)}."""
    tables = find_pos_embeds(model)
    if not tables:
        raise ValueError(f"{type(model).__name__} has no position embedding table; models with one: vit_*, deit_*, "
                         f"cait_*, pvt_* (swin, litv2, levit and efficientformer encode position otherwise)")
    name, pos, prefix, (H, W) = pick(tables, table, "position-embedding", "position-embedding tables")
    sim = cosine_similarity_grid(pos, (H, W), prefix)
    ys, xs = torch.meshgrid(torch.arange(H), torch.arange(W), indexing="ij")
    dist = ((ys.reshape(-1, 1) - ys.reshape(1, -1)).abs() + (xs.reshape(-1, 1) - xs.reshape(1, -1)).abs())
    flat = sim.reshape(H * W, H * W)
    return {"name": name, "grid": [H, W], "prefix": prefix,
            "kind": "learned" if isinstance(pos, nn.Parameter) else "fixed",
            "similarity": sim, "neighbour_mean": float(flat[dist == 1].mean()),
            "far_mean": float(flat[dist > (H + W) // 2].mean())}
