"""cross_window (CSWin): Table IV cost, the definition (stripes + per-stripe LePE) on any grid, dtypes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import vitlab.attention as A

from .test_msa_naive import check_forward_backward, params_and_macs


def test_table_iv_params_and_macs():
    params, macs = params_and_macs("cross_window")
    assert params / 1e6 == pytest.approx(2.37, rel=0.02)
    assert macs / 1e6 == pytest.approx(493.3, rel=0.02)


def _reference(m, x, H, W):
    """Loop over the (possibly cropped) stripes: explicit attention + LePE on each stripe's own values."""
    B, N, C = x.shape
    half, heads, d = C // 2, m.num_heads // 2, m.head_dim
    sp = m.split_size
    qkv = m.qkv(x).reshape(B, H, W, 3, C)
    outs = []
    for i, (wh, ww) in enumerate([(H, sp), (sp, W)]):
        t = qkv[..., i * half:(i + 1) * half]
        o = torch.zeros(B, H, W, half)
        for r in range(0, H, wh):
            for c in range(0, W, ww):
                s = t[:, r:r + wh, c:c + ww]  # (B, h_, w_, 3, half)
                h_, w_ = s.shape[1:3]
                q, k, v = s.reshape(B, h_ * w_, 3, heads, d).permute(2, 0, 3, 1, 4)
                a = ((q @ k.transpose(-1, -2)) * d**-0.5).softmax(-1) @ v  # (B, heads, L, d)
                a = a.transpose(1, 2).reshape(B, h_, w_, half)
                conv = m.attns[i].get_v
                vs = s[..., 2, :].permute(0, 3, 1, 2)  # this stripe's values only: (B, half, h_, w_)
                pe = F.conv2d(vs, conv.weight, conv.bias, padding=1, groups=half)
                o[:, r:r + h_, c:c + w_] = a + pe.permute(0, 2, 3, 1)
        outs.append(o)
    return m.proj(torch.cat(outs, -1).reshape(B, N, C))


@pytest.mark.parametrize("hw", [(14, 14), (13, 17)])
def test_matches_definition(hw):
    torch.manual_seed(0)
    m = A.create("cross_window", 48, 6).eval()
    x = torch.randn(2, hw[0] * hw[1], 48)
    torch.testing.assert_close(m(x, hw), _reference(m, x, *hw), rtol=1e-5, atol=1e-5)


def test_prefix_rejected_and_odd_heads():
    with pytest.raises(ValueError, match="prefix"):
        A.create("cross_window", 48, 6)(torch.randn(1, 1 + 196, 48), (14, 14))
    with pytest.raises(ValueError, match="odd"):
        A.create("cross_window", 48, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_backward(dtype):
    check_forward_backward("cross_window", dtype)
