"""Attention with a learned bias per relative offset (|dy|, |dx|) on a fixed token grid (LeViT, Graham et al.,
2021; reused by EfficientFormer): one table entry per offset and head, gathered into an additive mask.

This module holds the shared base; the two LeViT attentions and EfficientFormer's live with their models
(their projections carry BatchNorms / timm's key layout). Registers nothing: a mechanism tied to one grid size
is no drop-in ``forward(x, hw)`` token mixer.
"""

from __future__ import annotations

import torch
import torch.nn as nn


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
    index, small next to the attention itself) and the attention is the explicit ``softmax(q k^T s + bias) v``.
    For inference, :meth:`fold_biases` (called by the models' ``fuse()``) stores the gathered bias once, as the
    official LeViT does in eval mode: Inductor does not constant-fold the gather, which otherwise runs inside
    every softmax kernel.
    Measured against ``scaled_dot_product_attention`` with the bias as a float ``attn_mask`` (the same function)
    on CPU fp32 inference, the attention ops of LeViT-256 at batch 32 (all five shapes, 2-core AMD EPYC, paired
    runs, medians): 630 ms explicit vs 964 ms SDPA natively (AVX-512), 1030 vs 1257 ms with
    ``ATEN_CPU_CAPABILITY=avx2``. On GPU, ``vitlab.optimize`` / ``torch.compile`` are the place for a fused path."""

    attention_bias_idxs: torch.Tensor

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

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (B, h, Nq, D), k (B, h, Nk, D), v (B, h, Nk, Dv) -> (B, h, Nq, Dv): softmax(q k^T / sqrt(D) + bias) v."""
        attn = (q * self.scale) @ k.transpose(-2, -1) + self.get_attention_biases()  # (B, h, Nq, Nk)
        return attn.softmax(dim=-1) @ v


def fold_offset_biases(module: nn.Module) -> nn.Module:
    """:meth:`OffsetBiasAttentionBase.fold_biases` on every such attention in ``module`` (in place)."""
    for m in module.modules():
        if isinstance(m, OffsetBiasAttentionBase):
            m.fold_biases()
    return module
