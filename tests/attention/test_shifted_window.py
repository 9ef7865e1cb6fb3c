"""shifted_window (Swin SW-MSA): Table IV cost, the shift mask stops attention across the regions the roll
glued together (perturbation test), exact on grids the window does not divide, dtypes."""

from __future__ import annotations

import pytest
import torch

import vitlab.attention as A

from .test_msa_naive import check_forward_backward, masked_msa, params_and_macs


def test_table_iv_params_and_macs():
    params, macs = params_and_macs("shifted_window")
    assert params / 1e6 == pytest.approx(2.36, rel=0.02)
    assert macs / 1e6 == pytest.approx(477.2, rel=0.02)


def _out_at(m, x, hw, idx):
    return m(x, hw)[:, idx]


def test_mask_stops_attention_across_regions():
    torch.manual_seed(0)
    H = W = 14
    m = A.create("shifted_window", 48, 6).eval()  # ws 7, shift 3
    x = torch.randn(1, H * W, 48)
    q = 0  # token (0, 0): rolled to (11, 11), in the last window together with tokens of the far corner
    base = _out_at(m, x, (H, W), q)

    def changed(r, c):
        y = x.clone()
        y[:, r * W + c] += 5.0
        return not torch.allclose(_out_at(m, y, (H, W), q), base, atol=1e-6)

    assert changed(1, 1) and changed(2, 0)  # same window, same region (wrapped rows / columns 0..2)
    assert not changed(13, 13)  # same rolled window, other region: masked
    assert not changed(13, 0) and not changed(0, 13)  # same window, other region along one axis
    assert not changed(5, 5)  # another window


def _definition_mask(H, W, ws, s):
    """Allowed (query, key) pairs of SW-MSA, from the definition: same window after the roll, same region."""
    Hp, Wp = -(-H // ws) * ws, -(-W // ws) * ws
    r, c = torch.arange(H).repeat_interleave(W), torch.arange(W).repeat(H)
    rr, cc = (r - s) % Hp, (c - s) % Wp  # position in the rolled, padded map

    def region(p, size):
        return (p >= size - ws).long() + (p >= size - s).long()

    key = (rr // ws) * 1000 + (cc // ws) * 100 + region(rr, Hp) * 10 + region(cc, Wp)
    return key[:, None] == key[None]


@pytest.mark.parametrize("hw", [(14, 14), (13, 17)])
def test_equals_definition(hw):
    torch.manual_seed(0)
    msa = A.create("msa", 48, 6).eval()
    m = A.create("shifted_window", 48, 6, rel_pos_bias=False).eval()
    m.load_state_dict(msa.state_dict())
    x = torch.randn(2, hw[0] * hw[1], 48)
    ref = masked_msa(msa, x, _definition_mask(*hw, 7, 3))
    torch.testing.assert_close(m(x, hw), ref, rtol=1e-5, atol=1e-5)


def test_small_map_is_one_unshifted_window_equal_to_msa():
    torch.manual_seed(0)
    msa = A.create("msa", 48, 6).eval()
    m = A.create("shifted_window", 48, 6, rel_pos_bias=False).eval()
    m.load_state_dict(msa.state_dict())
    x = torch.randn(2, 6 * 7, 48)
    torch.testing.assert_close(m(x, (6, 7)), msa(x, (6, 7)), rtol=1e-5, atol=1e-5)


def test_prefix_rejected():
    with pytest.raises(ValueError, match="prefix"):
        A.create("shifted_window", 48, 6)(torch.randn(1, 1 + 196, 48), (14, 14))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rpb", [True, False])
def test_forward_backward(dtype, rpb):
    check_forward_backward("shifted_window", dtype, rel_pos_bias=rpb)
