"""FAVOR+ approximates softmax attention, better with more random features."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vitlab.attention import create
from vitlab.attention.performer import favor_attention, orthogonal_gaussian


def _mean_error(num_features: int, trials: int = 8) -> float:
    g = torch.Generator().manual_seed(123)
    errs = []
    for _ in range(trials):
        q, k, v = (torch.randn(2, 2, 64, 16, generator=g) * 0.6 for _ in range(3))
        exact = F.scaled_dot_product_attention(q, k, v)
        approx = favor_attention(q, k, v, orthogonal_gaussian(num_features, 16, g))
        errs.append(((approx - exact).norm() / exact.norm()).item())
    return sum(errs) / len(errs)


def test_approximates_softmax_and_improves_with_features():
    errors = [_mean_error(m) for m in (8, 64, 1024)]
    assert errors[0] > errors[1] > errors[2], errors
    assert errors[2] < 0.5 * errors[1] and errors[2] < 0.2, errors  # ~ 1/sqrt(m) Monte-Carlo error


def test_orthogonal_features_are_orthogonal_per_block():
    w = orthogonal_gaussian(40, 16, torch.Generator().manual_seed(0))
    assert w.shape == (40, 16)
    block = w[:16] / w[:16].norm(dim=1, keepdim=True)
    torch.testing.assert_close(block @ block.T, torch.eye(16), atol=1e-5, rtol=0)


def test_features_are_a_buffer_and_can_be_redrawn():
    attn = create("performer", 64, 4)
    assert "features" in dict(attn.named_buffers()) and attn.features.shape == (256, 16)
    before = attn.features.clone()
    attn.redraw_features()
    assert not torch.equal(before, attn.features)
    with torch.device("meta"):
        assert create("performer", 64, 4).features.is_meta
