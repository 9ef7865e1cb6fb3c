"""Attention with a learned bias per relative offset (|dy|, |dx|) on a fixed token grid (LeViT, Graham et al.,
2021; reused by EfficientFormer): one table entry per offset and head, gathered into an additive mask."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def downsample_size(size: int) -> int:
    """Output length of a 3x3 stride-2 pad-1 convolution (ceil(size / 2))."""
    return (size - 1) // 2 + 1


def _offset_index(q_pos: torch.Tensor, k_pos: torch.Tensor, width: int) -> torch.Tensor:
    """(2, Nq), (2, Nk) grid positions -> (Nq, Nk) index ``|dy| * width + |dx|`` into a bias table."""
    rel = (q_pos[:, :, None] - k_pos[:, None, :]).abs()  # (2, Nq, Nk)
    return rel[0] * width + rel[1]


def _grid_positions(h: int, w: int, stride: int = 1, device=None) -> torch.Tensor:
    ys = torch.arange(0, h, stride, device=device)
    xs = torch.arange(0, w, stride, device=device)
    return torch.stack(torch.meshgrid(ys, xs, indexing="ij")).flatten(1)  # (2, N), row-major


class OffsetBiasAttentionBase(nn.Module):
    """Shared by both LeViT attentions: the learned per-head bias table ``attention_biases`` (heads, H*W), one
    entry per offset (|dy|, |dx|), gathered into a (heads, Nq, Nk) additive mask.

    The gather is cached for inference (eval mode, no gradient wanted): it depends only on the parameters, so it
    is recomputed only when they change (train(), .to(), load_state_dict, an in-place update)."""

    attention_bias_idxs: torch.Tensor
    fused_attn: bool | None = None  # use F.scaled_dot_product_attention; None: on CUDA only (measured faster)

    def _init_bias(self, num_heads: int, resolution: tuple[int, int], q_stride: int) -> None:
        H, W = resolution
        self.attention_biases = nn.Parameter(torch.zeros(num_heads, H * W))
        idx = _offset_index(_grid_positions(H, W, q_stride), _grid_positions(H, W), W)  # (Nq, Nk)
        self.register_buffer("attention_bias_idxs", idx, persistent=False)  # derived, not a weight
        self._bias_cache: torch.Tensor | None = None
        self._bias_cache_version = -1

    def train(self, mode: bool = True):
        self._bias_cache = None
        return super().train(mode)

    def _apply(self, fn, *args, **kwargs):
        self._bias_cache = None
        return super()._apply(fn, *args, **kwargs)

    def _load_from_state_dict(self, *args, **kwargs):
        self._bias_cache = None
        return super()._load_from_state_dict(*args, **kwargs)

    def get_attention_biases(self) -> torch.Tensor:  # (heads, Nq, Nk)
        if torch.compiler.is_compiling() or self.training or (
                torch.is_grad_enabled() and self.attention_biases.requires_grad):
            return self.attention_biases[:, self.attention_bias_idxs]
        version = self.attention_biases._version
        if self._bias_cache is None or self._bias_cache_version != version:
            self._bias_cache = self.attention_biases[:, self.attention_bias_idxs]
            self._bias_cache_version = version
        return self._bias_cache

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (B, h, Nq, D), k (B, h, Nk, D), v (B, h, Nk, Dv) -> (B, h, Nq, Dv): softmax(q k^T / sqrt(D) + bias) v."""
        bias = self.get_attention_biases()
        fused = self.fused_attn if self.fused_attn is not None else q.device.type == "cuda"
        if fused:  # SDPA's kernels win on GPU; on CPU with a float mask they are slower than matmul-softmax-matmul
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype), scale=self.scale)
        attn = (q * self.scale) @ k.transpose(-2, -1) + bias  # (B, h, Nq, Nk)
        return attn.softmax(dim=-1) @ v
