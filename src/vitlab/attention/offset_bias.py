"""Attention with a learned bias per relative offset (|dy|, |dx|) on a fixed token grid (LeViT, Graham et al.,
ICCV 2021, Section 4.2 "Attention bias", Eq. 1; reused by EfficientFormer, Li et al., NeurIPS 2022, Section 4):
``softmax(q k^T / sqrt(D) + B[h, |dy|, |dx|]) v``, one table entry per offset and head, in place of a position
embedding.

* :class:`LevitAttention`: LeViT's block attention. Every projection is a Linear followed by a BatchNorm
  (:class:`LinearNorm`), keys of width D, values of width ``attn_ratio * D``, Hardswish on the attention output
  before the output projection;
* :class:`LevitAttentionDownsample`: LeViT's shrinking attention between stages: queries from the
  2x-subsampled grid, keys and values from the full grid;
* :class:`EfficientFormerAttention`: EfficientFormer's MetaBlock3D attention (plain Linear projections,
  values of width 4D).

Module and parameter names are timm's (``qkv.linear`` / ``qkv.bn``, ``proj.ln``, ``attention_biases``), so timm's
state dicts load unchanged. The bias table is tied to the grid the layer was built for: ``forward(x, hw)``
raises one ValueError for another grid. None is registered: a mechanism tied to one grid size is no drop-in
``create(name, dim, heads)`` token mixer. ``forward(..., return_attn=True)`` also returns the attention weights
(B, heads, Nq, Nk), as :class:`~vitlab.attention.msa.MultiHeadSelfAttention` does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F


def _offset_index(q_pos: torch.Tensor, k_pos: torch.Tensor, width: int) -> torch.Tensor:
    """(2, Nq), (2, Nk) grid positions -> (Nq, Nk) index ``|dy| * width + |dx|`` into a bias table."""
    rel = (q_pos[:, :, None] - k_pos[:, None, :]).abs()  # (2, Nq, Nk)
    return rel[0] * width + rel[1]


def _grid_positions(h: int, w: int, stride: int = 1, device=None) -> torch.Tensor:
    ys = torch.arange(0, h, stride, device=device)
    xs = torch.arange(0, w, stride, device=device)
    return torch.stack(torch.meshgrid(ys, xs, indexing="ij")).flatten(1)  # (2, N), row-major


class OffsetBiasAttentionBase(nn.Module):
    """Shared by the LeViT and EfficientFormer attentions: the learned per-head bias table ``attention_biases``
    (heads, H*W), one entry per offset (|dy|, |dx|), gathered into a (heads, Nq, Nk) additive bias.

    One plain path on every device and under every tracer: the bias is gathered on each call (a (heads, Nq, Nk)
    index, small next to the attention itself) and the attention is the explicit ``softmax(q k^T s + bias) v``
    (measured faster on the CPU than ``scaled_dot_product_attention`` with the bias as a float mask, the same
    function). For inference, :meth:`fold_biases`
    (called by the models' ``fuse()``) stores the gathered bias once, as the official LeViT does in eval mode:
    Inductor does not constant-fold the gather, which otherwise runs inside every softmax kernel."""

    has_attention_weights = True  # return_attn=True: (B, heads, Nq, Nk), queries on the (strided) grid
    attention_kind = "offset_bias"
    attention_bias_idxs: torch.Tensor
    resolution: tuple[int, int]
    stride: int = 1

    def _init_heads(self, num_heads: int, key_dim: int, attn_ratio: float) -> None:
        self.num_heads = num_heads
        self.key_dim = key_dim
        self.val_dim = int(attn_ratio * key_dim)
        self.val_attn_dim = self.val_dim * num_heads
        self.scale = key_dim ** -0.5

    def _forward_packed(self, x: torch.Tensor, hw, return_attn: bool):
        """(B, N, C) -> (B, N, C) through ``qkv``, whose per-head channels are packed [q (D), k (D), v (Dv)]
        (timm / official layout), and ``proj``; with the weights when ``return_attn``."""
        self._check_grid(x, hw)
        B, N, _ = x.shape
        q, k, v = self.qkv(x).view(B, N, self.num_heads, -1).transpose(1, 2).split(
            [self.key_dim, self.key_dim, self.val_dim], dim=3)  # (B, h, N, D), (B, h, N, D), (B, h, N, Dv)
        o, attn = self._attention(q, k, v, return_attn)
        x = self.proj(o.transpose(1, 2).reshape(B, N, self.val_attn_dim))  # (B, N, h*Dv) -> (B, N, C)
        return (x, attn) if return_attn else x

    def _init_bias(self, num_heads: int, resolution: tuple[int, int], q_stride: int) -> None:
        H, W = resolution
        self.attention_biases = nn.Parameter(torch.zeros(num_heads, H * W))
        idx = _offset_index(_grid_positions(H, W, q_stride), _grid_positions(H, W), W)  # (Nq, Nk)
        self.register_buffer("attention_bias_idxs", idx, persistent=False)  # derived, not a weight

    def get_attention_biases(self) -> torch.Tensor:  # (heads, Nq, Nk)
        folded = self._buffers.get("attention_bias_folded")
        return self.attention_biases[:, self.attention_bias_idxs] if folded is None else folded

    @torch.no_grad()
    def fold_biases(self) -> None:
        """Inference only: gather the (heads, Nq, Nk) bias once and use it on every call (a derived buffer, not in
        the state dict); later changes to ``attention_biases`` are not seen, as with folded BatchNorms."""
        self.register_buffer("attention_bias_folded",
                             self.attention_biases[:, self.attention_bias_idxs].contiguous(), persistent=False)

    def attention_weights(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """q (B, h, Nq, D), k (B, h, Nk, D) -> softmax(q k^T / sqrt(D) + bias), (B, h, Nq, Nk)."""
        return ((q * self.scale) @ k.transpose(-2, -1) + self.get_attention_biases()).softmax(dim=-1)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (B, h, Nq, D), k (B, h, Nk, D), v (B, h, Nk, Dv) -> (B, h, Nq, Dv): softmax(q k^T / sqrt(D) + bias) v."""
        return self.attention_weights(q, k) @ v

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, return_attn: bool):
        """(output (B, h, Nq, Dv), weights or None)."""
        if not return_attn:
            return self._attend(q, k, v), None
        attn = self.attention_weights(q, k)
        return attn @ v, attn

    def _check_grid(self, x: torch.Tensor, hw) -> None:
        H, W = self.resolution
        if (hw is not None and tuple(hw) != (H, W)) or x.dim() != 3 or x.shape[1] != H * W:
            got = f"a {hw[0]}x{hw[1]} grid" if hw is not None else f"{tuple(x.shape[1:2])} tokens"
            raise ValueError(f"{type(self).__name__} is built for a {H}x{W} grid ({H * W} tokens, its attention "
                             f"biases are tied to it), got {got}; build it with resolution=(H, W)")


