"""Gradient checkpointing of a sequence of blocks (timm's ``checkpoint_seq``): one helper for every family."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint


def checkpoint_seq(blocks: Iterable[nn.Module], x: torch.Tensor, *args, enabled: bool = True) -> torch.Tensor:
    """``x = blk(x, *args)`` for each block in order. With ``enabled`` and autograd recording, each block runs
    under :func:`torch.utils.checkpoint.checkpoint` (non-reentrant): its activations are dropped after the
    forward pass and recomputed in the backward pass, which gives the same outputs and gradients for less
    memory. ``args`` (e.g. the grid size ``hw``) are passed to every block unchanged."""
    if enabled and torch.is_grad_enabled():
        for blk in blocks:
            x = checkpoint(blk, x, *args, use_reentrant=False)
    else:
        for blk in blocks:
            x = blk(x, *args)
    return x
