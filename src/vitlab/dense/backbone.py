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
  still load). ``rel_pos=True`` adds ViTDet's decomposed relative position bias (MViTv2's, Li et al., 2022,
  "MViTv2", Sec. 3.1) to every block (:class:`RelPosAttention`, zero-initialised); without it the backbone is
  ViTDet's "abs only" ablation row (Table 4).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from vitlab.attention import QKVAttention, pad_to_multiple


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


def rel_pos_table(q_size: int, k_size: int, rel_pos: torch.Tensor) -> torch.Tensor:
    """MViTv2's relative position lookup (Li et al., 2022, "MViTv2", Sec. 3.1; as ViTDet's ``get_rel_pos``): the
    (2 max(q, k) - 1, C) table, linearly resized when it was made for another size, read at the offset of every
    (query, key) pair along one axis, coordinates rescaled when q and k differ in length -> (q_size, k_size, C)."""
    n = 2 * max(q_size, k_size) - 1
    if rel_pos.shape[0] != n:
        rel_pos = F.interpolate(rel_pos.t()[None], size=n, mode="linear")[0].t()
    q = torch.arange(q_size, device=rel_pos.device, dtype=torch.float32)[:, None] * max(k_size / q_size, 1.0)
    k = torch.arange(k_size, device=rel_pos.device, dtype=torch.float32)[None, :] * max(q_size / k_size, 1.0)
    return rel_pos[((q - k) + (k_size - 1) * max(q_size / k_size, 1.0)).long()]


def decomposed_rel_pos_bias(q: torch.Tensor, rel_pos_h: torch.Tensor, rel_pos_w: torch.Tensor,
                            q_size: tuple[int, int], k_size: tuple[int, int]) -> torch.Tensor:
    """The decomposed relative position bias of MViTv2 (Eq. 2 -- 3) that ViTDet adds to its attention logits:
    ``q_(i,j) . R^h_(i - i') + q_(i,j) . R^w_(j - j')`` for query (i, j) and key (i', j'), the query unscaled.
    ``q``: (..., q_h * q_w, C) -> additive bias (..., q_h * q_w, k_h * k_w)."""
    (qh, qw), (kh, kw) = q_size, k_size
    r = q.reshape(*q.shape[:-2], qh, qw, q.shape[-1])
    rel_h = torch.einsum("...hwc,hkc->...hwk", r, rel_pos_table(qh, kh, rel_pos_h).to(q.dtype))
    rel_w = torch.einsum("...hwc,wkc->...hwk", r, rel_pos_table(qw, kw, rel_pos_w).to(q.dtype))
    return (rel_h[..., :, None] + rel_w[..., None, :]).reshape(*q.shape[:-2], qh * qw, kh * kw)


class RelPosAttention(nn.Module):
    """An existing softmax attention ``attn`` (a :class:`vitlab.attention.QKVAttention`: ``msa``, HaLViT's; its
    projections ``project_qkv`` / ``project_out`` and weights kept) with ViTDet's decomposed relative position
    bias added to its logits (Li et al., 2022, ViTDet, Sec. 4.2 "relative positional biases", from MViTv2). The
    tables ``rel_pos_h`` / ``rel_pos_w`` are made for ``size`` (the window, or the global grid) and start at zero
    (ViTDet's ``rel_pos_zero_init``), so a pretrained ViT's output is unchanged until they train; another grid size
    resizes them (:func:`rel_pos_table`)."""

    def __init__(self, attn: nn.Module, size: tuple[int, int]):
        super().__init__()
        self.attn = attn
        self.rel_pos_h = nn.Parameter(torch.zeros(2 * int(size[0]) - 1, attn.head_dim))
        self.rel_pos_w = nn.Parameter(torch.zeros(2 * int(size[1]) - 1, attn.head_dim))

    def forward(self, x: torch.Tensor, hw: tuple[int, int] | None = None, rope=None) -> torch.Tensor:
        a = self.attn
        N = x.shape[1]
        if hw is None or N != hw[0] * hw[1]:
            raise ValueError("relative position bias needs a grid without prefix tokens (class_token=False, "
                             "global_pool='avg')")
        q, k, v = a.project_qkv(x)  # (B, heads, N, d) each
        bias = decomposed_rel_pos_bias(q, self.rel_pos_h, self.rel_pos_w, tuple(hw), tuple(hw))
        drop = a.attn_drop if self.training else 0.0
        return a.project_out(F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=drop))


def vitdet_backbone(model: nn.Module, window_size: int = 14, global_blocks: list[int] | None = None,
                    rel_pos: bool = False) -> nn.Module:
    """Turn a plain ViT without prefix tokens into ViTDet's backbone in place (and return it): every block but
    ``global_blocks`` (default: :func:`default_global_blocks`) attends within ``window_size`` windows;
    ``rel_pos`` adds the decomposed relative position bias (:class:`RelPosAttention`) to every block, its
    tables sized to the window or, in the global blocks, to the model's patch grid."""
    if not is_plain(model) or getattr(model, "num_prefix_tokens", 0):
        raise ValueError("the ViTDet backbone needs a plain ViT without prefix tokens (class_token=False, "
                         "global_pool='avg')")
    depth = len(model.blocks)
    glob = default_global_blocks(depth) if global_blocks is None else [i % depth for i in global_blocks]
    grid = getattr(model.patch_embed, "grid_size", None)
    if rel_pos and grid is None:
        raise ValueError("relative position bias needs a model built for a fixed img_size (its patch grid)")
    for i, blk in enumerate(model.blocks):
        if isinstance(blk.attn, (WindowedAttention, RelPosAttention)):
            continue
        if rel_pos:
            if not isinstance(blk.attn, QKVAttention):
                raise ValueError(f"relative position bias goes into softmax attention (msa); block {i} uses "
                                 f"{type(blk.attn).__name__}")
            blk.attn = RelPosAttention(blk.attn, tuple(grid) if i in glob else (window_size, window_size))
        if i not in glob:
            blk.attn = WindowedAttention(blk.attn, window_size)
    return model
