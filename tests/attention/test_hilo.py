"""HiLo: Table IV cost, the Section B closed form, reduction to MSA, any grid size, dtypes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import vitlab.attention as A
from vitlab.attention.hilo import hilo_flops

from .test_msa_naive import check_forward_backward, params_and_macs


def _macs(name, dim, heads, hw, **kw):
    params, macs = params_and_macs(name, dim, heads, hw, **kw)
    return macs, params


def test_defaults_split_heads_as_the_paper():
    m = A.create("hilo", 768, 12)
    assert (m.l_heads, m.h_heads, m.ws) == (10, 2, 2)


def test_table_iv_params_and_macs():
    macs, params = _macs("hilo", 768, 12, (14, 14))
    assert params / 1e6 == pytest.approx(2.20, rel=0.02)
    assert macs / 1e6 == pytest.approx(298.3, rel=0.02)


def test_section_b_closed_form_at_equal_split():
    # alpha = 1/2 is the case Section B writes out
    for N, D, s in [(196, 768, 2), (3136, 96, 7), (64, 32, 4)]:
        hifi = 7 / 4 * N * D**2 + s**2 * N * D
        lofi = (3 / 4 + 1 / s**2) * N * D**2 + N**2 * D / s**2
        assert hilo_flops(N, D, s, 0.5) == pytest.approx(hifi + lofi, rel=1e-12)
    # alpha = 1, s = 1 is MSA: 4 N D^2 + 2 N^2 D
    assert hilo_flops(196, 768, 1, 1.0) == pytest.approx(4 * 196 * 768**2 + 2 * 196**2 * 768)


@pytest.mark.parametrize("hw,dim,heads,s,alpha", [
    ((14, 14), 768, 12, 2, 10 / 12),  # Table IV
    ((8, 8), 64, 4, 2, 0.5),
    ((12, 12), 96, 6, 3, 4 / 6),
    ((16, 8), 128, 8, 4, 0.25),
    ((6, 6), 48, 4, 1, 1.0),
])
def test_counter_matches_closed_form(hw, dim, heads, s, alpha):
    macs, _ = _macs("hilo", dim, heads, hw, window_size=s, alpha=alpha)
    assert macs == pytest.approx(hilo_flops(hw[0] * hw[1], dim, s, alpha), rel=1e-9)


def test_pooled_queries_costs_less():
    base, p0 = _macs("hilo", 768, 12, (14, 14))
    pooled, p1 = _macs("hilo", 768, 12, (14, 14), pooled_queries=True)
    assert p0 == p1 and pooled < base


def test_alpha_one_window_one_equals_msa():
    torch.manual_seed(0)
    dim, heads = 64, 4
    msa = A.create("msa", dim, heads).eval()
    hilo = A.create("hilo", dim, heads, alpha=1.0, window_size=1).eval()
    assert hilo.h_heads == 0
    w, b = msa.qkv.weight, msa.qkv.bias  # rows: q | k | v
    with torch.no_grad():
        hilo.l_q.weight.copy_(w[:dim])
        hilo.l_q.bias.copy_(b[:dim])
        hilo.l_kv.weight.copy_(w[dim:])
        hilo.l_kv.bias.copy_(b[dim:])
        hilo.l_proj.load_state_dict(msa.proj.state_dict())
    x = torch.randn(2, 7 * 9, dim)
    torch.testing.assert_close(hilo(x, (7, 9)), msa(x, (7, 9)), rtol=1e-5, atol=1e-5)


def _reference_hilo(m, x, H, W):
    """Straight-from-the-definition HiLo on an (H, W) map (explicit per-window loops, explicit softmax)."""
    B, N, C = x.shape
    s, d = m.ws, m.head_dim
    xm = x.reshape(B, H, W, C)
    # Hi-Fi: loop over (possibly partial) s x s windows
    qkv = m.h_qkv(xm)
    hi = torch.zeros(B, H, W, m.h_dim)
    for i in range(0, H, s):
        for j in range(0, W, s):
            t = qkv[:, i:i + s, j:j + s].reshape(B, -1, 3, m.h_heads, d).permute(2, 0, 3, 1, 4)
            a = (t[0] @ t[1].transpose(-1, -2) * d**-0.5).softmax(-1) @ t[2]  # (B, h, L, d)
            hh, ww = min(s, H - i), min(s, W - j)
            hi[:, i:i + hh, j:j + ww] = a.transpose(1, 2).reshape(B, hh, ww, m.h_dim)
    hi = m.h_proj(hi)
    # Lo-Fi: keys / values from the means of the (possibly partial) windows
    cells = [xm[:, i:i + s, j:j + s].mean((1, 2)) for i in range(0, H, s) for j in range(0, W, s)]
    pooled = torch.stack(cells, 1)
    k, v = m.l_kv(pooled).reshape(B, -1, 2, m.l_heads, d).permute(2, 0, 3, 1, 4)
    q = m.l_q(x).reshape(B, N, m.l_heads, d).transpose(1, 2)
    lo = ((q @ k.transpose(-1, -2) * d**-0.5).softmax(-1) @ v).transpose(1, 2).reshape(B, H, W, m.l_dim)
    lo = m.l_proj(lo)
    return torch.cat([hi, lo], -1).reshape(B, N, C)


@pytest.mark.parametrize("hw", [(8, 8), (13, 17)])
def test_matches_definition_any_grid(hw):
    torch.manual_seed(0)
    m = A.create("hilo", 48, 6, alpha=0.5).eval()
    x = torch.randn(2, hw[0] * hw[1], 48)
    torch.testing.assert_close(m(x, hw), _reference_hilo(m, x, *hw), rtol=1e-5, atol=1e-5)


def test_pooled_queries_shape_and_definition():
    torch.manual_seed(0)
    m = A.create("hilo", 32, 4, alpha=1.0, pooled_queries=True).eval()  # Lo-Fi only
    x = torch.randn(1, 8 * 8, 32)
    p = F.avg_pool2d(x.reshape(1, 8, 8, 32).permute(0, 3, 1, 2), 2).flatten(2).transpose(1, 2)  # (1, 16, 32)
    q = m.l_q(p).reshape(1, 16, 4, 8).transpose(1, 2)
    k, v = m.l_kv(p).reshape(1, 16, 2, 4, 8).permute(2, 0, 3, 1, 4)
    o = m.l_proj(((q @ k.transpose(-1, -2) / 8**0.5).softmax(-1) @ v).transpose(1, 2).reshape(1, 16, 32))
    o = F.interpolate(o.transpose(1, 2).reshape(1, 32, 4, 4), size=(8, 8), mode="bilinear")
    torch.testing.assert_close(m(x, (8, 8)), o.flatten(2).transpose(1, 2), rtol=1e-5, atol=1e-5)


def test_prefix_tokens_rejected():
    m = A.create("hilo", 32, 4)
    with pytest.raises(ValueError, match="prefix"):
        m(torch.randn(1, 1 + 16, 32), (4, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pooled", [False, True])
def test_forward_backward(dtype, pooled):
    check_forward_backward("hilo", dtype, pooled_queries=pooled)


@pytest.mark.parametrize("hw", [(8, 8), (13, 17)])
def test_autocast_bf16_close_to_fp32(hw):
    torch.manual_seed(0)
    m = A.create("hilo", 64, 4, alpha=0.5).eval()
    x = torch.randn(2, hw[0] * hw[1], 64)
    with torch.no_grad():
        ref = m(x, hw)
        with torch.autocast("cpu", torch.bfloat16):
            out = m(x, hw)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("hw", [(8, 8), (13, 17)])
@pytest.mark.parametrize("kw", [dict(alpha=0.5), dict(alpha=0.5, pooled_queries=True), dict(window_size=1),
                                dict(alpha=0.0)], ids=["split", "pooled", "s1", "hifi"])
def test_attention_weights_give_the_output(hw, kw):
    """return_attn: (B, heads, N, N) rows summing to 1, and each head group's output is its projection of
    A @ v with the per-token values (Lo-Fi: pooling commutes with l_kv)."""
    torch.manual_seed(0)
    m = A.create("hilo", 48, 6, **kw).eval()
    B, (H, W) = 2, hw
    x = torch.randn(B, H * W, 48)
    with torch.no_grad():
        out, attn = m(x, hw, return_attn=True)
        torch.testing.assert_close(out, m(x, hw))
        assert attn.shape == (B, 6, H * W, H * W)
        torch.testing.assert_close(attn.sum(-1), torch.ones(B, 6, H * W))
        d, parts = m.head_dim, []
        if m.h_heads:
            v = m.h_qkv(x)[..., 2 * m.h_dim:].reshape(B, H * W, m.h_heads, d).transpose(1, 2)
            hi = (attn[:, :m.h_heads] @ v).transpose(1, 2).reshape(B, H * W, m.h_dim)
            parts.append(m.h_proj(hi))
        if m.l_heads:
            v = m.l_kv(x)[..., m.l_dim:].reshape(B, H * W, m.l_heads, d).transpose(1, 2)
            lo = (attn[:, m.h_heads:] @ v).transpose(1, 2).reshape(B, H * W, m.l_dim)
            parts.append(m.l_proj(lo))
    torch.testing.assert_close(torch.cat(parts, -1), out, rtol=1e-4, atol=1e-5)
    if m.h_heads:  # Hi-Fi: nothing outside the query's window
        rows, cols = torch.arange(H * W) // W, torch.arange(H * W) % W
        same = ((rows[:, None] // m.ws) == (rows // m.ws)) & ((cols[:, None] // m.ws) == (cols // m.ws))
        assert (attn[:, :m.h_heads][..., ~same] == 0).all()


def test_fullgraph_compile_in_inference():
    torch._dynamo.reset()
    m = A.create("hilo", 128, 4).eval()
    x = torch.randn(2, 13 * 17, 128)
    with torch.no_grad():
        out = torch.compile(m, fullgraph=True, backend="eager")(x, (13, 17))
        torch.testing.assert_close(out, m(x, (13, 17)), rtol=1e-5, atol=1e-5)
