"""VAN's large-kernel attention: 5x5 then 7x7 dilated by 3 (5 + 6*3 = 23 wide), grid tokens only."""

from __future__ import annotations

import pytest
import torch

from vitlab.attention import create


def test_receptive_field_and_shortcut_optional():
    attn = create("van", 16, 1, shortcut=False).eval()
    x = torch.zeros(1, 31 * 31, 16, requires_grad=True)
    attn(x + 0.1, (31, 31))[0, 15 * 31 + 15].sum().backward()  # centre token
    hit = x.grad[0].abs().sum(-1).view(31, 31) > 0
    rows, cols = hit.any(1).nonzero(), hit.any(0).nonzero()
    assert (rows.max() - rows.min() + 1, cols.max() - cols.min() + 1) == (23, 23)


def test_prefix_tokens_are_refused():
    with pytest.raises(ValueError, match="prefix"):
        create("van", 16, 1)(torch.randn(1, 1 + 9, 16), (3, 3))
