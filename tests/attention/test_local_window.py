"""local_window (Swin W-MSA): Table IV cost, equality with msa when one window covers the map, exact
windowing on grids that the window does not divide, dtypes."""

from __future__ import annotations

import pytest
import torch

import vitlab.attention as A

from .test_msa_naive import check_forward_backward, masked_msa, params_and_macs


def test_table_iv_params_and_macs():
    params, macs = params_and_macs("local_window")
    assert params / 1e6 == pytest.approx(2.36, rel=0.02)
    assert macs / 1e6 == pytest.approx(477.2, rel=0.02)


@pytest.mark.parametrize("hw", [(7, 7), (5, 6)])  # exactly one window, and one padded window
def test_window_covering_map_equals_msa(hw):
    torch.manual_seed(0)
    msa = A.create("msa", 48, 6).eval()
    win = A.create("local_window", 48, 6, rel_pos_bias=False).eval()
    win.load_state_dict(msa.state_dict())
    x = torch.randn(2, hw[0] * hw[1], 48)
    torch.testing.assert_close(win(x, hw), msa(x, hw), rtol=1e-5, atol=1e-5)


def test_padded_grid_is_exact_windowing():
    torch.manual_seed(0)
    H, W, ws = 13, 17, 7
    msa = A.create("msa", 48, 6).eval()
    win = A.create("local_window", 48, 6, window_size=ws, rel_pos_bias=False).eval()
    win.load_state_dict(msa.state_dict())
    r, c = torch.arange(H).repeat_interleave(W), torch.arange(W).repeat(H)
    same = ((r[:, None] // ws) == (r[None] // ws)) & ((c[:, None] // ws) == (c[None] // ws))
    x = torch.randn(2, H * W, 48)
    torch.testing.assert_close(win(x, (H, W)), masked_msa(msa, x, same), rtol=1e-5, atol=1e-5)


def test_bias_table_shape_and_prefix_rejected():
    m = A.create("local_window", 48, 6)
    assert m.relative_position_bias_table.shape == (13 * 13, 6)
    with pytest.raises(ValueError, match="prefix"):
        m(torch.randn(1, 1 + 49, 48), (7, 7))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_backward(dtype):
    check_forward_backward("local_window", dtype)
