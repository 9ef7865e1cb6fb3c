"""Position embeddings for 2-D token grids and 1-D token sequences.

- Learned absolute embeddings (ViT) and :func:`resample_abs_pos_embed`, which resizes them bicubically to
  another grid (non-square included), as fine-tuning at a new resolution and ``dynamic_img_size`` need. Under
  ``torch.export`` the bicubic resize is :func:`bicubic_resize_separable`: PyTorch's bicubic kernel (Keys, 1981,
  "Cubic convolution interpolation for digital image processing": the cubic convolution kernel with parameter
  ``a``) written as two interpolation matrices, so a symbolic grid size exports exactly.
- :func:`sincos_2d_pos_embed`: the fixed 2-D sine-cosine embedding (MoCo v3, Chen, Xie, He, 2021; MAE, He et al., 2022).
- :class:`RotaryEmbedding2D`: axial 2-D RoPE. The 1-D RoPE of Llama 2 is built from
  ``theta_i = base ** (-2i / d)`` and rotates consecutive pairs ``(x_{2i}, x_{2i+1})`` by ``m * theta_i``;
  here the first half of each head's channels is rotated by the row index and the second half by the column
  index, so q.k depends only on the 2-D offset between two patches.
- :class:`RotaryEmbedding1D`: the 1-D RoPE itself, for text (the Llama-style CLIP text tower and the Llama
  decoder), in real arithmetic (:func:`rope_rotate`); :func:`precompute_freqs_cis` and :func:`apply_rotary_embs`
  are the same rotation as a complex product (Su et al., 2021, "RoFormer", Sec. 3.4.2; the form of Meta's Llama 2
  code, Touvron et al., 2023), kept for reading against the paper and tested equal to the real form.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from vitlab.layers.helpers import same_size, to_2tuple


def resample_abs_pos_embed(pos_embed: torch.Tensor, new_size, old_size=None, num_prefix_tokens: int = 1,
                           interpolation: str = "bicubic", antialias: bool = True) -> torch.Tensor:
    """Resize a learned (1, prefix + H*W, C) position embedding to the grid ``new_size``.

    ``old_size`` defaults to the square grid implied by the token count. Prefix-token (CLS, distillation,
    register) embeddings are kept as they are.
    """
    new_size = to_2tuple(new_size)
    num_pos = pos_embed.shape[1] - num_prefix_tokens
    if old_size is None:
        side = int(math.isqrt(num_pos))
        if side * side != num_pos:
            raise ValueError(f"cannot infer the grid of a {num_pos}-token position embedding; pass old_size")
        old_size = (side, side)
    old_size = to_2tuple(old_size)
    if old_size[0] * old_size[1] != num_pos:
        raise ValueError(f"old_size {old_size} does not match the {num_pos} patch position embeddings")
    if same_size(new_size, old_size):
        return pos_embed
    prefix, grid = pos_embed[:, :num_prefix_tokens], pos_embed[:, num_prefix_tokens:]
    dim, dtype = grid.shape[-1], grid.dtype
    grid = grid.float().reshape(1, old_size[0], old_size[1], dim).permute(0, 3, 1, 2)  # (1, C, H, W)
    if interpolation == "bicubic" and torch.compiler.is_exporting():
        # F.interpolate's bicubic becomes ONNX Resize, whose antialiasing needs opset 18 and a runtime that
        # implements it (the TorchScript-based exporter cannot export it at all): the same interpolation as two
        # matmuls exports to plain MatMul at any opset and computes the same values in every runtime
        grid = bicubic_resize_separable(grid, new_size, antialias=antialias)
    else:
        grid = F.interpolate(grid, size=new_size, mode=interpolation, antialias=antialias)
    grid = grid.permute(0, 2, 3, 1).reshape(1, -1, dim).to(dtype)
    return torch.cat([prefix, grid], dim=1)


def _cubic(x: torch.Tensor, a: float) -> torch.Tensor:
    """Keys' cubic convolution kernel W(x) (Keys, 1981, Eq. 15) with parameter ``a``, zero for |x| >= 2."""
    x = x.abs()
    near = ((a + 2) * x - (a + 3)) * x * x + 1  # |x| <= 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a  # 1 < |x| < 2
    return torch.where(x <= 1, near, torch.where(x < 2, far, torch.zeros_like(x)))


