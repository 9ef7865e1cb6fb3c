"""dat (deformable attention): Table IV cost; with zero offsets it is MSA over the pixels plus the table's
relative position bias at integer displacements; offsets stay within their range; dtypes."""

from __future__ import annotations

import pytest
import torch

import vitlab.attention as A

from .test_msa_naive import check_forward_backward, params_and_macs


def test_table_iv_params_and_macs():
    params, macs = params_and_macs("dat")
    assert params / 1e6 == pytest.approx(2.38, rel=0.02)
    assert macs / 1e6 == pytest.approx(528.7, rel=0.02)


@pytest.mark.parametrize("hw", [(5, 6), (7, 7)])
def test_zero_offsets_is_msa_with_relative_position_bias(hw):
    torch.manual_seed(0)
    H, W = hw
    m = A.create("dat", 48, 6, q_size=hw).eval()
    with torch.no_grad():
        m.conv_offset[-1].weight.zero_()  # offsets 0: sample exactly at the pixels
        m.rpe_table.normal_()
    x = torch.randn(2, H * W, 48)
    B, N, C, h, d = 2, H * W, 48, 6, 8
    q = m.proj_q(x).reshape(B, N, h, d).transpose(1, 2)
    k = m.proj_k(x).reshape(B, N, h, d).transpose(1, 2)
    v = m.proj_v(x).reshape(B, N, h, d).transpose(1, 2)
    r, c = torch.arange(H).repeat_interleave(W), torch.arange(W).repeat(H)
    dy, dx = r[:, None] - r[None] + H - 1, c[:, None] - c[None] + W - 1  # (N, N) table indices
    bias = m.rpe_table[:, dy, dx]  # (heads, N, N)
    a = (q @ k.transpose(-1, -2) * d**-0.5 + bias).softmax(-1)
    ref = m.proj_out((a @ v).transpose(1, 2).reshape(B, N, C))
    torch.testing.assert_close(m(x, hw), ref, rtol=1e-4, atol=1e-5)


def test_offsets_bounded_by_range_factor():
    m = A.create("dat", 48, 6)
    with torch.no_grad():
        m.conv_offset[-1].weight.fill_(10.0)  # saturate tanh
    seen = {}
    m.conv_offset.register_forward_hook(lambda mod, i, o: seen.setdefault("off", o))
    m(torch.randn(1, 14 * 14, 48), (14, 14))
    steps = seen["off"].tanh().abs().max()  # in units of range_factor key-grid steps
    assert steps <= 1.0


def test_prefix_rejected():
    with pytest.raises(ValueError, match="prefix"):
        A.create("dat", 48, 6)(torch.randn(1, 1 + 196, 48), (14, 14))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_backward(dtype):
    check_forward_backward("dat", dtype)
