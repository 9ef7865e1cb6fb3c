"""The attention zoo: every mechanism behind one interface, ``forward(x, hw)`` with x (B, N, C) tokens of an
H x W grid, built by name with :func:`create`. The registry itself lives in :mod:`vitlab.layers.create_attn`
so that :class:`vitlab.layers.Block` can build any mechanism by name (``attn_layer='msa'``). Each module of
this package holds one mechanism and registers it on import (a new file is picked up without editing this one).
"""

import importlib
import pkgutil

from vitlab.layers.attention import Attention as MultiHeadSelfAttention
from vitlab.layers.create_attn import create_attention as create
from vitlab.layers.create_attn import list_attention, register_attention

for _mod in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_mod.name}")

__all__ = ["MultiHeadSelfAttention", "create", "list_attention", "register_attention"]