def bicubic_matrix(out_size, in_size: int, antialias: bool = False, device=None) -> torch.Tensor:
    """The (out_size, in_size) float32 matrix M with ``M @ v`` = ``F.interpolate(mode='bicubic',
    align_corners=False)`` of a 1-D signal ``v`` resized from ``in_size`` to ``out_size``, built from tensor ops
    only, so ``out_size`` may be symbolic (``torch.export``). PyTorch's kernels (aten/src/ATen/native/UpSample.h):

    - ``antialias=False``: output ``i`` samples the input at ``s = (i + 0.5) * in / out - 0.5`` with Keys'
      kernel (``a = -0.75``) on the 4 neighbours ``floor(s) - 1 .. floor(s) + 2``, indices clamped to the border;
    - ``antialias=True`` (PIL's filter): ``a = -0.5``, stretched by the scale ``in / out`` when shrinking, centred
      at ``(i + 0.5) * in / out``, each row normalised to sum 1.
    """
    i = torch.arange(out_size, device=device, dtype=torch.float32)[:, None]  # (out, 1)
    j = torch.arange(in_size, device=device, dtype=torch.float32)[None]  # (1, in)
    scale = in_size / i.new_full((), out_size)  # float32, as PyTorch's area_pixel_compute_scale
    if antialias:
        stretch = scale.clamp(min=1.0)  # the filter widens only when downsampling
        w = _cubic((j - scale * (i + 0.5) + 0.5) / stretch, -0.5)
        return w / w.sum(dim=1, keepdim=True)
    src = scale * (i + 0.5) - 0.5
    x0 = src.floor()
    t = src - x0
    m = torch.zeros_like(t * j)  # (out, in)
    for k, d in enumerate((t + 1, t, 1 - t, 2 - t)):  # distances to the neighbours floor(s) - 1 + k
        idx = (x0 + (k - 1)).clamp(0, in_size - 1)  # the border sample repeats, as PyTorch's access clamps
        m = m + (idx == j).float() * _cubic(d, -0.75)
    return m


def bicubic_resize_separable(x: torch.Tensor, size, antialias: bool = False) -> torch.Tensor:
    """``F.interpolate(x, size, mode='bicubic', align_corners=False, antialias=antialias)`` of a (N, C, H, W)
    float tensor as two matmuls with :func:`bicubic_matrix` (the bicubic filter is separable: rows, then
    columns). Same result to float rounding; unlike ``F.interpolate`` it exports exactly to ONNX for a symbolic
    ``size``."""
    h, w = to_2tuple(size)
    mh = bicubic_matrix(h, x.shape[-2], antialias, x.device).to(x.dtype)
    mw = bicubic_matrix(w, x.shape[-1], antialias, x.device).to(x.dtype)
    return mh @ x @ mw.T


