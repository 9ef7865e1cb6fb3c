"""Patch embedding: cut an image into non-overlapping p x p patches and project each to ``embed_dim``
(ViT, Dosovitskiy et al., 2021). Two formulations compute the same function:

- :class:`PatchEmbed`: a strided ``p x p`` convolution (timm's layout, ``proj.weight`` of shape (D, C, p, p)).
  :func:`vitlab.optimize` may run it as one patch GEMM where that measures faster (same function);
- :class:`LinearPatchEmbed`: the unfold ``b c (h p1) (w p2) -> b (h w) (p1 p2 c)`` then a Linear,
  optionally with LayerNorm before and after (HaLViT's embedding).

:class:`ConvStemEmbed` replaces the patchify step by a convolutional stem with the same output grid (Xiao et al.,
2021, "Early Convolutions Help Transformers See Better", Sec. 3): log2(p) 3x3 stride-2 convolutions with
BatchNorm and ReLU, then a 1x1 projection. ``EMBED_LAYERS`` names the three for configuration files.

All three check the input (4-D, channel count, size divisible by the patch unless ``dynamic_img_pad``) and raise
one clear error instead of failing deep inside a matmul.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from vitlab.layers.helpers import by_name, check_image, to_2tuple


class _PatchGrid(nn.Module):
    """Geometry and input checks shared by both patch embeddings."""

    def __init__(self, img_size, patch_size, in_chans: int, strict_img_size: bool, dynamic_img_pad: bool):
        super().__init__()
        self.patch_size = to_2tuple(patch_size)
        self.in_chans = in_chans
        self.strict_img_size = strict_img_size
        self.dynamic_img_pad = dynamic_img_pad
        self.img_size = to_2tuple(img_size) if img_size is not None else None
        if self.img_size is not None:
            self._check_divisible(*self.img_size)
            self.grid_size = self.dynamic_feat_size(self.img_size)
            self.num_patches = self.grid_size[0] * self.grid_size[1]
        else:
            self.grid_size, self.num_patches = None, None

    def _check_divisible(self, h: int, w: int) -> None:
        ph, pw = self.patch_size
        if not self.dynamic_img_pad and (h % ph or w % pw):
            raise ValueError(f"image size {h}x{w} is not divisible by the patch size {ph}x{pw}; "
                             f"use a multiple of the patch size or dynamic_img_pad=True")

    def dynamic_feat_size(self, img_size: tuple[int, int]) -> tuple[int, int]:
        """Token grid (H', W') for an input of ``img_size`` (rounded up when padding dynamically)."""
        (h, w), (ph, pw) = img_size, self.patch_size
        if self.dynamic_img_pad:
            return -(-h // ph), -(-w // pw)
        return h // ph, w // pw

    def _prepare(self, x: torch.Tensor) -> torch.Tensor:
        h, w = check_image(x, self.in_chans)
        if self.strict_img_size and self.img_size is not None and (h, w) != self.img_size:
            raise ValueError(f"input size {h}x{w} does not match the model's {self.img_size[0]}x{self.img_size[1]}; "
                             f"create the model with img_size=({h}, {w}) or dynamic_img_size=True")
        self._check_divisible(h, w)
        ph, pw = self.patch_size
        if self.dynamic_img_pad and (h % ph or w % pw):
            x = F.pad(x, (0, (pw - w % pw) % pw, 0, (ph - h % ph) % ph))
        return x


class PatchEmbed(_PatchGrid):
    """Conv formulation. ``forward`` returns tokens (B, N, D), or (B, H', W', D) with ``flatten=False``."""

    def __init__(self, img_size=224, patch_size=16, in_chans: int = 3, embed_dim: int = 768,
                 norm_layer: Callable[..., nn.Module] | None = None, flatten: bool = True, bias: bool = True,
                 strict_img_size: bool = True, dynamic_img_pad: bool = False):
        super().__init__(img_size, patch_size, in_chans, strict_img_size, dynamic_img_pad)
        self.flatten = flatten
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=self.patch_size, stride=self.patch_size, bias=bias)
        self.norm = norm_layer(embed_dim) if norm_layer else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(self._prepare(x))  # (B, D, H', W')
        x = x.flatten(2).transpose(1, 2) if self.flatten else x.permute(0, 2, 3, 1)
        return self.norm(x)


class LinearPatchEmbed(_PatchGrid):
    """Unfold + Linear formulation, with optional LayerNorm on the raw patch (``pre_norm``)
    and on the embedding (``norm_layer``), as HaLViT does."""

    def __init__(self, img_size=224, patch_size=16, in_chans: int = 3, embed_dim: int = 768,
                 norm_layer: Callable[..., nn.Module] | None = None, pre_norm: bool = False, flatten: bool = True,
                 bias: bool = True, strict_img_size: bool = True, dynamic_img_pad: bool = False):
        super().__init__(img_size, patch_size, in_chans, strict_img_size, dynamic_img_pad)
        ph, pw = self.patch_size
        patch_dim = in_chans * ph * pw
        self.flatten = flatten
        self.pre_norm = nn.LayerNorm(patch_dim) if pre_norm else nn.Identity()
        self.proj = nn.Linear(patch_dim, embed_dim, bias=bias)
        self.norm = norm_layer(embed_dim) if norm_layer else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._prepare(x)
        ph, pw = self.patch_size
        x = rearrange(x, "b c (h p1) (w p2) -> b h w (p1 p2 c)", p1=ph, p2=pw)
        x = self.norm(self.proj(self.pre_norm(x)))  # (B, H', W', D)
        return x.flatten(1, 2) if self.flatten else x


class ConvStemEmbed(_PatchGrid):
    """Convolutional stem (Xiao et al., 2021, Sec. 3 and Table 1, ViT_C): for a patch size p = 2^n, n 3x3
    convolutions of stride 2 (no bias, BatchNorm, ReLU) whose widths double up to ``embed_dim`` (D / 2^(n-1), ...,
    D: the 24-48-96-192 of their 1 GF model at D = 192), then a 1x1 convolution ``proj`` to ``embed_dim``. The
    token grid is the patch embedding's; the stem sees across patch borders and is equivariant to translation,
    which a model trained from scratch on little data needs to tell small objects apart wherever they lie."""

    def __init__(self, img_size=224, patch_size=16, in_chans: int = 3, embed_dim: int = 768,
                 norm_layer: Callable[..., nn.Module] | None = None, flatten: bool = True, bias: bool = True,
                 strict_img_size: bool = True, dynamic_img_pad: bool = False):
        super().__init__(img_size, patch_size, in_chans, strict_img_size, dynamic_img_pad)
        p = self.patch_size[0]
        n = p.bit_length() - 1
        if self.patch_size[1] != p or p < 2 or p != 1 << n:
            raise ValueError(f"a convolutional stem needs a square power-of-two patch size, got {self.patch_size}")
        if embed_dim % (1 << (n - 1)):
            raise ValueError(f"embed_dim {embed_dim} must be divisible by {1 << (n - 1)} for a stem of {n} "
                             f"stride-2 convolutions (patch size {p})")
        self.flatten = flatten
        layers, c = [], in_chans
        for i in range(n):
            width = embed_dim >> (n - 1 - i)
            layers += [nn.Conv2d(c, width, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(width),
                       nn.ReLU(inplace=True)]
            c = width
        self.stem = nn.Sequential(*layers)
        self.proj = nn.Conv2d(c, embed_dim, kernel_size=1, bias=bias)
        self.norm = norm_layer(embed_dim) if norm_layer else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(self.stem(self._prepare(x)))  # (B, D, H', W')
        x = x.flatten(2).transpose(1, 2) if self.flatten else x.permute(0, 2, 3, 1)
        return self.norm(x)


EMBED_LAYERS = {"patch": PatchEmbed, "linear": LinearPatchEmbed, "conv_stem": ConvStemEmbed}


def get_embed_layer(layer: str | Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """A patch-embedding class by its name in :data:`EMBED_LAYERS` (a callable passes through)."""
    return by_name(EMBED_LAYERS, layer, "embed_layer")


def conv_to_linear_patch_weight(weight: torch.Tensor) -> torch.Tensor:
    """Conv kernel (D, C, p1, p2) -> Linear weight (D, p1*p2*C) in the ``(p1 p2 c)`` order of the unfold."""
    return rearrange(weight, "d c p1 p2 -> d (p1 p2 c)")
