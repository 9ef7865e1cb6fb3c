"""The attention registry: every token mixer is built by name through ``create_attention(name, dim,
num_heads, **kw)`` and called as ``forward(x, hw)`` with x (B, N, C) and hw = (H, W) of the token grid.

A mechanism registers itself with ``@register_attention("name")`` in its own module of :mod:`vitlab.attention`;
importing the package imports them all. This module registers nothing and imports no mechanism (so every
mechanism, and :class:`~vitlab.attention.block.Block`, can import it without a cycle).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable

import torch.nn as nn

_ATTENTION: dict[str, Callable[..., nn.Module]] = {}


def register_attention(name: str):
    def _register(cls):
        if name in _ATTENTION:
            raise ValueError(f"attention {name!r} is registered twice")
        _ATTENTION[name] = cls
        return cls

    return _register


def list_attention() -> list[str]:
    return sorted(_ATTENTION)


def get_attention(name: str | Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """The class (or factory) registered as ``name``; a callable is returned as it is."""
    if callable(name):
        return name
    if name not in _ATTENTION:
        close = difflib.get_close_matches(name, list(_ATTENTION), n=3)
        hint = f"; close matches: {', '.join(close)}" if close else f"; choose from {list_attention()}"
        raise ValueError(f"unknown attention {name!r}{hint}")
    return _ATTENTION[name]


def create_attention(name: str | Callable[..., nn.Module], dim: int, num_heads: int, **kwargs) -> nn.Module:
    """Build an attention layer from a registered name (or a class / factory with the same signature)."""
    return get_attention(name)(dim, num_heads, **kwargs)


def accepts_prefix_tokens(name: str | Callable[..., nn.Module]) -> bool:
    """Whether the mechanism takes prefix (class, distillation, register) tokens before the H x W grid.

    Grid mechanisms (windows, pooling, convolutions over the map) set the class attribute
    ``prefix_tokens = False``; anything that does not say so (MSA, linear attention, ...) is assumed to."""
    return bool(getattr(get_attention(name), "prefix_tokens", True))