# ---- LeViT's projections: Linear + BatchNorm ------------------------------------------------------------------
def batch_norm_rows(bn: nn.modules.batchnorm._BatchNorm, x: torch.Tensor) -> torch.Tensor:
    """``bn(x)`` for (M, C) rows; a training batch of a single row (e.g. batch 1 at the head), which BatchNorm
    cannot normalise, uses the running statistics (and leaves them alone) instead of raising."""
    if bn.training and x.shape[0] == 1:
        return F.batch_norm(x, bn.running_mean, bn.running_var, bn.weight, bn.bias, False, 0.0, bn.eps)
    return bn(x)


def bn_scale_shift(bn: nn.modules.batchnorm._BatchNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """BatchNorm in eval as ``y = x * scale + shift`` (per channel)."""
    scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)
    return scale, bn.bias - bn.running_mean * scale


class LinearNorm(nn.Module):
    """Linear (no bias) -> BatchNorm1d over the channels of (B, N, C) tokens (LeViT's projection)."""

    def __init__(self, in_features: int, out_features: int, bn_weight_init: float = 1.0):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, bias=False)
        self.bn = nn.BatchNorm1d(out_features)
        nn.init.constant_(self.bn.weight, bn_weight_init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, N, Cin) -> (B, N, Cout)
        x = self.linear(x)
        return batch_norm_rows(self.bn, x.flatten(0, 1)).reshape_as(x)  # statistics over batch and tokens

    @torch.no_grad()
    def fuse(self) -> nn.Linear:
        """The one Linear computing this layer in eval mode (the BatchNorm folded into its weight and bias)."""
        w = self.linear.weight
        scale, shift = bn_scale_shift(self.bn)
        m = nn.Linear(w.shape[1], w.shape[0], device=w.device, dtype=w.dtype)
        m.weight.copy_(w * scale[:, None])
        m.bias.copy_(shift)
        return m


class Subsample(nn.Module):
    """Keep every ``stride``-th token in both directions: (B, H*W, C) -> (B, ceil(H/s)*ceil(W/s), C)."""

    def __init__(self, stride: int, resolution: tuple[int, int]):
        super().__init__()
        self.stride = stride
        self.resolution = tuple(resolution)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, _, C = x.shape
        x = x.view(B, self.resolution[0], self.resolution[1], C)[:, :: self.stride, :: self.stride]
        return x.reshape(B, -1, C)


