"""PVT v1 (Wang et al., 2021): published sizes, spatial-reduction attention against plain MSA and an explicit
reference, the feature pyramid, position-embedding resampling, and the size constraint. (timm has no PVT v1,
so there is no timm equality here.)"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn

import vitlab
from vitlab.attention import MultiHeadSelfAttention as Attention
from vitlab.attention import SpatialReductionAttention

SMALL = dict(depths=(1, 1, 1, 1))


@pytest.mark.parametrize("name", ["pvt_tiny", "pvt_small",
                                  pytest.param("pvt_medium", marks=pytest.mark.slow),
                                  pytest.param("pvt_large", marks=pytest.mark.slow)])
def test_published_params_and_gmacs(name):
    cfg = vitlab.get_model_config(name)
    prof = vitlab.profile_model(name)
    assert prof.input_size == (3, 224, 224)
    assert prof.params_m == pytest.approx(cfg.published_params_m, rel=0.01)
    # the paper's GFLOPs are multiply-adds, given with two significant digits (1.9, 3.8, 6.7, 9.8): 3%
    assert prof.gmacs == pytest.approx(cfg.published_gmacs, rel=0.03)


def test_sra_ratio_1_is_msa():
    torch.manual_seed(0)
    sra = SpatialReductionAttention(64, num_heads=2, sr_ratio=1).eval()
    msa = Attention(64, num_heads=2).eval()
    with torch.no_grad():
        msa.qkv.weight.copy_(torch.cat([sra.q.weight, sra.kv.weight]))
        msa.qkv.bias.copy_(torch.cat([sra.q.bias, sra.kv.bias]))
        msa.proj.load_state_dict(sra.proj.state_dict())
        x = torch.randn(2, 1 + 7 * 5, 64)  # a class token + a 7x5 grid
        torch.testing.assert_close(sra(x, (7, 5)), msa(x, (7, 5)), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(sra(x), msa(x), rtol=1e-5, atol=1e-5)


def _reference_sra(m: SpatialReductionAttention, x: torch.Tensor, H: int, W: int) -> torch.Tensor:
    """The paper's equations written out: R x R conv + LayerNorm reduce the grid, softmax attention."""
    B, N, C = x.shape
    h, d = m.num_heads, C // m.num_heads
    q = m.q(x).reshape(B, N, h, d).permute(0, 2, 1, 3)
    xr = m.sr(x.transpose(1, 2).reshape(B, C, H, W)).reshape(B, C, -1).transpose(1, 2)
    kv = m.kv(m.norm(xr)).reshape(B, -1, 2, h, d).permute(2, 0, 3, 1, 4)
    attn = (q @ kv[0].transpose(-2, -1) * d**-0.5).softmax(-1)
    return m.proj((attn @ kv[1]).transpose(1, 2).reshape(B, N, C))


@pytest.mark.parametrize("ratio, hw", [(8, (16, 24)), (4, (8, 12)), (2, (6, 4))])
def test_sra_matches_reference(ratio, hw):
    m = SpatialReductionAttention(40, num_heads=5, sr_ratio=ratio).eval()
    x = torch.randn(2, hw[0] * hw[1], 40)
    with torch.no_grad():
        torch.testing.assert_close(m(x, hw), _reference_sra(m, x, *hw), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="hw"):
        m(x)


