"""msa_naive: the explicit-softmax baseline equals the fused msa for the same weights, and costs the same.

Also home of the small helpers the tests of the other mechanisms of this set import (``params_and_macs``,
``check_forward_backward``, ``masked_msa``): msa is the reference they are all checked against.
"""

from __future__ import annotations

import pytest
import torch

import vitlab.attention as A
from vitlab.profile import count_macs


class Grid(torch.nn.Module):
    """Binds hw so count_macs can call the layer with x only."""

    def __init__(self, attn, hw):
        super().__init__()
        self.attn, self.hw = attn, hw

    def forward(self, x):
        return self.attn(x, self.hw)


def params_and_macs(name, dim=768, heads=12, hw=(14, 14), **kw):
    """(parameters, MACs) of one layer at batch 1, counted on the meta device (as vitlab.profile_model)."""
    with torch.device("meta"):
        m = A.create(name, dim, heads, **kw).eval()
        x = torch.zeros(1, hw[0] * hw[1], dim)
    return sum(p.numel() for p in m.parameters()), count_macs(Grid(m, hw), x)


def check_forward_backward(name, dtype, dim=48, heads=6, hw=(13, 17), **kw):
    """Forward and backward on a 13 x 17 grid: shape, dtype, finite gradients (input and every weight)."""
    torch.manual_seed(0)
    m = A.create(name, dim, heads, **kw).to(dtype)
    x = torch.randn(2, hw[0] * hw[1], dim, dtype=dtype, requires_grad=True)
    y = m(x, hw)
    assert y.shape == x.shape and y.dtype == dtype and torch.isfinite(y).all()
    y.float().square().mean().backward()
    assert torch.isfinite(x.grad).all()
    for n, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n


def masked_msa(msa, x, allowed):
    """msa's function with an explicit (N, N) bool mask: the definition the windowed layers must equal."""
    B, N, C = x.shape
    h = msa.num_heads
    q, k, v = msa.qkv(x).reshape(B, N, 3, h, C // h).permute(2, 0, 3, 1, 4)
    a = (q @ k.transpose(-1, -2) * (C // h) ** -0.5).masked_fill(~allowed, float("-inf")).softmax(-1)
    return msa.proj((a @ v).transpose(1, 2).reshape(B, N, C))


def test_equals_msa_same_weights_with_prefix_token():
    torch.manual_seed(0)
    ref = A.create("msa", 64, 4).eval()
    naive = A.create("msa_naive", 64, 4).eval()
    naive.load_state_dict(ref.state_dict())  # same keys: qkv, proj
    x = torch.randn(2, 1 + 13 * 17, 64)  # a class token + a 13 x 17 grid
    torch.testing.assert_close(naive(x, (13, 17)), ref(x, (13, 17)), rtol=1e-5, atol=1e-5)
    out, attn = naive(x, (13, 17), return_attn=True)
    assert attn.shape == (2, 4, x.shape[1], x.shape[1])


def test_table_iv_params_and_macs():
    params, macs = params_and_macs("msa_naive")
    assert params / 1e6 == pytest.approx(2.36, rel=0.02)
    assert macs / 1e6 == pytest.approx(521.4, rel=0.02)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_backward(dtype):
    check_forward_backward("msa_naive", dtype)
