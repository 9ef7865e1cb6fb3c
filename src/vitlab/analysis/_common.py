"""Small helpers shared by the analysis tools (no tool of its own)."""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn


def eval_forward(model: nn.Module, x: torch.Tensor, recording=None) -> None:
    """One forward of ``model`` on ``x`` in eval mode without autograd, inside ``recording`` (a context manager
    that patches what a tool reads); the model's train / eval mode is restored afterwards."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), recording or contextlib.nullcontext():
            model(x)
    finally:
        model.train(was_training)


def pick(items: list, index: int, label: str, plural: str):
    """``items[index]`` (negative from the end), or a one-line ValueError giving the valid range."""
    if not -len(items) <= index < len(items):
        raise ValueError(f"{label} index {index} is out of range: this model has {len(items)} {plural} "
                         f"(0..{len(items) - 1}, or -1 for the last)")
    return items[index]
