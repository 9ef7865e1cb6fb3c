"""gnConv: order-4 widths at 1/16 scale, bad widths refused."""

from __future__ import annotations

import pytest
import torch

from vitlab.attention import create


def test_order_and_widths():
    attn = create("hornet", 64, 4)
    assert attn.order == 4 and attn.dims == [8, 16, 32, 64]
    assert [pw.out_channels for pw in attn.pws] == [16, 32, 64]
    assert create("hornet", 64, 4, order=5).dims == [4, 8, 16, 32, 64]
    with pytest.raises(ValueError, match="divisible"):
        create("hornet", 20, 4)


def test_prefix_tokens_are_refused():
    with pytest.raises(ValueError, match="prefix"):
        create("hornet", 64, 4)(torch.randn(1, 1 + 9, 64), (3, 3))
