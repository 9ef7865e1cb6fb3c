"""focal (Focal self-attention): Table IV cost, reduction to window attention, the reach of each focal level
(perturbation tests, including no wrap-around at the border), dtypes."""

from __future__ import annotations

import pytest
import torch

import vitlab.attention as A

from .test_msa_naive import check_forward_backward, params_and_macs


def test_table_iv_params_and_macs():
    params, macs = params_and_macs("focal")
    assert params / 1e6 == pytest.approx(2.44, rel=0.02)
    assert macs / 1e6 == pytest.approx(526.9, rel=0.02)


def test_official_key_layout():
    m = A.create("focal", 768, 12)
    assert m.valid_ind_rolled.numel() == 132  # 4 (49 - 16) surrounding slots
    assert m.relative_position_bias_table_to_neighbors.shape == (1, 12, 49, 132)
    assert m.relative_position_bias_table_to_windows[0].shape == (12, 81)


@pytest.mark.parametrize("hw", [(14, 14), (13, 17)])
def test_level_one_without_surroundings_is_window_attention(hw):
    torch.manual_seed(0)
    win = A.create("local_window", 48, 6).eval()
    m = A.create("focal", 48, 6, focal_level=1, expand_size=0).eval()
    m.load_state_dict(win.state_dict())  # qkv, proj, relative_position_bias_table
    x = torch.randn(2, hw[0] * hw[1], 48)
    torch.testing.assert_close(m(x, hw), win(x, hw), rtol=1e-5, atol=1e-5)


def _changes(m, hw, q, r, c):
    torch.manual_seed(1)
    x = torch.randn(1, hw[0] * hw[1], 48)
    y = x.clone()
    y[:, r * hw[1] + c] += 5.0
    return not torch.allclose(m(x, hw)[:, q], m(y, hw)[:, q], atol=1e-6)


def test_surroundings_reach_and_no_wrap_around():
    m = A.create("focal", 48, 6, focal_level=1).eval()  # window 7 + 3 tokens around, no pooled level
    hw = (14, 14)
    assert _changes(m, hw, 0, 8, 8) and _changes(m, hw, 0, 2, 9)  # within 3 of window (0, 0)
    assert not _changes(m, hw, 0, 10, 10) and not _changes(m, hw, 0, 2, 10)  # beyond
    assert not _changes(m, hw, 0, 13, 13) and not _changes(m, hw, 0, 12, 2)  # the far border: no wrap


def test_pooled_level_reach():
    m = A.create("focal", 48, 6).eval()
    hw = (35, 35)  # 5 x 5 windows
    assert _changes(m, hw, 0, 12, 12)  # window (1, 1): a pooled neighbour of window (0, 0)
    assert not _changes(m, hw, 0, 24, 24)  # window (3, 3): outside the 3 x 3 pooled neighbourhood


def test_prefix_rejected():
    with pytest.raises(ValueError, match="prefix"):
        A.create("focal", 48, 6)(torch.randn(1, 1 + 196, 48), (14, 14))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_backward(dtype):
    check_forward_backward("focal", dtype)
