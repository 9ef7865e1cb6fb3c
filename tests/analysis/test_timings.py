"""LeViT supplementary, Table 1 (Graham et al., 2021): each timed component computes the real piece of the block
(same weights, same numbers), the table has the paper's rows, and (slow, timing) the components add up to the
whole block within 15%."""

from __future__ import annotations

import pytest
import torch

import vitlab
from vitlab.analysis import timings


def _deit_block():
    return vitlab.create_model("deit_tiny_patch16_224", act_layer="hardswish", depth=1).eval().blocks[0]


def _levit_block():
    return vitlab.create_model("levit_256", img_size=64, depth=(1, 1, 1)).eval().fuse().stages[0].blocks[0]


def test_vit_components_are_the_blocks_pieces():
    blk = _deit_block()
    assert isinstance(blk.mlp.act, torch.nn.Hardswish)  # the paper's DeiT-tiny "with Hardswish"
    x = torch.randn(1, 197, 192)
    with torch.no_grad():
        fns = timings._vit_components(blk, x)
        y = blk.norm1(x)
        qkv = blk.attn.qkv(y)
        torch.testing.assert_close(fns["Keys Q, K"](), qkv[..., :384])
        torch.testing.assert_close(fns["Values V"](), qkv[..., 384:])
        a = fns["Product QK^T"]()
        torch.testing.assert_close(a.sum(-1), torch.ones(1, 3, 197))
        o = fns["Attention projection"]()
        torch.testing.assert_close(o, blk.attn(y), atol=1e-5, rtol=1e-4)  # proj(A v) = the attention output
        torch.testing.assert_close(fns["MLP"](), blk.mlp(blk.norm2(x)))
        torch.testing.assert_close(fns["LayerNorm"]()[0], y)
    assert list(fns) == list(timings.ROWS)


def test_levit_components_are_the_blocks_pieces():
    blk = _levit_block()
    at = blk.attn
    x = torch.randn(1, 16, 256)
    with torch.no_grad():
        fns = timings._levit_components(blk, x)
        q, k, v = at.qkv(x).view(1, 16, at.num_heads, -1).transpose(1, 2).split([at.key_dim] * 2 + [at.val_dim], 3)
        qk = fns["Keys Q, K"]().view(1, 16, at.num_heads, 2 * at.key_dim).transpose(1, 2)
        torch.testing.assert_close(qk, torch.cat([q, k], -1))
        torch.testing.assert_close(fns["Values V"]().view(1, 16, at.num_heads, -1).transpose(1, 2), v)
        torch.testing.assert_close(fns["Attention projection"](), at(x), atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(fns["MLP"](), blk.mlp(x))
    assert list(fns) == [r for r in timings.ROWS if r != "LayerNorm"]  # LeViT has none (Table 1: n/a)


def test_component_timings_fields_and_bad_input():
    r = timings.component_timings(_deit_block(), torch.randn(1, 197, 192), warmup=1, runs=3)
    assert set(r["components_us"]) == set(timings.ROWS) and r["total_us"] > 0
    assert r["sum_us"] == pytest.approx(sum(r["components_us"].values()))
    unfused = vitlab.create_model("levit_256", img_size=64, depth=(1, 1, 1)).eval().stages[0].blocks[0]
    with pytest.raises(ValueError, match="fuse"):
        timings.component_timings(unfused, torch.randn(1, 16, 256), runs=1)
    with pytest.raises(ValueError, match=">= 50"):
        timings.levit_table1(runs=10)


def test_block_timings_any_model():
    model = vitlab.create_model("swin_tiny_patch4_window7_224", img_size=32, window_size=4, depths=(2, 2),
                                num_heads=(3, 6), embed_dim=48)
    r = timings.block_timings(model, torch.randn(1, 3, 32, 32), block=1, warmup=1, runs=3)
    assert r["block"] == "layers.0.blocks.1"
    assert {"norm1", "attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2"} <= set(r["components_us"])
    with pytest.raises(ValueError, match="out of range"):
        timings.block_timings(model, torch.randn(1, 3, 32, 32), block=9)


@pytest.mark.slow
def test_table1_components_add_up_to_the_block():
    """Compared on the fastest runs: on a shared machine a whole-block run (~2.5 ms) is preempted far more often
    than a component run (~0.2 ms), which inflates the block's median alone."""
    r = timings.levit_table1(runs=100)
    for model in ("deit_tiny", "levit_256"):
        assert 0.85 <= r[model]["sum_over_total_min"] <= 1.15, (model, r[model])