# ---- the three attentions ------------------------------------------------------------------------------------
class LevitAttention(OffsetBiasAttentionBase):
    """LeViT attention on a fixed H x W grid: (B, N, C) -> (B, N, C)."""

    def __init__(self, dim: int, key_dim: int, num_heads: int = 8, attn_ratio: float = 2.0,
                 resolution: tuple[int, int] = (14, 14), act_layer: Callable[[], nn.Module] = nn.Hardswish):
        super().__init__()
        self._init_heads(num_heads, key_dim, attn_ratio)
        self.resolution = tuple(resolution)
        self.qkv = LinearNorm(dim, num_heads * (2 * key_dim + self.val_dim))
        self.proj = nn.Sequential(OrderedDict([
            ("act", act_layer()),
            # BN weight 0: the residual branch starts as the identity
            ("ln", LinearNorm(self.val_attn_dim, dim, bn_weight_init=0.0)),
        ]))
        self._init_bias(num_heads, self.resolution, 1)

    def forward(self, x: torch.Tensor, hw: tuple[int, int] | None = None, return_attn: bool = False):
        return self._forward_packed(x, hw, return_attn)


class LevitAttentionDownsample(OffsetBiasAttentionBase):
    """Shrinking attention: queries from the 2x-subsampled grid, keys / values from the full grid.
    (B, H*W, Cin) -> (B, ceil(H/2)*ceil(W/2), Cout)."""

    def __init__(self, in_dim: int, out_dim: int, key_dim: int, num_heads: int = 8, attn_ratio: float = 4.0,
                 stride: int = 2, resolution: tuple[int, int] = (14, 14),
                 act_layer: Callable[[], nn.Module] = nn.Hardswish):
        super().__init__()
        self._init_heads(num_heads, key_dim, attn_ratio)
        self.stride = stride
        self.resolution = tuple(resolution)
        self.kv = LinearNorm(in_dim, num_heads * (key_dim + self.val_dim))
        self.q = nn.Sequential(OrderedDict([
            ("down", Subsample(stride, self.resolution)),
            ("ln", LinearNorm(in_dim, num_heads * key_dim)),
        ]))
        self.proj = nn.Sequential(OrderedDict([
            ("act", act_layer()),
            ("ln", LinearNorm(self.val_attn_dim, out_dim)),
        ]))
        self._init_bias(num_heads, self.resolution, stride)

    def forward(self, x: torch.Tensor, hw: tuple[int, int] | None = None, return_attn: bool = False):
        self._check_grid(x, hw)
        B, N, _ = x.shape
        k, v = self.kv(x).view(B, N, self.num_heads, -1).transpose(1, 2).split(
            [self.key_dim, self.val_dim], dim=3)  # (B, h, N, D), (B, h, N, Dv)
        q = self.q(x)  # (B, Nq, h*D)
        q = q.view(B, q.shape[1], self.num_heads, self.key_dim).transpose(1, 2)  # (B, h, Nq, D)
        o, attn = self._attention(q, k, v, return_attn)
        x = self.proj(o.transpose(1, 2).reshape(B, -1, self.val_attn_dim))  # (B, Nq, h*Dv) -> (B, Nq, Cout)
        return (x, attn) if return_attn else x


class EfficientFormerAttention(OffsetBiasAttentionBase):
    """EfficientFormer's MHSA with a learned offset bias on a fixed grid: (B, N, C) -> (B, N, C)."""

    def __init__(self, dim: int = 448, key_dim: int = 32, num_heads: int = 8, attn_ratio: float = 4.0,
                 resolution: tuple[int, int] = (7, 7)):
        super().__init__()
        self._init_heads(num_heads, key_dim, attn_ratio)
        self.resolution = tuple(resolution)
        self.qkv = nn.Linear(dim, num_heads * (2 * key_dim + self.val_dim))
        self.proj = nn.Linear(self.val_attn_dim, dim)
        self._init_bias(num_heads, self.resolution, 1)

    def forward(self, x: torch.Tensor, hw: tuple[int, int] | None = None, return_attn: bool = False):
        return self._forward_packed(x, hw, return_attn)


def fold_offset_biases(module: nn.Module) -> nn.Module:
    """:meth:`OffsetBiasAttentionBase.fold_biases` on every such attention in ``module`` (in place)."""
    for m in module.modules():
        if isinstance(m, OffsetBiasAttentionBase):
            m.fold_biases()
    return module
