"""The attention registry: every token mixer is built by name through ``create_attention(name, dim,
num_heads, **kw)`` and called as ``forward(x, hw)`` with x (B, N, C) and hw = (H, W) of the token grid.

It lives in ``layers`` so that :class:`~vitlab.layers.block.Block` can build any registered mechanism by name;
``vitlab.attention`` registers the zoo here and re-exports these functions.
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


def create_attention(name: str | Callable[..., nn.Module], dim: int, num_heads: int, **kwargs) -> nn.Module:
    """Build an attention layer from a registered name (or a class / factory with the same signature)."""
    if callable(name):
        return name(dim, num_heads, **kwargs)
    if name not in _ATTENTION:
        close = difflib.get_close_matches(name, list(_ATTENTION), n=3)
        hint = f"; close matches: {', '.join(close)}" if close else f"; choose from {list_attention()}"
        raise ValueError(f"unknown attention {name!r}{hint}")
    return _ATTENTION[name](dim, num_heads, **kwargs)
