"""EfficientFormer: published sizes, equality with timm for the same weights, the feature pyramid, the API and
input checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import vitlab
from tests.conftest import check_published, check_published_params, timm_pair
from vitlab.models.efficientformer import EfficientFormer, Flat, MetaBlock1d, MetaBlock2d

NAMES = ["efficientformer_l1", "efficientformer_l3", "efficientformer_l7"]
SMALL = dict(img_size=64, depths=(1, 1, 1, 2), num_vit=1)


def _randomize(model: nn.Module, seed: int = 0) -> nn.Module:
    """Non-trivial norms, BatchNorm statistics, LayerScales (init 1e-5 would hide the residual branches) and
    attention biases."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)
        for name, p in model.named_parameters():
            if name.endswith("gamma"):
                p.copy_(torch.rand(p.shape, generator=g) * 0.8 + 0.2)
            elif "attention_biases" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith("norm1.weight") or name.endswith("norm2.weight") or name == "norm.weight":
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif name.endswith("bias") and p.ndim == 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def _timm_pair(name: str, tmp_path):
    return timm_pair(name, tmp_path, prepare=_randomize)


_check_published = check_published


def test_published_params_and_gmacs_l1():
    _check_published("efficientformer_l1")


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES[1:])
def test_published_params_and_gmacs(name):
    _check_published(name)


@pytest.mark.parametrize("name", NAMES[1:])
def test_published_params(name):
    """The parameter counts alone (cheap: the model is built on the meta device, nothing runs)."""
    check_published_params(name)


def _check_timm(name, tmp_path):
    ref, ours = _timm_pair(name, tmp_path)
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        a, b = ref(x), ours(x)
        assert (ref.forward_features(x) - ours.forward_features(x)).abs().max() < 1e-4
    assert a.abs().max() > 0.1
    assert (a - b).abs().max() < 1e-4


def test_timm_equality_l1(tmp_path):
    _check_timm("efficientformer_l1", tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES[1:])
def test_timm_equality_all(name, tmp_path):
    _check_timm(name, tmp_path)


def test_block_layout_matches_paper():
    with torch.device("meta"):
        l1, l3, l7 = (vitlab.create_model(n) for n in NAMES)
    for model, depths, n_vit in ((l1, (3, 2, 6, 4), 1), (l3, (4, 4, 12, 6), 4), (l7, (6, 6, 18, 8), 8)):
        kinds = [[type(b) for b in s.blocks] for s in model.stages]
        for k, d in zip(kinds[:3], depths[:3], strict=True):
            assert k == [MetaBlock2d] * d
        assert kinds[3] == [MetaBlock2d] * (depths[3] - n_vit) + [Flat] + [MetaBlock1d] * n_vit
        attn = model.stages[3].blocks[-1].token_mixer
        assert (attn.num_heads, attn.key_dim, attn.val_dim, attn.resolution) == (8, 32, 128, (7, 7))


def test_forward_intermediates_pyramid():
    model = _randomize(vitlab.create_model("efficientformer_l1")).eval()
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        final, feats = model.forward_intermediates(x)
        assert torch.equal(final, model.forward_features(x))
        assert [tuple(f.shape) for f in feats] == [(1, 48, 56, 56), (1, 96, 28, 28), (1, 224, 14, 14),
                                                    (1, 448, 7, 7)]
        assert [i["reduction"] for i in model.feature_info] == [4, 8, 16, 32]
        normed = model.forward_intermediates(x, indices=1, norm=True, output_fmt="NLC", intermediates_only=True)
        assert torch.allclose(normed[0], final)
        assert torch.equal(normed[0].transpose(1, 2).reshape(1, 448, 7, 7), model.norm(
            feats[3].flatten(2).transpose(1, 2)).transpose(1, 2).reshape(1, 448, 7, 7))
        early = model.forward_intermediates(x, indices=[1], intermediates_only=True, stop_early=True)
        assert len(early) == 1 and torch.equal(early[0], feats[1])
    with pytest.raises(ValueError):
        model.forward_intermediates(x, output_fmt="NHWC")


def test_small_instance_api_and_heads():
    model = vitlab.create_model("efficientformer_l7", img_size=64, depths=(1, 1, 1, 1), num_vit=1)
    assert isinstance(model.stages[3].blocks[0], Flat)  # L7: all of stage 4 is attention blocks
    x = torch.randn(2, 3, 64, 64)
    out = model.train()(x)
    assert isinstance(out, tuple) and out[1].shape == (2, 1000)
    model.set_distilled_training(False)
    assert model(x).shape == (2, 1000)
    model.eval()
    with torch.no_grad():
        pooled = model.forward_head(model.forward_features(x), pre_logits=True)
        assert pooled.shape == (2, 768)
        assert torch.allclose(model(x), (model.head(pooled) + model.head_dist(pooled)) / 2, atol=1e-6)
    model.reset_classifier(5)
    assert model(x).shape == (2, 5)
    model.reset_classifier(0)
    assert model(x).shape == (2, 768)
    assert model.no_weight_decay() == {"stages.3.blocks.1.token_mixer.attention_biases"}
    _, feats = model.forward_intermediates(x)
    assert [tuple(f.shape[-2:]) for f in feats] == [(16, 16), (8, 8), (4, 4), (2, 2)]


def test_fuse_gathers_the_biases_once_same_outputs():
    torch.manual_seed(0)
    model = vitlab.create_model("efficientformer_l1", img_size=64, depths=(1, 1, 1, 2), num_vit=2).eval()
    for p in model.parameters():  # non-zero biases, so that a wrong gather shows
        p.data.normal_(0, 0.05)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        ref = model(x)
        fused = model.fuse()
        assert fused is model and fused.fused and not fused.training
        assert (fused(x) - ref).abs().max() < 1e-6
    attns = [m for m in fused.modules() if hasattr(m, "attention_bias_folded")]
    assert len(attns) == 2 and not any("folded" in k for k in fused.state_dict())


def test_grad_checkpointing_same_gradients():
    torch.manual_seed(0)
    model = _randomize(vitlab.create_model("efficientformer_l1", **SMALL)).train()
    model.set_distilled_training(False)
    x = torch.randn(2, 3, 64, 64)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model(x).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.load_state_dict(state)
    model.zero_grad()
    model.set_grad_checkpointing(True)
    model(x).sum().backward()
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, grads[n], atol=1e-5), n


def test_in_chans_and_bad_input():
    model = vitlab.create_model("efficientformer_l1", in_chans=1, **SMALL).eval()
    assert isinstance(model, EfficientFormer)
    with torch.no_grad():
        assert model(torch.randn(2, 1, 64, 64)).shape == (2, 1000)
    with pytest.raises(ValueError, match="input channels"):
        model(torch.randn(2, 3, 64, 64))
    with pytest.raises(ValueError, match="attention biases are tied"):
        model(torch.randn(2, 1, 96, 96))
    with pytest.raises(ValueError):
        vitlab.create_model("efficientformer_l1", global_pool="max")


def test_meta_device_and_registry():
    with torch.device("meta"):
        model = vitlab.create_model("efficientformer_l3").eval()
    assert model(torch.empty(2, 3, 224, 224, device="meta")).shape == (2, 1000)
    for name in NAMES:
        cfg = vitlab.get_model_config(name)
        assert cfg.family == "efficientformer" and cfg.smoke_kwargs["img_size"] == 64
        with torch.no_grad():
            assert vitlab.create_model(name, **cfg.smoke_kwargs).eval()(torch.randn(1, 3, 64, 64)).shape == (1, 1000)
