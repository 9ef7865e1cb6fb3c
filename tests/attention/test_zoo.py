"""Every registered attention mechanism behind the common interface, and Table IV's parameter / MAC counts."""

from __future__ import annotations

import pytest
import torch

import vitlab
from vitlab.attention import create, list_attention
from vitlab.bench import TABLE_IV, attention_cost

DIM, HEADS = 64, 4  # small instances: the interface tests need no 768-wide layers
NAMES = list_attention()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_forward_backward_on_odd_grid(name, dtype):
    """A 13 x 17 grid (odd, non-square, not a multiple of any window): shape, finite output and gradients."""
    torch.manual_seed(0)
    attn = create(name, DIM, HEADS).to(dtype).train()
    x = torch.randn(2, 13 * 17, DIM, dtype=dtype, requires_grad=True)
    y = attn(x, (13, 17))
    assert y.shape == x.shape and y.dtype == dtype
    assert torch.isfinite(y).all()
    y.float().square().mean().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    for n, p in attn.named_parameters():
        assert p.grad is None or torch.isfinite(p.grad).all(), n


@pytest.mark.parametrize("name", NAMES)
def test_bf16_tracks_fp32(name):
    torch.manual_seed(0)
    attn = create(name, DIM, HEADS).eval()
    x = torch.randn(2, 14 * 14, DIM)
    with torch.no_grad():
        ref = attn(x, (14, 14))
        out = attn.to(torch.bfloat16)(x.bfloat16(), (14, 14)).float()
    assert (out - ref).norm() / ref.norm() < 0.05


@pytest.mark.parametrize("name", NAMES)
def test_prefix_tokens_work_or_are_refused(name):
    """A class token before the grid: either handled (same shape out) or a clear ValueError."""
    attn = create(name, DIM, HEADS).eval()
    x = torch.randn(1, 1 + 6 * 5, DIM)
    try:
        y = attn(x, (6, 5))
    except ValueError as e:
        assert str(e)
    else:
        assert y.shape == x.shape


@pytest.mark.parametrize("name", NAMES)
def test_in_a_block(name):
    block = vitlab.attention.Block(DIM, HEADS, attn_layer=name)
    x = torch.randn(2, 7 * 9, DIM)
    assert block(x, (7, 9)).shape == x.shape


@pytest.mark.parametrize("name", list(TABLE_IV))
def test_params_and_macs_match_table_iv(name):
    """Defaults reproduce Table IV (dim 768, 12 heads, 14x14, batch 1) within 2%.

    Rows whose mechanism is not registered yet are skipped."""
    if name not in NAMES:
        pytest.skip(f"{name} is not registered (yet)")
    _, params_m, mflops, _, _ = TABLE_IV[name]
    got_params, got_mflops = attention_cost(name, (14, 14), 768, 12)
    assert got_params == pytest.approx(params_m, rel=0.02)
    assert got_mflops == pytest.approx(mflops, rel=0.02)
