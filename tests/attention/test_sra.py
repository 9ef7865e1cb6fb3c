"""sra (PVT spatial-reduction attention): Table IV cost, the definition on any grid, prefix tokens, dtypes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import vitlab.attention as A

from .test_msa_naive import check_forward_backward, params_and_macs


def test_table_iv_params_and_macs():
    params, macs = params_and_macs("sra")
    assert params / 1e6 == pytest.approx(4.72, rel=0.02)
    assert macs / 1e6 == pytest.approx(419.6, rel=0.02)


def _reference(m, x, H, W, n_prefix=0):
    B, N, C = x.shape
    h, d = m.num_heads, C // m.num_heads
    R = m.sr_ratio
    g = x[:, n_prefix:].reshape(B, H, W, C).permute(0, 3, 1, 2)
    g = F.pad(g, (0, -W % R, 0, -H % R))
    red = F.layer_norm(F.conv2d(g, m.sr.weight, m.sr.bias, stride=R).flatten(2).transpose(1, 2), (C,),
                       m.norm.weight, m.norm.bias)
    kv_in = torch.cat([x[:, :n_prefix], red], 1)
    q = m.q(x).reshape(B, N, h, d).transpose(1, 2)
    k, v = m.kv(kv_in).reshape(B, -1, 2, h, d).permute(2, 0, 3, 1, 4)
    a = (q @ k.transpose(-1, -2) * d**-0.5).softmax(-1)
    return m.proj((a @ v).transpose(1, 2).reshape(B, N, C))


@pytest.mark.parametrize("hw,n_prefix", [((14, 14), 0), ((13, 17), 0), ((13, 17), 1)])
def test_matches_definition(hw, n_prefix):
    torch.manual_seed(0)
    m = A.create("sra", 48, 6).eval()
    x = torch.randn(2, n_prefix + hw[0] * hw[1], 48)
    torch.testing.assert_close(m(x, hw), _reference(m, x, *hw, n_prefix), rtol=1e-5, atol=1e-5)


def test_ratio_one_equals_msa():
    torch.manual_seed(0)
    msa = A.create("msa", 48, 6).eval()
    m = A.create("sra", 48, 6, sr_ratio=1).eval()
    with torch.no_grad():
        m.q.weight.copy_(msa.qkv.weight[:48])
        m.q.bias.copy_(msa.qkv.bias[:48])
        m.kv.weight.copy_(msa.qkv.weight[48:])
        m.kv.bias.copy_(msa.qkv.bias[48:])
        m.proj.load_state_dict(msa.proj.state_dict())
    x = torch.randn(2, 1 + 35, 48)
    torch.testing.assert_close(m(x, (5, 7)), msa(x, (5, 7)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_backward(dtype):
    check_forward_backward("sra", dtype)
