"""LITv2 (Pan et al., NeurIPS 2022, "Fast Vision Transformers with HiLo Attention"): published size and cost, the
ConvFFN blocks, deformable token merging (zero offsets = a plain strided conv), HiLo as MSA in the last stage, the
feature pyramid, non-square inputs and size checks, the official checkpoint layout. timm has no LITv2, so there is
no timm equality test."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import vitlab
from vitlab.attention import MultiHeadSelfAttention as Attention
from vitlab.models.litv2 import (
    ConvFFN,
    ConvFFNBlock,
    DeformableTokenMerging,
    DeformConv2d,
    HiLoBlock,
    LITv2,
)

NAMES = ["litv2_s", "litv2_m", "litv2_b"]
# a small instance of the same architecture: grids 16, 8, 4, 2 at 64 px, every layer kind kept
SMALL = dict(img_size=64, depths=(1, 1, 2, 1))


@pytest.mark.parametrize("name", NAMES)
def test_published_params_and_gmacs(name):
    cfg = vitlab.get_model_config(name)
    prof = vitlab.profile_model(name)  # on the meta device
    # published figures have two significant digits
    assert prof.params_m == pytest.approx(cfg.published_params_m, rel=0.03)
    assert prof.gmacs == pytest.approx(cfg.published_gmacs, rel=0.03)


def test_table_i_structure():
    with torch.device("meta"):
        model = vitlab.create_model("litv2_b")
    assert [len(s.blocks) for s in model.layers] == [2, 2, 18, 2]
    assert [f["num_chs"] for f in model.feature_info] == [128, 256, 512, 1024]
    assert model.patch_embed.proj.kernel_size == (4, 4) and model.layers[0].downsample is None
    for i, stage in enumerate(model.layers):
        kinds = {type(b) for b in stage.blocks}
        assert kinds == ({ConvFFNBlock} if i < 2 else {HiLoBlock})  # no attention in stages 1-2
        if i:
            dconv = stage.downsample.dconv
            assert isinstance(stage.downsample.norm, nn.BatchNorm2d)
            assert dconv.kernel_size == dconv.stride == (2, 2)
            assert dconv.conv_offset.out_channels == 8  # a (dy, dx) pair for each of the 2x2 taps
    s3, s4 = model.layers[2].blocks[0].attn, model.layers[3].blocks[0].attn
    assert (s3.ws, s3.l_heads, s3.h_heads) == (2, 14, 2)  # alpha = 0.9 of 16 heads -> 14 Lo-Fi
    assert (s4.ws, s4.l_heads, s4.h_heads) == (1, 32, 0)  # s = 1: all Lo-Fi, plain MSA
    # every block's FFN is the ConvFFN with ratio 4
    for stage, c in zip(model.layers, (128, 256, 512, 1024), strict=True):
        mlp = stage.blocks[0].mlp
        assert isinstance(mlp, ConvFFN) and mlp.fc1.out_features == 4 * c and mlp.dwconv.groups == 4 * c


def test_convffn_block_is_fc1_dwconv_gelu_fc2():
    torch.manual_seed(0)
    blk = ConvFFNBlock(16).eval()
    assert not hasattr(blk, "attn") and not hasattr(blk, "norm1")
    x = torch.randn(2, 6 * 10, 16)
    m = blk.mlp
    h = m.fc1(blk.norm2(x)).transpose(1, 2).reshape(2, 64, 6, 10)  # (B, 4C, H, W)
    h = F.conv2d(h, m.dwconv.weight, m.dwconv.bias, padding=1, groups=64)
    ref = x + m.fc2(F.gelu(h.flatten(2).transpose(1, 2)))
    torch.testing.assert_close(blk(x, (6, 10)), ref, rtol=1e-5, atol=1e-5)


def test_deformable_conv_with_zero_offsets_is_the_strided_conv():
    torch.manual_seed(0)
    dc = DeformConv2d(8, 16)
    assert torch.count_nonzero(dc.conv_offset.weight) == 0 and torch.count_nonzero(dc.conv_offset.bias) == 0
    x = torch.randn(2, 8, 6, 10)
    out, offset = dc(x, return_offset=True)
    assert offset.shape == (2, 8, 3, 5) and not offset.any()
    ref = F.conv2d(x, dc.weight, dc.bias, stride=2)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # and the merge: BatchNorm + GELU on top (eval statistics)
    dtm = DeformableTokenMerging(8, 16).eval()
    ref = F.gelu(dtm.norm(F.conv2d(x, dtm.dconv.weight, dtm.dconv.bias, stride=2)))
    torch.testing.assert_close(dtm(x), ref, rtol=1e-5, atol=1e-5)


def test_deformable_conv_samples_at_the_offsets():
    """Offsets are really used: a (0, +1) offset on every tap reads the map one column to the right."""
    torch.manual_seed(0)
    dc = DeformConv2d(4, 6)
    with torch.no_grad():
        dc.conv_offset.bias.copy_(torch.tensor([0.0, 1.0] * 4))  # (dy, dx) per tap
    x = torch.randn(1, 4, 6, 8)
    shifted = F.pad(x[..., 1:], (0, 1))  # x[..., j + 1], zero beyond the border
    torch.testing.assert_close(dc(x), F.conv2d(shifted, dc.weight, dc.bias, stride=2), rtol=1e-5, atol=1e-5)
    # gradients reach the offset branch
    dc(x).square().sum().backward()
    assert dc.conv_offset.weight.grad is not None and dc.conv_offset.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_counter_counts_the_deformable_conv_as_a_conv(device):
    """The same arithmetic on every device; the counter gives deform_conv2d the MACs of its convolution."""
    from vitlab.profile import count_macs

    with torch.device(device):
        dc = DeformConv2d(8, 16)
        x = torch.zeros(1, 8, 6, 10)
    assert dc(x).shape == (1, 16, 3, 5)
    per_pos = 2 * 2 * 8  # 2x2 kernel, 8 input channels
    assert count_macs(dc, x) == 3 * 5 * per_pos * (16 + 8)  # the deformable conv + the offset conv


def test_last_stage_hilo_is_msa():
    torch.manual_seed(0)
    model = vitlab.create_model("litv2_s", **SMALL).eval()
    hilo = model.layers[3].blocks[0].attn
    assert hilo.h_heads == 0 and hilo.ws == 1
    dim = 768
    msa = Attention(dim, 24).eval()
    with torch.no_grad():
        msa.qkv.weight.copy_(torch.cat([hilo.l_q.weight, hilo.l_kv.weight]))
        msa.qkv.bias.copy_(torch.cat([hilo.l_q.bias, hilo.l_kv.bias]))
        msa.proj.load_state_dict(hilo.l_proj.state_dict())
        x = torch.randn(2, 3 * 5, dim)
        torch.testing.assert_close(hilo(x, (3, 5)), msa(x, (3, 5)), rtol=1e-5, atol=1e-5)


def test_pyramid_and_non_square():
    torch.manual_seed(0)
    model = vitlab.create_model("litv2_s", img_size=(64, 128), depths=(1, 1, 1, 1)).eval()
    x = torch.randn(2, 3, 64, 128)
    assert [f["reduction"] for f in model.feature_info] == [4, 8, 16, 32]
    assert [f["num_chs"] for f in model.feature_info] == [96, 192, 384, 768]
    with torch.no_grad():
        final, feats = model.forward_intermediates(x)
        assert torch.equal(final, model.forward_features(x))
        assert final.shape == (2, 2 * 4, 768)  # tokens (B, H/32 * W/32, C)
        for f, info in zip(feats, model.feature_info, strict=True):
            r = info["reduction"]
            assert f.shape == (2, info["num_chs"], 64 // r, 128 // r)
        nlc = model.forward_intermediates(x, indices=2, output_fmt="NLC", intermediates_only=True)
        assert [f.shape for f in nlc] == [(2, 4 * 8, 384), (2, 2 * 4, 768)]
        assert torch.equal(nlc[0], feats[2].flatten(2).transpose(1, 2))
        early = model.forward_intermediates(x, indices=[0], stop_early=True, intermediates_only=True)
        assert torch.equal(early[0], feats[0])
        normed = model.forward_intermediates(x, indices=[-1], norm=True, intermediates_only=True)[0]
        torch.testing.assert_close(normed.flatten(2).transpose(1, 2), final)
        # no position embedding: the same weights take other sizes, transposed included
        for size in [(128, 64), (96, 160), (32, 32)]:
            y = model(torch.randn(1, 3, *size))
            assert y.shape == (1, 1000) and torch.isfinite(y).all()
        # sides that are multiples of 32 give even stage-3 grids, so the s = 2 HiLo windows always tile them
        assert model.forward_intermediates(torch.randn(1, 3, 96, 160), indices=[2],
                                           intermediates_only=True)[0].shape == (1, 384, 6, 10)


def test_bad_sizes_and_channels():
    with pytest.raises(ValueError, match="divisible by 32"):
        vitlab.create_model("litv2_s", img_size=(224, 240))
    model = vitlab.create_model("litv2_s", **SMALL).eval()
    with pytest.raises(ValueError, match="divisible by 32"):
        model(torch.randn(1, 3, 64, 80))
    with pytest.raises(ValueError, match="divisible by 32"):
        model.forward_intermediates(torch.randn(1, 3, 48, 64))
    with pytest.raises(ValueError, match="channels"):
        model(torch.randn(1, 1, 64, 64))


def test_grad_checkpointing_and_api():
    torch.manual_seed(0)
    model = vitlab.create_model("litv2_s", num_classes=10, in_chans=1, drop_path_rate=0.1, **SMALL)
    assert isinstance(model, LITv2)
    model.eval()
    x = torch.randn(2, 1, 64, 64)
    out = model(x)
    model.set_grad_checkpointing(True)
    torch.testing.assert_close(model(x), out, rtol=1e-5, atol=1e-5)
    model.train()
    model(x).sum().backward()
    assert model.layers[2].blocks[1].attn.h_qkv.weight.grad is not None
    assert model.no_weight_decay() == set()
    model.reset_classifier(5, global_pool="max")
    assert model(x).shape == (2, 5) and model.get_classifier().out_features == 5
    model.reset_classifier(0)
    assert model(x).shape == (2, model.num_features)
    model.reset_classifier(0, global_pool="")
    assert model(x).shape == (2, 4, 768)
    with pytest.raises(ValueError, match="global_pool"):
        model.reset_classifier(0, global_pool="token")


def test_official_checkpoint_layout_loads(tmp_path):
    """The official layout (merge at the end of a stage, ``mlp.dwconv.dwconv``, ``downsample.norm_layer``,
    training checkpoints under 'model') loads through create_model(checkpoint_path=...)."""
    torch.manual_seed(0)
    ref = vitlab.create_model("litv2_s", **SMALL).eval()
    original = {}
    for k, v in ref.state_dict().items():
        for i in (1, 2, 3):
            k = k.replace(f"layers.{i}.downsample.", f"layers.{i - 1}.downsample.")
        k = k.replace(".mlp.dwconv.", ".mlp.dwconv.dwconv.").replace(".downsample.norm.", ".downsample.norm_layer.")
        original[k] = v
    assert "layers.0.downsample.dconv.conv_offset.weight" in original
    path = tmp_path / "litv2.pth"
    torch.save({"model": original}, path)
    ours = vitlab.create_model("litv2_s", checkpoint_path=str(path), **SMALL).eval()
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x), rtol=0, atol=0)
