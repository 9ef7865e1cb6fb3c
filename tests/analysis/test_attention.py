"""Attention maps and rollout: against timm's attention with the same weights (ViT / DeiT and Swin's windows),
against a literal re-statement of the rollout code, and the properties the issue names (rollout of identity
attention is the identity; every attention row sums to 1)."""

from __future__ import annotations

import pytest
import torch

import vitlab
from tests.conftest import smoke_model, timm_pair
from vitlab.analysis.attention import (
    analyze_attention,
    attention_maps,
    attention_rollout,
    capture_attention,
    rollout_map,
)
from vitlab.attention import stitch_windows, window_positions

timm = pytest.importorskip("timm")


def _timm_attention(ref, attn_modules) -> list[torch.Tensor]:
    """timm's softmax weights of each module: its explicit path (fused_attn off), read at ``attn_drop``."""
    seen = []
    for m in attn_modules:
        m.fused_attn = False
        m.attn_drop.register_forward_hook(lambda mod, inp, out: seen.append(inp[0].detach()))
    return seen


def test_vit_maps_equal_timm(tmp_path):
    kw = dict(img_size=64, depth=2)  # a 4x4 grid; class + distillation tokens
    ref, ours = timm_pair("deit_tiny_distilled_patch16_224", tmp_path, **kw)
    seen = _timm_attention(ref, [b.attn for b in ref.blocks])
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        ref(x)
    layers = capture_attention(ours, x)
    assert len(layers) == len(seen) == 2
    for lay, t in zip(layers, seen):
        assert lay.num_prefix == 2 and lay.q_grid == (4, 4)
        torch.testing.assert_close(lay.attn, t, atol=1e-5, rtol=1e-4)
    # the maps are the class token's / distillation token's rows over the 16 patch keys
    torch.testing.assert_close(attention_maps(layers[1], "cls"), seen[1][:, :, 0, 2:].reshape(2, 3, 4, 4))
    torch.testing.assert_close(attention_maps(layers[1], "dist"), seen[1][:, :, 1, 2:].reshape(2, 3, 4, 4))
    torch.testing.assert_close(attention_maps(layers[1], (1, 2)), seen[1][:, :, 2 + 6, 2:].reshape(2, 3, 4, 4))


