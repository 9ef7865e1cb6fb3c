"""Shared test helpers: building the small ('smoke') instance of any registered model."""

from __future__ import annotations

import pytest
import torch

import vitlab


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def smoke_model(name: str, batch_size: int = 2, **kwargs) -> tuple[torch.nn.Module, torch.Tensor]:
    """The model built with its config's ``smoke_kwargs`` (plus ``kwargs``) and a matching random input."""
    cfg = vitlab.get_model_config(name)
    kw = {**cfg.smoke_kwargs, **kwargs}
    model = vitlab.create_model(name, **kw)
    size = kw.get("img_size", cfg.input_size[1:])
    h, w = (size, size) if isinstance(size, int) else size
    x = torch.randn(batch_size, kw.get("in_chans", cfg.input_size[0]), h, w)
    return model, x


def as_logits(out) -> torch.Tensor:
    """A distilled model in train mode returns (cls_logits, dist_logits); reduce to one tensor."""
    return sum(out) / len(out) if isinstance(out, tuple) else out
