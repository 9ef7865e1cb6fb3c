"""MobileViT (Mehta & Rastegari, 2022): published sizes, equality with timm's mobilevit_* for the same
weights, the feature pyramid, other input sizes and the size constraint."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import vitlab
from tests.conftest import timm_pair
from vitlab.profile import count_macs

timm = pytest.importorskip("timm")

NAMES = ["mobilevit_xxs", "mobilevit_xs", "mobilevit_s"]
SLOW_NAMES = [pytest.param(n, marks=pytest.mark.slow) if n != "mobilevit_xxs" else n for n in NAMES]


def _randomize_bn(model: nn.Module) -> None:
    """Non-trivial BatchNorm statistics and affines, so an eval-mode comparison exercises them."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                m.weight.copy_(1 + torch.randn(m.num_features, generator=g) * 0.1)
                m.bias.copy_(torch.randn(m.num_features, generator=g) * 0.1)


def _pair(name: str, tmp_path, **kwargs):
    """A timm model with random weights and ours loaded from its state dict through create_model."""
    return timm_pair(name, tmp_path, prepare=_randomize_bn, seed=None, **kwargs)


@pytest.mark.parametrize("name", NAMES)
def test_published_params_and_gmacs(name):
    cfg = vitlab.get_model_config(name)
    prof = vitlab.profile_model(name)
    assert prof.input_size == (3, 256, 256)
    # the paper's figures have two significant digits: 3%
    assert prof.params_m == pytest.approx(cfg.published_params_m, rel=0.03)
    assert prof.gmacs == pytest.approx(cfg.published_gmacs, rel=0.01)


@pytest.mark.parametrize("name", SLOW_NAMES)
def test_counts_equal_timm(name):
    with torch.device("meta"):
        ref = timm.create_model(name).eval()
    prof = vitlab.profile_model(name)
    assert prof.params_m * 1e6 == sum(p.numel() for p in ref.parameters())
    ref_macs = count_macs(ref, torch.zeros(1, 3, 256, 256, device="meta"))
    assert prof.gmacs * 1e9 == pytest.approx(ref_macs, rel=1e-9)


@pytest.mark.parametrize("name", SLOW_NAMES)
def test_logits_equal_timm(name, tmp_path):
    ref, ours = _pair(name, tmp_path)
    x = torch.randn(2, 3, 256, 256)
    with torch.no_grad():
        diff = (ours(x) - ref(x)).abs().max().item()
    assert diff < 1e-4


def test_intermediates_equal_timm_nonsquare(tmp_path):
    ref, ours = _pair("mobilevit_xxs", tmp_path)
    x = torch.randn(1, 3, 128, 192)  # non-square; both multiples of 64
    with torch.no_grad():
        final, feats = ours.forward_intermediates(x)
        ref_feats = ref.forward_intermediates(x, intermediates_only=True)
        torch.testing.assert_close(ours(x), ref(x), rtol=0, atol=1e-4)
        torch.testing.assert_close(final, ours.forward_features(x))
    assert [f.shape for f in feats] == [f.shape for f in ref_feats]
    for a, b in zip(feats, ref_feats, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
    # the pyramid: strides 2, 4, 8, 16, 32 with feature_info's channels
    for f, info in zip(feats, ours.feature_info, strict=True):
        assert f.shape[1:] == (info["num_chs"], 128 // info["reduction"], 192 // info["reduction"])
    assert [i["reduction"] for i in ours.feature_info] == [2, 4, 8, 16, 32]
    assert [i["module"] for i in ours.feature_info] == [i["module"] for i in ref.feature_info]


def test_interpolate_patches_matches_timm():
    """224 = 7 x 32: the stride-32 map (7x7) is not divisible by the 2x2 patches; with interpolate_patches the
    block resizes as ml-cvnets / timm do, and the outputs agree."""
    ref = timm.create_model("mobilevit_xxs").eval()
    _randomize_bn(ref)
    ours = vitlab.create_model("mobilevit_xxs", interpolate_patches=True).eval()
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(1, 3, 224, 160)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x), rtol=0, atol=1e-4)


def test_bad_size_and_channels():
    model = vitlab.create_model("mobilevit_xxs", transformer_depths=(1, 1, 1)).eval()
    with torch.no_grad():
        with pytest.raises(ValueError, match="divisible by 64"):
            model(torch.randn(1, 3, 224, 224))
        with pytest.raises(ValueError, match="divisible by 64"):
            model(torch.randn(1, 3, 256, 200))
        with pytest.raises(ValueError, match="channels"):
            model(torch.randn(1, 1, 256, 256))
        with pytest.raises(ValueError, match="divisible by 64"):
            model.forward_intermediates(torch.randn(1, 3, 96, 128))
    with pytest.raises(ValueError, match="global_pool"):
        vitlab.create_model("mobilevit_xxs", global_pool="token")
    with pytest.raises(ValueError, match="divisible by 64"):
        vitlab.create_model("mobilevit_xxs", img_size=224)


def test_api_pool_classifier_and_nlc():
    model = vitlab.create_model("mobilevit_xxs", img_size=64, num_classes=3, global_pool="max").eval()
    x = torch.randn(2, 3, 64, 128)
    with torch.no_grad():
        feats = model.forward_features(x)
        assert feats.shape == (2, 320, 2, 4)
        torch.testing.assert_close(model.forward_head(feats, pre_logits=True), feats.amax((2, 3)))
        nlc = model.forward_intermediates(x, indices=[0, -1], output_fmt="NLC", intermediates_only=True)
        assert [t.shape for t in nlc] == [(2, 32 * 64, 16), (2, 8, 320)]
        early = model.forward_intermediates(x, indices=[1], stop_early=True, intermediates_only=True)
        assert early[0].shape == (2, 24, 16, 32)
    assert model(x).shape == (2, 3)
    model.reset_classifier(10, global_pool="avg")
    assert model.get_classifier().out_features == 10 and model(x).shape == (2, 10)


def test_head_of_other_size_is_skipped(tmp_path):
    ref = timm.create_model("mobilevit_xxs")
    path = tmp_path / "xxs.pth"
    torch.save(ref.state_dict(), path)
    with pytest.warns(UserWarning, match="classifier"):
        model = vitlab.create_model("mobilevit_xxs", checkpoint_path=str(path), num_classes=10)
    torch.testing.assert_close(model.stem.conv.weight, ref.stem.conv.weight)
    assert model.get_classifier().out_features == 10
