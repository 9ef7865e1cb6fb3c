"""The sequence pieces of vitlab.layers: 1-D RoPE (against the complex-number form of Meta's Llama 2 code, Touvron
et al., 2023), causal / padding masks through SDPA, QuickGELU, and the post-norm option of the Block."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vitlab.attention import Block, MultiHeadSelfAttention
from vitlab.layers import QuickGELU, RotaryEmbedding1D, apply_rope, attention_mask, causal_mask, get_act_layer


def _llama_precompute_freqs_cis(d, context_len, theta=10_000):
    i_s = torch.arange(0, d, 2)[: (d // 2)].double()
    theta_s = theta ** (-i_s / d)
    m = torch.arange(context_len)
    freqs = torch.outer(m, theta_s).double()
    return torch.polar(torch.ones_like(freqs), freqs)


def _llama_apply_rotary_embs(x, freqs_cis):  # x (B, N, heads, head_dim), as in Llama 2's code
    x_c = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(x_c * freqs_cis.unsqueeze(0).unsqueeze(2)).reshape(*x.shape)


def test_rope_1d_equals_llama_code():
    x = torch.randn(2, 7, 3, 16, dtype=torch.float64)  # (B, N, heads, head_dim)
    ref = _llama_apply_rotary_embs(x, _llama_precompute_freqs_cis(16, 7))
    cos, sin = RotaryEmbedding1D(16)(7, dtype=torch.float64)
    out = apply_rope(x.transpose(1, 2), (cos, sin)).transpose(1, 2)  # ours works on (B, heads, N, head_dim)
    torch.testing.assert_close(out, ref)


def test_rope_1d_score_depends_on_offset_only():
    cos, sin = RotaryEmbedding1D(8)(10, dtype=torch.float64)
    q, k = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    rq = apply_rope(q.expand(1, 1, 10, 8), (cos, sin))[0, 0]
    rk = apply_rope(k.expand(1, 1, 10, 8), (cos, sin))[0, 0]
    torch.testing.assert_close(rq[1] @ rk[4], rq[5] @ rk[8])
    assert not torch.allclose(rq[1] @ rk[4], rq[1] @ rk[5])


def test_causal_mask_equals_an_explicit_masked_softmax():
    q, k, v = torch.randn(3, 2, 4, 6, 8).unbind(0)
    scores = q @ k.transpose(-2, -1) / 8**0.5
    mask = torch.triu(torch.ones_like(scores), diagonal=1)  # ones above the diagonal -> -inf
    ref = scores.masked_fill(mask.bool(), -torch.inf).softmax(-1) @ v
    torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask(6, causal=True)), ref)
    torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v, is_causal=True), ref)
    assert attention_mask(6) is None and causal_mask(3).tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]


def test_msa_masks_fused_explicit_and_padding():
    torch.manual_seed(0)
    attn = MultiHeadSelfAttention(32, 4).eval()
    x = torch.randn(2, 7, 32)
    keep = torch.tensor([[1] * 7, [1] * 4 + [0] * 3], dtype=torch.bool)
    for mask, causal in ((None, True), (attention_mask(7, key_padding=keep), False),
                         (attention_mask(7, key_padding=keep), True)):
        fused = attn(x, attn_mask=mask, is_causal=causal)
        explicit, weights = attn(x, return_attn=True, attn_mask=mask, is_causal=causal)
        torch.testing.assert_close(fused, explicit, rtol=1e-5, atol=1e-5)
        if causal:
            assert weights.triu(1).abs().max() == 0  # no token sees a later one
        # padding: changing the padded tokens leaves the real tokens' outputs alone
        y = x.clone()
        y[1, 4:] = torch.randn(3, 32)
        if mask is not None:
            torch.testing.assert_close(attn(y, attn_mask=mask, is_causal=causal)[1, :4], fused[1, :4])
    # causal: a token's output does not depend on later tokens
    y = x.clone()
    y[:, 5:] += 1
    torch.testing.assert_close(attn(y, is_causal=True)[:, :5], attn(x, is_causal=True)[:, :5])


def test_block_post_norm_formula_and_default_pre_norm():
    torch.manual_seed(0)
    blk = Block(16, 2, post_norm=True).eval()
    x = torch.randn(2, 5, 16)
    h = blk.norm1(x + blk.attn(x))
    torch.testing.assert_close(blk(x), blk.norm2(h + blk.mlp(h)))
    pre = Block(16, 2).eval()
    pre.load_state_dict(blk.state_dict())
    h = x + pre.attn(pre.norm1(x))
    torch.testing.assert_close(pre(x), h + pre.mlp(pre.norm2(h)))
    h = x + pre.attn(pre.norm1(x), is_causal=True)  # masks reach the attention through the block
    torch.testing.assert_close(pre(x, is_causal=True), h + pre.mlp(pre.norm2(h)))


def test_quick_gelu():
    x = torch.linspace(-4, 4, 50)
    torch.testing.assert_close(QuickGELU()(x), x * torch.sigmoid(1.702 * x))
    assert isinstance(get_act_layer("quick_gelu")(), QuickGELU)


def test_complex_rope_equals_the_real_form_and_the_article():
    from vitlab.layers import apply_rotary_embs, precompute_freqs_cis, rope_rotate

    freqs_cis = precompute_freqs_cis(16, 20)
    assert freqs_cis.shape == (20, 8) and freqs_cis.dtype == torch.complex64
    torch.testing.assert_close(freqs_cis.to(torch.complex128), _llama_precompute_freqs_cis(16, 20), atol=1e-6, rtol=0)
    x = torch.randn(2, 20, 3, 16)  # (B, N, heads, head_dim), the article's layout
    out = apply_rotary_embs(x, freqs_cis)
    torch.testing.assert_close(out.double(), _llama_apply_rotary_embs(x.double(), freqs_cis.to(torch.complex128)))
    cos, sin = RotaryEmbedding1D(16)(20)
    real = rope_rotate(x.transpose(1, 2), cos, sin).transpose(1, 2)
    torch.testing.assert_close(out, real)
    # per-sequence positions (left padding): tables gathered per row broadcast over the heads
    pos = torch.tensor([[0, 1, 2, 3], [0, 0, 0, 1]])
    rot = rope_rotate(x[:, :4].transpose(1, 2), cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)).transpose(1, 2)
    torch.testing.assert_close(rot[1, 3], apply_rotary_embs(x[1:2, 3:4], freqs_cis[1:2])[0, 0])
    torch.testing.assert_close(rot[0], out[0, :4])
