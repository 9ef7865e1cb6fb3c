"""Backbones for dense prediction: any vitlab model with ``forward_intermediates`` (plain ViT or hierarchical),
read at chosen blocks / stages as NCHW maps, plus the ViTDet backbone option.

- :func:`feature_specs`: (channels, stride) of the maps after the chosen blocks (plain: stride = patch size,
  width = embed_dim; hierarchical: each stage's ``feature_info``); :class:`vitlab.dense.model.DenseModel` reads
  them, and for a plain ViT the prefix ([CLS]) tokens, which DPT's readout uses.
- :func:`vitdet_backbone` (Li et al., 2022, "Exploring Plain Vision Transformer Backbones for Object Detection",
  Sec. 3 "Backbone adaptation"): non-overlapping window attention in most blocks and global attention in a few
  (four for ViT-B: the last block of each quarter, i.e. 2, 5, 8, 11), the grid zero-padded to a multiple of the
  window as detectron2's ``window_partition`` does. Built from outside the ViT class by swapping each windowed
  block's attention for a :class:`WindowedAttention` that reuses its weights (so a pretrained ViT's weights
  still load). ViTDet's relative position bias is not added (its "abs only" ablation row, Table 4).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from vitlab.attention._window import pad_to_multiple


def feature_specs(model: nn.Module, indices: list[int]) -> list[tuple[int, int]]:
    """(channels, stride) of the maps ``model.forward_intermediates(x, indices)`` returns."""
    info = getattr(model, "feature_info", None)
    if info:
        return [(int(info[i]["num_chs"]), int(info[i]["reduction"])) for i in indices]
    patch = model.patch_embed.patch_size
    return [(int(model.embed_dim), int(patch[0] if isinstance(patch, (tuple, list)) else patch))] * len(indices)


def num_levels(model: nn.Module) -> int:
    info = getattr(model, "feature_info", None)
    return len(info) if info else len(model.blocks)


def is_plain(model: nn.Module) -> bool:
    """A plain (single-scale, token) ViT: blocks over one grid, maybe prefix tokens."""
    return not getattr(model, "feature_info", None) and hasattr(model, "blocks")


class WindowedAttention(nn.Module):
    """ViTDet's window attention around an existing attention module ``attn`` (whose weights it keeps): the
    (B, H*W, C) grid is zero-padded to multiples of ``window_size``, cut into windows that attend within
    themselves (the padded tokens included, as in detectron2), then put back and cropped."""

    def __init__(self, attn: nn.Module, window_size: int):
        super().__init__()
        self.attn, self.window_size = attn, int(window_size)

    def forward(self, x: torch.Tensor, hw: tuple[int, int] | None = None, rope=None) -> torch.Tensor:
        B, N, C = x.shape
        if hw is None or N != hw[0] * hw[1]:
            raise ValueError("window attention needs a grid without prefix tokens (class_token=False, "
                             "global_pool='avg')")
        H, W, ws = int(hw[0]), int(hw[1]), self.window_size
        g = pad_to_multiple(x.reshape(B, H, W, C), ws, ws)
        Hp, Wp = g.shape[1], g.shape[2]
        w = g.reshape(B, Hp // ws, ws, Wp // ws, ws, C).permute(0, 1, 3, 2, 4, 5).reshape(-1, ws * ws, C)
        w = self.attn(w, (ws, ws))
        g = w.reshape(B, Hp // ws, Wp // ws, ws, ws, C).permute(0, 1, 3, 2, 4, 5).reshape(B, Hp, Wp, C)
        return g[:, :H, :W].reshape(B, N, C)


def default_global_blocks(depth: int, n: int = 4) -> list[int]:
    """ViTDet's global blocks: the last of each of ``n`` equal groups (ViT-B, 12 blocks: 2, 5, 8, 11)."""
    return [depth // n * (i + 1) - 1 for i in range(n)]


def vitdet_backbone(model: nn.Module, window_size: int = 14, global_blocks: list[int] | None = None) -> nn.Module:
    """Turn a plain ViT without prefix tokens into ViTDet's backbone in place (and return it): every block but
    ``global_blocks`` (default: :func:`default_global_blocks`) attends within ``window_size`` windows."""
    if not is_plain(model) or getattr(model, "num_prefix_tokens", 0):
        raise ValueError("the ViTDet backbone needs a plain ViT without prefix tokens (class_token=False, "
                         "global_pool='avg')")
    depth = len(model.blocks)
    glob = default_global_blocks(depth) if global_blocks is None else [i % depth for i in global_blocks]
    for i, blk in enumerate(model.blocks):
        if i not in glob and not isinstance(blk.attn, WindowedAttention):
            blk.attn = WindowedAttention(blk.attn, window_size)
    return model
