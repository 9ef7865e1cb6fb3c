"""Properties of the building blocks in vitlab.layers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vitlab.layers import (
    AttentionPool,
    ConvStemEmbed,
    DropPath,
    LayerScale,
    LinearPatchEmbed,
    PatchEmbed,
    RMSNorm,
    RotaryEmbedding2D,
    SwiGLU,
    apply_rope,
    conv_to_linear_patch_weight,
    drop_path_schedule,
    get_embed_layer,
    pool_tokens,
    resample_abs_pos_embed,
    rope_frequencies,
    sincos_2d_pos_embed,
    swiglu_hidden_dim,
)


def test_conv_and_linear_patch_embed_equal_with_shared_weights():
    conv = PatchEmbed(img_size=(32, 48), patch_size=8, in_chans=3, embed_dim=24)
    lin = LinearPatchEmbed(img_size=(32, 48), patch_size=8, in_chans=3, embed_dim=24)
    with torch.no_grad():
        lin.proj.weight.copy_(conv_to_linear_patch_weight(conv.proj.weight))
        lin.proj.bias.copy_(conv.proj.bias)
    x = torch.randn(2, 3, 32, 48)
    assert conv(x).shape == (2, 4 * 6, 24)
    torch.testing.assert_close(lin(x), conv(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("flatten", [True, False])
def test_patch_embed_equals_timm(flatten):
    """The plain strided convolution, as timm's PatchEmbed, with the same weights (the GEMM form is a rewrite
    of vitlab.optimize, tested there)."""
    from timm.layers import PatchEmbed as TimmPatchEmbed

    torch.manual_seed(0)
    pe = PatchEmbed(img_size=(32, 48), patch_size=(8, 4), in_chans=5, embed_dim=24, flatten=flatten)
    ref = TimmPatchEmbed(img_size=(32, 48), patch_size=(8, 4), in_chans=5, embed_dim=24, flatten=flatten,
                         output_fmt=None if flatten else "NHWC")
    ref.load_state_dict(pe.state_dict())
    x = torch.randn(2, 5, 32, 48)
    assert type(pe.proj) is torch.nn.Conv2d
    torch.testing.assert_close(pe(x), ref(x))
    assert _aten_ops(pe, x) == _aten_ops(ref, x)  # the same work: no extra copy, the same convolution kernel


def _aten_ops(module, x) -> list[tuple[str, str]]:
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        module(x)
    return sorted((e.name, str(e.input_shapes)) for e in prof.events() if e.name.startswith("aten::"))


def test_patch_embed_errors_and_dynamic_pad():
    with pytest.raises(ValueError, match="not divisible by the patch size"):
        PatchEmbed(img_size=30, patch_size=16)
    pe = PatchEmbed(img_size=32, patch_size=16, in_chans=3, embed_dim=8)
    with pytest.raises(ValueError, match="expected 3 input channels, got 1"):
        pe(torch.randn(1, 1, 32, 32))
    with pytest.raises(ValueError, match="does not match"):
        pe(torch.randn(1, 3, 48, 32))
    with pytest.raises(ValueError, match=r"\(B, C, H, W\)"):
        pe(torch.randn(3, 32, 32))
    padded = PatchEmbed(img_size=30, patch_size=16, embed_dim=8, dynamic_img_pad=True, strict_img_size=False)
    assert padded.grid_size == (2, 2) and padded(torch.randn(1, 3, 30, 20)).shape == (1, 4, 8)


@pytest.mark.parametrize("patch", [2, 4, 16])
def test_conv_stem_gives_the_patch_grid_and_shifts_with_the_image(patch):
    """Xiao et al.'s stem: the patch embedding's token grid, widths doubling to embed_dim; moved by one patch, the
    image moves its tokens by one (away from the zero-padded borders)."""
    stem = ConvStemEmbed(img_size=(8 * patch, 6 * patch), patch_size=patch, in_chans=3, embed_dim=32).eval()
    convs = [m for m in stem.stem if isinstance(m, torch.nn.Conv2d)]
    assert len(convs) == patch.bit_length() - 1 and convs[-1].out_channels == 32
    assert [c.stride for c in convs] == [(2, 2)] * len(convs)
    assert stem.grid_size == PatchEmbed(img_size=(8 * patch, 6 * patch), patch_size=patch).grid_size == (8, 6)
    x = torch.randn(1, 3, 8 * patch, 6 * patch)
    out = stem(x)
    assert out.shape == (1, 48, 32)
    moved = torch.zeros_like(x)
    moved[..., patch:, :] = x[..., :-patch, :]  # one patch down
    grid, grid_moved = out.reshape(8, 6, 32), stem(moved).reshape(8, 6, 32)
    torch.testing.assert_close(grid_moved[3:6, 2:4], grid[2:5, 2:4], rtol=1e-4, atol=1e-5)


def test_conv_stem_errors_and_names():
    with pytest.raises(ValueError, match="power-of-two patch size"):
        ConvStemEmbed(img_size=48, patch_size=12)
    with pytest.raises(ValueError, match="divisible by 8"):
        ConvStemEmbed(img_size=64, patch_size=16, embed_dim=36)
    assert get_embed_layer("conv_stem") is ConvStemEmbed and get_embed_layer(PatchEmbed) is PatchEmbed
    with pytest.raises(ValueError, match="unknown embed_layer 'stem'"):
        get_embed_layer("stem")


def test_resample_pos_embed_identity_and_non_square():
    pos = torch.randn(1, 1 + 7 * 7, 16)
    torch.testing.assert_close(resample_abs_pos_embed(pos, (7, 7)), pos)
    out = resample_abs_pos_embed(pos, (5, 9))
    assert out.shape == (1, 1 + 45, 16)
    torch.testing.assert_close(out[:, :1], pos[:, :1])  # the class-token embedding is kept as is
    # bicubic interpolation onto the same grid reproduces every value (not just the shortcut)
    grid = pos[:, 1:].reshape(1, 7, 7, 16).permute(0, 3, 1, 2)
    torch.testing.assert_close(F.interpolate(grid, size=(7, 7), mode="bicubic", antialias=True), grid)
    with pytest.raises(ValueError, match="old_size"):
        resample_abs_pos_embed(torch.randn(1, 1 + 12, 4), (4, 4))


def test_sincos_pos_embed():
    emb = sincos_2d_pos_embed((3, 5), 16)
    assert emb.shape == (15, 16)
    assert emb.abs().max() <= 1.0
    assert len({tuple(r.tolist()) for r in emb}) == 15  # every position distinct
    with pytest.raises(ValueError):
        sincos_2d_pos_embed((3, 3), 10)


def _rope_complex(x, angles):
    """RoFormer's complex form (Su et al., 2021, Sec. 3.4.2): pairs as complex numbers, times e^{i m theta}."""
    xc = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * torch.polar(torch.ones_like(angles), angles)).reshape(x.shape)


