"""The attention registry: every token mixer is built by name through ``create_attention(name, dim,
num_heads, **kw)`` and called as ``forward(x, hw)`` with x (B, N, C) and hw = (H, W) of the token grid.

A mechanism registers itself with ``@register_attention("name")`` in its own module of :mod:`vitlab.attention`;
importing the package imports them all. This module registers nothing and imports no mechanism (so every
mechanism, and :class:`~vitlab.attention.block.Block`, can import it without a cycle).
"""

from __future__ import annotations

import difflib
import inspect
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


def accepts_keywords(layer: nn.Module | Callable[..., nn.Module], *names: str) -> bool:
    """Whether the ``forward`` of attention ``layer`` (a module or its class) takes every keyword of ``names``
    (``return_attn``, ``return_qk``, ``attn_mask``, ``rope``, ...)."""
    forward = getattr(layer, "forward", None)
    if forward is None:
        return False
    try:
        params = inspect.signature(forward).parameters
    except (TypeError, ValueError):  # a builtin or C callable: nothing to inspect
        return False
    return all(n in params for n in names)


def has_attention_weights(layer: nn.Module | Callable[..., nn.Module]) -> bool:
    """Whether attention ``layer`` (a module or its class) returns weights with ``return_attn=True``: its
    ``has_attention_weights`` attribute, else whether its ``forward`` takes ``return_attn``."""
    declared = getattr(layer, "has_attention_weights", None)
    return accepts_keywords(layer, "return_attn") if declared is None else bool(declared)


def attention_weights_error(layer: nn.Module) -> ValueError:
    """The error a mechanism without explicit attention weights raises when asked for them (``return_attn``)."""
    return ValueError(f"{type(layer).__name__} forms no attention weights (has_attention_weights = False): it "
                      f"mixes tokens without a softmax over keys, so there are none to return")


def _init_params(factory: Callable[..., nn.Module]) -> set[str]:
    try:
        return set(inspect.signature(factory).parameters)
    except (TypeError, ValueError):  # a builtin or C callable: nothing to inspect
        return set()


def layout_kwargs(attn_layer: str | Callable[..., nn.Module], *, num_prefix_tokens: int, grid_size,
                  attn_kwargs: dict | None = None, rope: bool = False, model: str = "this model") -> dict:
    """Check that mechanism ``attn_layer`` works on a model's token layout (``num_prefix_tokens`` prefix tokens
    before a ``grid_size`` grid; RoPE if ``rope``) and return its keyword arguments: ``attn_kwargs`` plus the
    layout arguments the mechanism asks for and the caller did not set (``num_prefix_tokens``, ``grid_size``,
    e.g. Linformer's sequence projections are sized by them).

    One ValueError, raised when the model is built, for a grid mechanism (``prefix_tokens = False``) given
    prefix tokens, or RoPE given a mechanism whose ``forward`` takes no ``rope``."""
    factory = get_attention(attn_layer)
    name = attn_layer if isinstance(attn_layer, str) else getattr(attn_layer, "__name__", repr(attn_layer))
    if num_prefix_tokens and not accepts_prefix_tokens(factory):
        raise ValueError(
            f"attention {name!r} attends over the H x W token grid only and takes no prefix tokens, but {model} "
            f"puts {num_prefix_tokens} (class / distillation / register) before the grid; build it without them "
            f"(class_token=False, global_pool='avg', no dist / register tokens) or choose a mechanism that "
            f"takes them (e.g. {', '.join(n for n in list_attention() if accepts_prefix_tokens(n))})")
    forward = getattr(factory, "forward", None)
    if rope and (forward is None or "rope" not in inspect.signature(forward).parameters):
        raise ValueError(f"pos_embed='rope' needs an attention that rotates queries and keys (msa); "
                         f"{name!r} takes no rope")
    kw = dict(attn_kwargs or {})
    params = _init_params(factory)
    if "num_prefix_tokens" in params:
        kw.setdefault("num_prefix_tokens", num_prefix_tokens)
    if "grid_size" in params and grid_size is not None:
        kw.setdefault("grid_size", tuple(grid_size))
    return kw