def _sincos_1d(pos: torch.Tensor, dim: int, temperature: float) -> torch.Tensor:
    omega = 1.0 / temperature ** (torch.arange(dim // 2, dtype=torch.float64) / (dim // 2))
    out = pos.double().flatten()[:, None] * omega[None]  # (N, dim/2)
    return torch.cat([out.sin(), out.cos()], dim=1)


def sincos_2d_pos_embed(grid_size, dim: int, temperature: float = 10000.0) -> torch.Tensor:
    """Fixed (H*W, dim) embedding: half the channels encode the column, half the row, each as sin | cos."""
    if dim % 4:
        raise ValueError(f"2-D sin-cos position embedding needs dim divisible by 4, got {dim}")
    h, w = to_2tuple(grid_size)
    ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    emb = torch.cat([_sincos_1d(xs, dim // 2, temperature), _sincos_1d(ys, dim // 2, temperature)], dim=1)
    return emb.float()


def rope_frequencies(dim: int, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """RoPE's ``m * theta``: angles (len(positions), dim/2) with ``theta_i = base ** (-2i / dim)``."""
    if dim % 2:
        raise ValueError(f"RoPE needs an even dimension, got {dim}")
    theta = base ** (-torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device) / dim)
    return torch.outer(positions.double(), theta)


class RotaryEmbedding2D(nn.Module):
    """Axial 2-D RoPE for heads of size ``head_dim`` (divisible by 4). ``forward(hw)`` returns the (cos, sin)
    tables, each (H*W, head_dim), that :func:`apply_rope` uses."""

    def __init__(self, head_dim: int, base: float = 10000.0):
        super().__init__()
        if head_dim % 4:
            raise ValueError(f"2-D RoPE needs a head dimension divisible by 4, got {head_dim}")
        self.head_dim = head_dim
        self.base = base

    def forward(self, hw: tuple[int, int], device=None, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        h, w = hw
        ys, xs = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
        half = self.head_dim // 2
        angles = torch.cat([rope_frequencies(half, ys.flatten(), self.base),
                            rope_frequencies(half, xs.flatten(), self.base)], dim=1)  # (N, head_dim/2)
        angles = angles.repeat_interleave(2, dim=1)  # one angle per pair (x_2i, x_2i+1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2, x3, x4, ...) -> (-x2, x1, -x4, x3, ...): the second vector of RoPE's rotation formula."""
    x = x.unflatten(-1, (-1, 2))
    return torch.stack([-x[..., 1], x[..., 0]], dim=-1).flatten(-2)


def rope_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE's rotation in real arithmetic, ``x*cos + rot(x)*sin`` (RoFormer Eq. 34), with ``cos`` / ``sin``
    broadcasting against ``x`` (e.g. (B, 1, N, head_dim) tables of per-sequence positions)."""
    return x * cos + _rotate_pairs(x) * sin


def apply_rope(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate the last ``len(cos)`` tokens of ``x`` (B, heads, N, head_dim); leading prefix tokens (CLS) are
    left unrotated. Real arithmetic ``x*cos + rot(x)*sin`` equals RoPE's complex product."""
    cos, sin = rope
    n = cos.shape[0]
    prefix, tokens = x[..., : x.shape[-2] - n, :], x[..., x.shape[-2] - n :, :]
    tokens = rope_rotate(tokens, cos.to(x.dtype), sin.to(x.dtype))
    return torch.cat([prefix, tokens], dim=-2) if prefix.shape[-2] else tokens


class RotaryEmbedding1D(nn.Module):
    """1-D RoPE (Su et al., 2021, "RoFormer", Eq. 34) for token sequences: position m rotates each
    pair ``(x_{2i}, x_{2i+1})`` of a head by ``m * theta_i``, ``theta_i = base ** (-2i / head_dim)``, so the
    score q_m . k_n depends only on m - n. ``forward(seq_len)`` returns the (cos, sin) tables, each
    (seq_len, head_dim), that :func:`apply_rope` uses (the Llama-2 attention rotates queries and keys only)."""

    def __init__(self, head_dim: int, base: float = 10000.0):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head dimension, got {head_dim}")
        self.head_dim = head_dim
        self.base = base

    def forward(self, seq_len: int, device=None, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        angles = rope_frequencies(self.head_dim, torch.arange(seq_len, device=device), self.base)
        angles = angles.repeat_interleave(2, dim=1)  # one angle per pair (x_2i, x_2i+1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    """RoPE's rotations as unit complex numbers ``exp(i * m * theta_j)``: (end, dim/2) complex64 for positions
    ``m < end`` and ``theta_j = theta ** (-2j / dim)`` (Su et al., 2021, Sec. 3.4.2; Llama 2's ``freqs_cis``)."""
    angles = rope_frequencies(dim, torch.arange(end), theta).float()
    return torch.polar(torch.ones_like(angles), angles)


def apply_rotary_embs(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (B, N, heads, head_dim) by ``freqs_cis``, (N, head_dim/2) for every sequence alike or
    (B, N, 1, head_dim/2) with each sequence's own positions (left-padded prompts): each consecutive pair
    ``(x_2j, x_2j+1)`` is read as the complex number ``x_2j + i x_2j+1`` and multiplied by its rotation; equal to
    :func:`rope_rotate` with the real tables of :class:`RotaryEmbedding1D`."""
    x_c = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))  # (B, N, heads, head_dim/2)
    if freqs_cis.dim() == 2:
        freqs_cis = freqs_cis[None, :, None, :]
    out = torch.view_as_real(x_c * freqs_cis).flatten(-2)
    return out.type_as(x)