def test_swin_windows_equal_timm_stitched(tmp_path):
    # stage 1: 8x8 grid, four 4x4 windows, shifted in block 1; stage 2: 4x4 grid, one window, no shift
    ref, ours = timm_pair("swin_tiny_patch4_window7_224", tmp_path, img_size=32, window_size=4, depths=(2, 2),
                          num_heads=(3, 6), embed_dim=48)
    blocks = [b for stage in ref.layers for b in stage.blocks]
    seen = _timm_attention(ref, [b.attn for b in blocks])
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ref(x)
    layers = capture_attention(ours, x)
    assert [lay.kind for lay in layers] == ["window"] * 4
    for lay, blk, t in zip(layers, blocks, seen):
        H, W = lay.q_grid
        window, shift = tuple(blk.window_size), tuple(blk.shift_size)
        nW = (H // window[0]) * (W // window[1])
        L, heads = window[0] * window[1], t.shape[1]
        # timm: (B * nW, heads, L, L), batch outer -> our layout (B, nW * heads, L, L)
        dense = stitch_windows(t.reshape(2, nW * heads, L, L), window_positions(H, W, window, shift), heads, H * W)
        torch.testing.assert_close(lay.attn, dense, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(lay.attn.sum(-1), torch.ones(lay.attn.shape[:-1]), atol=1e-5, rtol=0)
    # stage 1, block 1 (shifted): a query attends only inside its own (rolled) window
    lay = layers[1]
    support = lay.attn[0, 0, 0].reshape(8, 8) > 0
    assert support.sum() <= 16 and support[0, 0]


def test_cait_class_attention_equals_timm(tmp_path):
    ref, ours = timm_pair("cait_xxs24_224", tmp_path, img_size=64, depth=1)
    seen = _timm_attention(ref, [b.attn for b in ref.blocks_token_only])
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        ref(x)
    layers = capture_attention(ours, x)[1:]  # [0]: the talking-heads block (its own test below)
    assert [lay.kind for lay in layers] == ["class_attention"] * 2
    for lay, t in zip(layers, seen):
        torch.testing.assert_close(lay.attn, t, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(attention_maps(lay, "cls"), t[:, :, 0, 1:].reshape(2, 4, 4, 4))
    with pytest.raises(ValueError, match="only query is the class token"):
        attention_maps(layers[0], (1, 1))


def test_cait_talking_heads_maps_are_timms_post_mix_weights(tmp_path):
    """The map after the post-softmax head mix (timm's weights at ``attn_drop``), which times V and the projection
    gives the block's attention output; its rows sum to sum_h W_w[g, h] + N b_w[g], not 1."""
    ref, ours = timm_pair("cait_xxs24_224", tmp_path, img_size=64, depth=2)
    seen = _timm_attention(ref, [b.attn for b in ref.blocks])
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        ref(x)
    blk = ours.blocks[1]
    seen_in = {}
    # while the weights are read the module's call returns (output, weights)
    blk.attn.register_forward_hook(lambda mod, i, o: seen_in.update(x=i[0], out=o[0]))
    layers = capture_attention(ours, x)
    assert [lay.kind for lay in layers] == ["talking_heads"] * 2 + ["class_attention"] * 2
    n = 16  # 4 x 4 patches, no class token in these blocks
    for lay, t, b in zip(layers, seen, ours.blocks):
        assert lay.attn.shape == (2, 4, n, n) and lay.num_prefix == 0 and lay.q_grid == (4, 4)
        torch.testing.assert_close(lay.attn, t, atol=1e-5, rtol=1e-4)
        rows = (b.attn.proj_w.weight.sum(1) + n * b.attn.proj_w.bias).detach()[None, :, None].expand(2, 4, n)
        torch.testing.assert_close(lay.attn.sum(-1), rows, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(lay.attn.sum(-1), torch.ones_like(rows), atol=1e-2)  # random-init mixing
    # the module's own output is (P V) through its projection
    u = seen_in["x"]
    v = blk.attn.qkv(u).view(2, n, 3, 4, -1)[:, :, 2].transpose(1, 2)  # (B, h, N, d)
    out = blk.attn.proj((layers[1].attn @ v).transpose(1, 2).reshape(2, n, -1))
    torch.testing.assert_close(out, seen_in["out"], atol=1e-5, rtol=1e-4)
    # with an identity post-softmax mix the rows are distributions again; no rollout over mixed maps
    with torch.no_grad():
        ours.blocks[0].attn.proj_w.weight.copy_(torch.eye(4))
        ours.blocks[0].attn.proj_w.bias.zero_()
    r = analyze_attention(ours, x, block=0)  # maps of the centre patch
    assert r["kind"] == "talking_heads" and r["rollout"] is None and r["maps"].shape == (2, 4, 4, 4)
    assert r["layers"][0]["row_sum_max_err"] < 1e-5 < r["layers"][1]["row_sum_max_err"]


def test_pvt_spatial_reduction_weights_are_what_sdpa_applies():
    model, x = smoke_model("pvt_tiny")
    m = model.stages[0].blocks[0].attn  # sr_ratio 8: 16x16 queries, 2x2 reduced keys
    seen = {}
    m.q.register_forward_hook(lambda mod, i, o: seen.setdefault("q", o))
    m.kv.register_forward_hook(lambda mod, i, o: seen.setdefault("kv", o))
    lay = capture_attention(model, x)[0]
    B, N, C = seen["q"].shape
    q = seen["q"].reshape(B, N, m.num_heads, -1).transpose(1, 2)
    k, v = seen["kv"].reshape(B, -1, 2, m.num_heads, C // m.num_heads).permute(2, 0, 3, 1, 4)
    torch.testing.assert_close(lay.attn @ v, torch.nn.functional.scaled_dot_product_attention(q, k, v),
                               atol=1e-5, rtol=1e-4)
    assert lay.q_grid == (16, 16) and lay.k_grid == (2, 2) and attention_maps(lay, (3, 4)).shape == (2, 1, 2, 2)
    torch.testing.assert_close(lay.attn.sum(-1), torch.ones(lay.attn.shape[:-1]), atol=1e-5, rtol=0)


def test_window_positions_cover_the_grid_once():
    pos = window_positions(7, 9, (4, 4), (2, 2))  # padded to 8 x 12, rolled
    real = pos[pos >= 0]
    assert sorted(real.tolist()) == list(range(63))
    assert pos.shape == (6, 16) and (pos < 0).sum() == 8 * 12 - 63


def _vit_explain_rollout(attentions, discard_ratio, head_fusion):
    """Gildenblat's vit-explain ``rollout`` (vit_rollout.py), restated line by line for batch 1."""
    result = torch.eye(attentions[0].size(-1))
    with torch.no_grad():
        for attention in attentions:
            if head_fusion == "mean":
                attention_heads_fused = attention.mean(axis=1)
            elif head_fusion == "max":
                attention_heads_fused = attention.max(axis=1)[0]
            elif head_fusion == "min":
                attention_heads_fused = attention.min(axis=1)[0]
            flat = attention_heads_fused.view(attention_heads_fused.size(0), -1)
            _, indices = flat.topk(int(flat.size(-1) * discard_ratio), -1, False)
            indices = indices[indices != 0]
            flat[0, indices] = 0
            identity = torch.eye(attention_heads_fused.size(-1))
            a = (attention_heads_fused + 1.0 * identity) / 2
            a = a / a.sum(dim=-1)
            result = torch.matmul(a, result)
    return result


def test_rollout_equals_vit_explain():
    """vit-explain divides by ``a.sum(dim=-1)`` broadcast over the last axis (column j by row j's sum); with
    mean fusion and no discarding every row of (A + I) / 2 sums to 1 already, and the literal code applies."""
    attns = [torch.rand(1, 4, 10, 10).softmax(-1) for _ in range(3)]
    ref = _vit_explain_rollout([a.clone() for a in attns], 0.0, "mean")
    torch.testing.assert_close(attention_rollout(attns, "mean", 0.0), ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("head_fusion", ["mean", "max", "min"])
@pytest.mark.parametrize("ratio", [0.0, 0.5, 0.9])
def test_rollout_row_normalised_restatement(head_fusion, ratio):
    """Abnar & Zuidema, Section 3: A' = 0.5 W + 0.5 I (rows renormalised after discarding), R = A'_L ... A'_1."""
    attns = [torch.rand(2, 3, 6, 6).softmax(-1) for _ in range(4)]
    fuse = {"mean": lambda a: a.mean(1), "max": lambda a: a.amax(1), "min": lambda a: a.amin(1)}[head_fusion]
    ref = torch.eye(6).repeat(2, 1, 1)
    for a in attns:
        f = fuse(a)
        for b in range(2):
            flat = f[b].flatten().clone()
            low = flat.argsort()[: int(36 * ratio)]
            low = low[low != 0]
            flat[low] = 0
            f[b] = flat.view(6, 6)
        a2 = 0.5 * f + 0.5 * torch.eye(6)
        ref = (a2 / a2.sum(-1, keepdim=True)) @ ref
    out = attention_rollout(attns, head_fusion, ratio)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out.sum(-1), torch.ones(2, 6), atol=1e-5, rtol=0)


@pytest.mark.parametrize("head_fusion", ["mean", "max", "min"])
def test_rollout_of_identity_attention_is_identity(head_fusion):
    eye = torch.eye(7).expand(2, 3, 7, 7)
    for ratio in (0.0, 0.8):
        torch.testing.assert_close(attention_rollout([eye] * 5, head_fusion, ratio), torch.eye(7).expand(2, 7, 7))


@pytest.mark.parametrize("name,kw", [
    ("deit_tiny_distilled_patch16_224", {}),
    ("vit_tiny_patch16_224", {"reg_tokens": 4}),
    ("halvit_tiny_patch16_224", {}),
    ("levit_128s", {}),
])
def test_every_attention_row_sums_to_one(name, kw):
    model, x = smoke_model(name, **kw)
    layers = capture_attention(model, x)
    assert layers
    for lay in layers:
        torch.testing.assert_close(lay.attn.sum(-1), torch.ones(lay.attn.shape[:-1]), atol=1e-5, rtol=0)
        assert (lay.attn >= 0).all()
    if kw.get("reg_tokens"):
        assert layers[0].num_prefix == 5  # class + 4 registers, all kept out of the patch maps
        assert attention_maps(layers[0]).shape[-2:] == layers[0].k_grid
    r = analyze_attention(model, x, discard_ratio=0.0)
    if r["rollout"] is not None:
        assert r["rollout"].flatten(1).amax(1).allclose(torch.ones(2))


def test_mobilevit_maps_average_the_pixel_positions():
    model, x = smoke_model("mobilevit_xxs")
    seen = []
    attn = model.stages[4][1].transformer[0].attn
    attn.register_forward_hook(lambda mod, i, o: seen.append(i[0]))  # (B * P, N, C) unfolded sequences
    lay = [lay for lay in capture_attention(model, x) if lay.name == "stages.4.1.transformer.0.attn"][0]
    P = seen[0].shape[0] // 2
    with torch.no_grad():
        _, per_position = type(attn).forward(attn, seen[0], return_attn=True)
    torch.testing.assert_close(lay.attn, per_position.reshape(2, P, *per_position.shape[1:]).mean(1))


def test_capture_leaves_the_model_unchanged():
    model, x = smoke_model("deit_tiny_patch16_224")
    model.eval()
    with torch.no_grad():
        before = model(x)
    capture_attention(model, x)
    assert "forward" not in vars(model.blocks[0].attn)  # the patch is gone
    with torch.no_grad():
        torch.testing.assert_close(model(x), before)


def test_rollout_map_uses_patch_columns():
    model, x = smoke_model("deit_tiny_distilled_patch16_224")
    layers = capture_attention(model, x)
    m = rollout_map(layers, "cls", discard_ratio=0.0)
    r = attention_rollout([lay.attn for lay in layers], "mean", 0.0)[:, 0, 2:]
    torch.testing.assert_close(m.flatten(1), r / r.amax(1, keepdim=True))


def test_bad_input_names_what_is_missing():
    litv2 = vitlab.create_model("litv2_s", img_size=32, depths=(1, 1, 1, 1), embed_dim=24)
    with pytest.raises(ValueError, match="no token-attention layer.*swin"):
        capture_attention(litv2, torch.randn(1, 3, 32, 32))
    model = vitlab.create_model("swin_tiny_patch4_window7_224", img_size=32, window_size=4, depths=(2, 2),
                                num_heads=(3, 6), embed_dim=48)
    x = torch.randn(1, 3, 32, 32)
    layers = capture_attention(model, x)
    with pytest.raises(ValueError, match="no cls token"):
        attention_maps(layers[0], "cls")
    with pytest.raises(ValueError, match="out of range"):
        analyze_attention(model, x, block=99)
