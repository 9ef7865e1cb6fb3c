"""Small shared helpers for building layers."""

from __future__ import annotations

import collections.abc
import math

import torch.nn as nn


def by_name(table: dict, key, what: str):
    """``table[key]`` for a layer named by a string, ``key`` itself when it is already a callable (a class or a
    factory); an unknown name is one ValueError listing the known ones."""
    if callable(key):
        return key
    if key not in table:
        raise ValueError(f"unknown {what} {key!r}; choose from {sorted(table)}")
    return table[key]


def to_2tuple(x) -> tuple:
    """``7 -> (7, 7)``; an iterable of two is returned as a tuple."""
    if isinstance(x, collections.abc.Iterable) and not isinstance(x, str):
        t = tuple(x)
        if len(t) != 2:
            raise ValueError(f"expected an int or a pair, got {x!r}")
        return t
    return (x, x)


def same_size(a, b) -> bool:
    """``tuple(a) == tuple(b)`` for sizes held as Python ints (eager). A symbolic size (``torch.export`` with a
    dynamic image size) counts as different unless it is provably equal, and no guard is recorded: the code that
    adapts to the size (resampling position embeddings to the input's grid) stays in the graph and is correct at
    every size, instead of the branch being fixed to the traced size."""
    a, b = tuple(a), tuple(b)
    if all(type(v) is int for v in a + b):
        return a == b
    from torch.fx.experimental.symbolic_shapes import statically_known_true  # only for symbolic sizes

    return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b))


def make_divisible(v: float, divisor: int = 8) -> int:
    """Round ``v`` up to the next multiple of ``divisor`` (the Llama / SwiGLU hidden-size rule)."""
    return int(math.ceil(v / divisor) * divisor)


def check_heads(dim: int, num_heads: int) -> int:
    """Return the head dimension, with a clear error when ``dim`` does not split evenly over the heads."""
    if num_heads <= 0 or dim % num_heads:
        raise ValueError(f"dim {dim} is not divisible by num_heads {num_heads}")
    return dim // num_heads


def check_image(x, in_chans: int) -> tuple[int, int]:
    """Validate a (B, C, H, W) image batch against the model's channel count; return (H, W).

    Every model calls this first so a wrong input fails with one clear line, not deep inside a conv."""
    if x.ndim != 4:
        raise ValueError(f"expected images of shape (B, C, H, W), got shape {tuple(x.shape)}")
    if x.shape[1] != in_chans:
        raise ValueError(f"expected {in_chans} input channels, got {x.shape[1]} (input shape {tuple(x.shape)})")
    return x.shape[-2], x.shape[-1]


def init_linears_trunc_normal_(module, std: float = 0.02) -> None:
    """The ViT-family init of every ``nn.Linear`` inside ``module``: truncated-normal weights, zero biases."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


def downsample_size(size: int) -> int:
    """Output length of a 3x3 stride-2 pad-1 convolution (ceil(size / 2))."""
    return (size - 1) // 2 + 1