def test_rope_matches_the_complex_formula_and_keeps_norms():
    rope = RotaryEmbedding2D(16)
    cos, sin = rope((3, 4), dtype=torch.float64)
    x = torch.randn(2, 2, 12, 16, dtype=torch.float64)
    out = apply_rope(x, (cos, sin))
    ys, xs = torch.meshgrid(torch.arange(3), torch.arange(4), indexing="ij")
    angles = torch.cat([rope_frequencies(8, ys.flatten()), rope_frequencies(8, xs.flatten())], dim=1)
    torch.testing.assert_close(out, _rope_complex(x, angles))
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1))


def test_rope_dot_product_depends_only_on_relative_offset():
    rope = RotaryEmbedding2D(8)
    cos, sin = rope((6, 6), dtype=torch.float64)
    q, k = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    rq = apply_rope(q.expand(1, 1, 36, 8), (cos, sin))[0, 0]
    rk = apply_rope(k.expand(1, 1, 36, 8), (cos, sin))[0, 0]

    def idx(r, c):
        return r * 6 + c

    # the same (dy, dx) = (1, 2) offset at two places gives the same score; another offset does not
    a = rq[idx(0, 0)] @ rk[idx(1, 2)]
    b = rq[idx(3, 2)] @ rk[idx(4, 4)]
    c = rq[idx(0, 0)] @ rk[idx(2, 1)]
    torch.testing.assert_close(a, b)
    assert not torch.allclose(a, c)


