"""Offset-bias attention (LeViT, EfficientFormer): equal to timm's modules with the same weights (same state-dict
keys), attention weights on request, one clear error for another grid, folded biases."""

from __future__ import annotations

import pytest
import timm.models.efficientformer as timm_ef
import timm.models.levit as timm_levit
import torch
import torch.nn as nn

from vitlab.attention.offset_bias import (
    EfficientFormerAttention,
    LevitAttention,
    LevitAttentionDownsample,
    fold_offset_biases,
)


def _randomize(m: nn.Module) -> nn.Module:
    """Random weights, biases and BatchNorm statistics (zero-initialised tables would hide an index error)."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, t in m.state_dict().items():
            if t.is_floating_point():
                t.copy_(torch.rand(t.shape, generator=g) + 0.5 if name.endswith("running_var")
                        else torch.randn(t.shape, generator=g) * 0.5)
    return m.eval()


CASES = {
    "levit": (lambda: LevitAttention(32, 8, num_heads=4, attn_ratio=2.0, resolution=(7, 5)),
              lambda: timm_levit.Attention(32, 8, num_heads=4, attn_ratio=2.0, resolution=(7, 5),
                                           act_layer=nn.Hardswish), (7, 5)),
    "levit_downsample": (lambda: LevitAttentionDownsample(32, 48, 8, num_heads=4, resolution=(7, 5)),
                         lambda: timm_levit.AttentionDownsample(32, 48, 8, num_heads=4, attn_ratio=4.0,
                                                                resolution=(7, 5), act_layer=nn.Hardswish), (7, 5)),
    "efficientformer": (lambda: EfficientFormerAttention(32, 8, num_heads=4, resolution=(7, 7)),
                        lambda: timm_ef.Attention(32, 8, num_heads=4, resolution=7), (7, 7)),
}


@pytest.mark.parametrize("name", CASES)
def test_equals_timm_with_the_same_state_dict(name):
    make, make_timm, (H, W) = CASES[name]
    ours, ref = _randomize(make()), make_timm()
    ref.load_state_dict(ours.state_dict(), strict=False)  # timm also stores its derived index buffer
    ref.eval()  # (timm's train() returns None)
    assert set(ours.state_dict()) <= set(ref.state_dict())
    x = torch.randn(2, H * W, 32)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(fold_offset_biases(ours)(x, (H, W)), ref(x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", CASES)
def test_return_attn_gives_the_weights_that_make_the_output(name):
    make, _, (H, W) = CASES[name]
    m = _randomize(make())
    x = torch.randn(2, H * W, 32)
    with torch.no_grad():
        out, attn = m(x, (H, W), return_attn=True)
        torch.testing.assert_close(out, m(x))
        nq = -(-H // m.stride) * -(-W // m.stride)
        assert attn.shape == (2, m.num_heads, nq, H * W)
        torch.testing.assert_close(attn.sum(-1), torch.ones(2, m.num_heads, nq))
        # the output is the projection of attn @ v, v read from the module's own value projection
        proj = m.kv(x) if hasattr(m, "kv") else m.qkv(x)
        v = proj.view(2, H * W, m.num_heads, -1)[..., -m.val_dim:].transpose(1, 2)
        o = (attn @ v).transpose(1, 2).reshape(2, nq, m.val_attn_dim)
    torch.testing.assert_close(m.proj(o), out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", CASES)
def test_another_grid_is_one_clear_error(name):
    make, _, (H, W) = CASES[name]
    m = make()
    with pytest.raises(ValueError, match=f"built for a {H}x{W} grid"):
        m(torch.randn(1, (H + 1) * W, 32), (H + 1, W))
    with pytest.raises(ValueError, match=f"built for a {H}x{W} grid"):
        m(torch.randn(1, H * W + 1, 32))


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_low_precision_tracks_fp32(name, dtype):
    make, _, (H, W) = CASES[name]
    m = _randomize(make())
    x = torch.randn(2, H * W, 32)
    with torch.no_grad():
        ref = m(x)
        with torch.autocast("cpu", dtype=dtype):
            auto = m(x)
        cast = m.to(dtype)(x.to(dtype))
    for out in (auto, cast):
        assert torch.isfinite(out).all()
        assert float((out.float() - ref).norm() / ref.norm()) < (0.05 if dtype == torch.bfloat16 else 0.01)