def test_pyramid_nonsquare():
    model = vitlab.create_model("pvt_tiny", **SMALL).eval()
    x = torch.randn(2, 3, 128, 96)  # non-square, != the 224 default: position embeddings resampled
    with torch.no_grad():
        final, feats = model.forward_intermediates(x)
        torch.testing.assert_close(final, model.forward_features(x))
        nlc = model.forward_intermediates(x, indices=[0, 3], output_fmt="NLC", intermediates_only=True)
        normed = model.forward_intermediates(x, indices=1, norm=True, intermediates_only=True)
    assert [i["reduction"] for i in model.feature_info] == [4, 8, 16, 32]
    for f, info in zip(feats, model.feature_info, strict=True):
        assert f.shape == (2, info["num_chs"], 128 // info["reduction"], 96 // info["reduction"])
    assert final.shape == (2, 1 + 4 * 3, 512)  # class token + the stride-32 grid
    assert [t.shape for t in nlc] == [(2, 32 * 24, 64), (2, 12, 512)]
    torch.testing.assert_close(nlc[1].transpose(1, 2).reshape(2, 512, 4, 3), feats[3])
    torch.testing.assert_close(normed[0].flatten(2).transpose(1, 2), final[:, 1:])
    assert model(x).shape == (2, 1000)


def test_pos_embed_resampled_like_a_model_built_for_the_size(tmp_path):
    """A 224 model on a 256x192 input == a model built for 256x192 that loaded the 224 weights (the loader
    resamples the position embeddings once, the forward pass on the fly: bilinear, as the reference code)."""
    ref = vitlab.create_model("pvt_tiny", **SMALL).eval()
    path = tmp_path / "pvt.pth"
    torch.save(ref.state_dict(), path)
    model = vitlab.create_model("pvt_tiny", img_size=(256, 192), checkpoint_path=str(path), **SMALL).eval()
    assert model.stages[0].pos_embed.shape == (1, 64 * 48, 64)
    assert model.stages[3].pos_embed.shape == (1, 1 + 8 * 6, 512)
    torch.testing.assert_close(model.stages[3].pos_embed[:, 0], ref.stages[3].pos_embed[:, 0])  # class token
    x = torch.randn(1, 3, 256, 192)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), rtol=1e-5, atol=1e-5)


def test_reference_code_names_load(tmp_path):
    """A state dict with the reference implementation's flat names loads through checkpoint_filter_fn."""
    ref = vitlab.create_model("pvt_tiny", img_size=64, **SMALL).eval()

    def to_reference(k: str) -> str:
        k = re.sub(r"^stages\.(\d)\.patch_embed\.", lambda m: f"patch_embed{int(m.group(1)) + 1}.", k)
        k = re.sub(r"^stages\.(\d)\.pos_embed$", lambda m: f"pos_embed{int(m.group(1)) + 1}", k)
        return re.sub(r"^stages\.(\d)\.blocks\.", lambda m: f"block{int(m.group(1)) + 1}.", k)

    sd = {to_reference(k): v for k, v in ref.state_dict().items()}
    assert "block1.0.attn.sr.weight" in sd and "pos_embed4" in sd and "patch_embed2.norm.weight" in sd
    path = tmp_path / "pvt_ref.pth"
    torch.save(sd, path)
    model = vitlab.create_model("pvt_tiny", img_size=64, checkpoint_path=str(path), **SMALL).eval()
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x))


def test_bad_size_and_channels():
    model = vitlab.create_model("pvt_tiny", **SMALL).eval()
    with torch.no_grad():
        with pytest.raises(ValueError, match="divisible by 32"):
            model(torch.randn(1, 3, 224, 200))
        with pytest.raises(ValueError, match="divisible by 32"):
            model.forward_intermediates(torch.randn(1, 3, 100, 96))
        with pytest.raises(ValueError, match="channels"):
            model(torch.randn(1, 4, 224, 224))
    with pytest.raises(ValueError, match="divisible"):
        vitlab.create_model("pvt_tiny", embed_dims=(64, 128, 320, 510))
    with pytest.raises(ValueError, match="divisible by 32"):
        vitlab.create_model("pvt_tiny", img_size=(224, 200))


def test_pooling_and_classifier():
    model = vitlab.create_model("pvt_tiny", img_size=64, num_classes=4, **SMALL).eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        feats = model.forward_features(x)
        torch.testing.assert_close(model.forward_head(feats, pre_logits=True), feats[:, 0])
        model.reset_classifier(6, global_pool="avg")
        torch.testing.assert_close(model.forward_head(feats, pre_logits=True), feats[:, 1:].mean(1))
        assert model(x).shape == (2, 6)
    assert isinstance(model.get_classifier(), nn.Linear)
    assert "cls_token" in model.no_weight_decay() and "stages.3.pos_embed" in model.no_weight_decay()


def test_drop_path_schedule_and_train_step():
    model = vitlab.create_model("pvt_tiny", img_size=64, drop_path_rate=0.1, num_classes=3)
    rates = [b.drop_path1.p if hasattr(b.drop_path1, "p") else 0.0 for s in model.stages for b in s.blocks]
    assert rates[0] == 0.0 and rates[-1] == pytest.approx(0.1) and rates == sorted(rates)
    model.train()
    model.set_grad_checkpointing()
    model(torch.randn(2, 3, 64, 64)).sum().backward()
    assert model.stages[0].blocks[0].attn.sr.weight.grad is not None