def test_rope_leaves_prefix_tokens():
    cos, sin = RotaryEmbedding2D(8)((2, 2))
    x = torch.randn(1, 1, 5, 8)
    torch.testing.assert_close(apply_rope(x, (cos, sin))[..., :1, :], x[..., :1, :])


def test_swiglu_llama_hidden_rule():
    assert swiglu_hidden_dim(768) == 2048  # 2/3 * 3072 = 2048
    assert swiglu_hidden_dim(384, multiple_of=256) == 1024
    m = SwiGLU(32, 48)
    x = torch.randn(2, 3, 32)
    w1, w2 = m.fc1.weight[:48], m.fc1.weight[48:]
    b1, b2 = m.fc1.bias[:48], m.fc1.bias[48:]
    ref = m.fc2(F.silu(x @ w1.T + b1) * (x @ w2.T + b2))
    torch.testing.assert_close(m(x), ref)


def test_rmsnorm_formula():
    x = torch.randn(4, 10)
    n = RMSNorm(10)
    with torch.no_grad():
        n.weight.uniform_()
    ref = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * n.weight
    torch.testing.assert_close(n(x), ref)


def test_drop_path_row_mode():
    dp = DropPath(0.5)
    x = torch.ones(1000, 4, 3)
    dp.eval()
    assert torch.equal(dp(x), x)
    dp.train()
    y = dp(x)
    per_row = y.flatten(1)
    assert set(per_row.unique().tolist()) <= {0.0, 2.0}
    assert (per_row == per_row[:, :1]).all()  # a whole row is kept or dropped
    assert abs(y.mean().item() - 1.0) < 0.15  # the expectation is preserved
    assert drop_path_schedule(0.1, 5) == pytest.approx([0.0, 0.025, 0.05, 0.075, 0.1])
    with pytest.raises(ValueError):
        DropPath(1.0)


def test_layer_scale():
    ls = LayerScale(4, 1e-5)
    torch.testing.assert_close(ls(torch.ones(2, 4)), torch.full((2, 4), 1e-5))


def test_pooling():
    x = torch.randn(2, 1 + 4, 8)
    torch.testing.assert_close(pool_tokens(x, "token", 1), x[:, 0])
    torch.testing.assert_close(pool_tokens(x, "avg", 1), x[:, 1:].mean(1))
    torch.testing.assert_close(pool_tokens(x, "max", 1), x[:, 1:].max(1).values)
    ap = AttentionPool(8)
    with torch.no_grad():
        ap.attention.weight.zero_()
        ap.attention.bias.zero_()
    torch.testing.assert_close(pool_tokens(x, "attn", 1, ap), x[:, 1:].mean(1))  # uniform scores = mean


def test_checkpoint_seq_same_outputs_and_gradients():
    """checkpoint_seq recomputes in the backward pass: outputs and gradients equal the plain loop; extra args
    reach every block; without autograd (or disabled) it is the plain loop."""
    from vitlab.layers import checkpoint_seq

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x, scale):
            return torch.tanh(self.lin(x)) * scale

    torch.manual_seed(0)
    blocks = torch.nn.ModuleList([Scaled() for _ in range(3)])
    x = torch.randn(4, 8, requires_grad=True)
    results = []
    for enabled in (False, True):
        blocks.zero_grad()
        x.grad = None
        y = checkpoint_seq(blocks, x, 0.5, enabled=enabled)
        y.square().sum().backward()
        results.append((y.detach(), x.grad.clone(), [p.grad.clone() for p in blocks.parameters()]))
    (y0, gx0, gp0), (y1, gx1, gp1) = results
    assert torch.equal(y0, y1) and torch.equal(gx0, gx1)
    assert all(torch.equal(a, b) for a, b in zip(gp0, gp1, strict=True))
    with torch.no_grad():
        assert torch.equal(checkpoint_seq(blocks, x, 0.5, enabled=True), y0)
