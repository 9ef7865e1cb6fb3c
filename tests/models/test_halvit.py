"""HaLViT ("Half of the Weights are Enough", supplementary material): one matrix used as W and W^T, exactly as
the authors' code computes it."""

from __future__ import annotations

import pytest
import torch
from einops import rearrange

import vitlab
from vitlab.models.halvit import HaLViTAttention, HaLViTFeedForward


def _seed_attention(m: HaLViTAttention, x):
    """A literal transcription of the authors' Attention.forward (explicit softmax)."""
    x = m.inpnorm(x)
    q, k, v = torch.tensor_split(torch.matmul(x, torch.cat([m.q, m.kv, m.kv.t()], 1)),
                                 (m.inner_dim, 2 * m.inner_dim), dim=-1)
    q, k = m.qnorm(q), m.knorm(k)
    q, k, v = (rearrange(t, "b n (h d) -> b h n d", h=m.heads) for t in (q, k, v))
    attn = (torch.matmul(q, k.transpose(-1, -2)) * m.dim_head**-0.5).softmax(dim=-1)
    out = rearrange(torch.matmul(attn, v), "b h n d -> b n (h d)")
    return torch.matmul(out, m.q.t()) + m.bias


def _seed_ff(m: HaLViTFeedForward, x):
    x = m.ln1(x)
    x = m.act(torch.matmul(x, m.w) + m.b1)
    return torch.matmul(x, m.w.t()) + m.b2


def test_attention_and_ff_equal_the_seed_code():
    attn, ff = HaLViTAttention(64, 4, 16), HaLViTFeedForward(64, 256)
    x = torch.randn(2, 10, 64)
    torch.testing.assert_close(attn(x), _seed_attention(attn, x), rtol=1e-5, atol=1e-5)
    out, weights = attn(x, return_attn=True)
    torch.testing.assert_close(out, _seed_attention(attn, x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ff(x), _seed_ff(ff, x))


def test_each_shared_matrix_is_one_parameter_used_twice():
    model = vitlab.create_model("halvit_tiny_patch16_224", img_size=32)
    keys = [k for k in model.state_dict() if k.startswith("blocks.0.")]
    assert {"blocks.0.attn.q", "blocks.0.attn.kv", "blocks.0.ff.w"} <= set(keys)
    assert not any("proj" in k or "fc2" in k or k.endswith(".v") for k in keys)
    assert model.blocks[0].attn.q.shape == (384, 384) and model.blocks[0].ff.w.shape == (384, 1536)


def test_gradient_of_a_shared_matrix_sums_both_uses():
    ff = HaLViTFeedForward(16, 32)
    x = torch.randn(3, 5, 16)
    ff(x).sum().backward()
    shared = ff.w.grad.clone()
    # the same function with two independent copies of W: the shared gradient is the sum of theirs
    w_in, w_out = ff.w.detach().clone().requires_grad_(), ff.w.detach().clone().requires_grad_()
    h = ff.act(torch.matmul(ff.ln1(x), w_in) + ff.b1)
    (torch.matmul(h, w_out.t()) + ff.b2).sum().backward()
    torch.testing.assert_close(shared, w_in.grad + w_out.grad)


def test_seed_initialisation_bounds():
    ff = HaLViTFeedForward(64, 256)
    assert ff.b1.abs().max() <= 1 / 256**0.5 and ff.b2.abs().max() <= 1 / 64**0.5
    bound_w = (2**0.5) * (3 / 256) ** 0.5  # kaiming_uniform: gain sqrt(2), fan_in = size(1) = 256
    assert ff.w.abs().max() <= bound_w and ff.w.abs().max() > 0.9 * bound_w


def test_dim_must_equal_heads_times_dim_head():
    with pytest.raises(ValueError, match="dim == heads \\* dim_head"):
        vitlab.create_model("halvit_tiny_patch16_224", dim_head=32)


@pytest.mark.parametrize("name, half_of, published", [
    ("halvit_tiny_patch16_224", "deit_small_patch16_224", 11.1),
    ("halvit_base_patch16_224", "vit_base_patch16_224", 43.0),
])
def test_about_half_the_weights(name, half_of, published):
    ours, full = vitlab.profile_model(name), vitlab.profile_model(half_of)
    assert 0.49 < ours.params_m / full.params_m < 0.53
    # the published figure is rounded and leaves the 1000-class head's share open: within 4%
    assert ours.params_m == pytest.approx(published, rel=0.04)
    assert ours.gmacs == pytest.approx(full.gmacs, rel=0.01)  # same compute as the model it halves


def test_mean_pool_and_distillation_token():
    model = vitlab.create_model("halvit_tiny_distilled_patch16_224", img_size=32, num_classes=3)
    model.train()
    a, b = model(torch.randn(2, 3, 32, 32))
    assert a.shape == b.shape == (2, 3) and model.pos_embed.shape[1] == 4 + 2
    model = vitlab.create_model("halvit_tiny_patch16_224", img_size=32, global_pool="avg")
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, 1000)
    with pytest.raises(ValueError, match="HaLViT pools"):
        vitlab.create_model("halvit_tiny_patch16_224", global_pool="max")


def test_stochastic_depth_linear_schedule():
    model = vitlab.create_model("halvit_tiny_patch16_224", img_size=32, drop_path_rate=0.1)
    rates = [blk.drop_path.p for blk in model.blocks[1:]]
    assert rates[-1] == pytest.approx(0.1) and rates == sorted(rates)
