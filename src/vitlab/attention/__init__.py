"""The one home of attention: the registry, multi-head self-attention (``msa``), every zoo mechanism, the
offset-bias attention of LeViT / EfficientFormer and the pluggable pre-norm :class:`Block`.

Every mechanism sits behind one interface, ``forward(x, hw)`` with x (B, N, C) tokens of an H x W grid, and is
built by name with :func:`create` (``Block(dim, heads, attn_layer='hilo')`` does the same inside a block).
Asked with ``return_attn=True`` a mechanism that forms attention weights returns ``(out, weights)``; its class
says so (``has_attention_weights = True``) and what they are over (``attention_kind``: ``"global"``,
``"window"`` (stitched to a dense N x N map), ``"spatial_reduction"``, ``"projected"``, ``"channels"``, ...); one
that forms none (linear attention, Performer, gnConv, VAN) sets ``has_attention_weights = False`` and refuses the
keyword with a ValueError. The softmax attention of the plain-ViT family (:class:`QKVAttention`: ``msa``,
HaLViT's) also takes ``attn_mask``, ``return_qk`` and ``attn_policy`` (token merging and pruning use them). Each
module of this package holds one mechanism and registers it on import (a new file is picked up without editing
this one). Building blocks that know no attention (MLP, norms, drop path, embeddings) live in
:mod:`vitlab.layers`.
"""

import importlib
import pkgutil

from vitlab.attention._registry import (
    accepts_keywords,
    accepts_prefix_tokens,
    attention_weights_error,
    create_attention,
    get_attention,
    has_attention_weights,
    layout_kwargs,
    list_attention,
    register_attention,
)
from vitlab.attention._window import pad_to_multiple, stitch_windows, window_positions
from vitlab.attention.block import Block
from vitlab.attention.local_window import LocalWindowAttention
from vitlab.attention.msa import MultiHeadSelfAttention, QKVAttention, softmax_with_policy
from vitlab.attention.offset_bias import OffsetBiasAttentionBase, fold_offset_biases
from vitlab.attention.shifted_window import ShiftedWindowAttention
from vitlab.attention.sra import SpatialReductionAttention

create = create_attention

for _mod in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_mod.name}")

__all__ = [
    "Block", "LocalWindowAttention", "MultiHeadSelfAttention", "OffsetBiasAttentionBase", "QKVAttention",
    "ShiftedWindowAttention", "SpatialReductionAttention", "accepts_keywords", "accepts_prefix_tokens",
    "attention_weights_error", "create", "create_attention", "fold_offset_biases", "get_attention",
    "has_attention_weights", "layout_kwargs", "list_attention", "pad_to_multiple", "register_attention",
    "softmax_with_policy", "stitch_windows", "window_positions",
]
