"""CaiT: published size and cost, equality with timm for the same weights (talking heads, LayerScale, class
attention), intermediates, non-square inputs and size errors."""

from __future__ import annotations

import pytest
import torch

import vitlab
from tests.conftest import check_published, timm_pair
from vitlab.models.cait import Cait, TalkingHeadAttn

timm = pytest.importorskip("timm")

NAMES = ["cait_xxs24_224", "cait_xs24_224", "cait_s24_224"]
TIMM_NAMES = {"cait_xs24_224": "cait_xs24_384"}  # timm has XS24 only at 384 px: same architecture at 224
SMALL = dict(img_size=64, depth=2)


def _timm_pair(name: str, tmp_path, **kwargs):
    """A timm model whose LayerScale vectors are O(1) (at their 1e-5 init every block would be ~identity and
    the comparison empty), and ours loaded from its state dict through create_model."""
    return timm_pair(name, tmp_path, timm_name=TIMM_NAMES.get(name, name), timm_kwargs={"img_size": 224} | kwargs,
                     prepare=_scale_gammas, **kwargs)


def _scale_gammas(ref) -> None:
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if "gamma" in n:
                p.copy_(0.5 + 0.5 * torch.rand_like(p))


@pytest.mark.parametrize("name", NAMES)
def test_published_params_and_gmacs(name):
    check_published(name)  # on the meta device


def test_equals_timm_xxs24(tmp_path):
    ref, ours = _timm_pair(NAMES[0], tmp_path)
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        out, ref_out = ours(x), ref(x)
        assert (out - ref_out).abs().max().item() < 1e-4
        assert ref_out.std() > 0.1  # the blocks really contribute
        assert torch.allclose(ours.forward_features(x), ref.forward_features(x), atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_equals_timm_full(name, tmp_path):
    ref, ours = _timm_pair(name, tmp_path)
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        assert (ours(x) - ref(x)).abs().max().item() < 1e-4


def test_equals_timm_non_square(tmp_path):
    ref, ours = _timm_pair(NAMES[0], tmp_path, img_size=(64, 128), depth=3)
    x = torch.randn(2, 3, 64, 128)
    with torch.no_grad():
        assert (ours(x) - ref(x)).abs().max().item() < 1e-4
        final, feats = ours.forward_intermediates(x, indices=2)
        ref_final, ref_feats = ref.forward_intermediates(x, indices=2)
    assert torch.allclose(final, ref_final, atol=1e-4)
    for a, b in zip(feats, ref_feats, strict=True):
        assert a.shape == (2, 192, 4, 8) and torch.allclose(a, b, atol=1e-4)


def test_talking_heads_mix_heads():
    """The head mixing equals timm's formulation: a Linear over the head axis (heads-last)."""
    torch.manual_seed(0)
    attn = TalkingHeadAttn(32, num_heads=4)
    logits = torch.randn(2, 4, 5, 5)
    ref = attn.proj_l(logits.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
    assert torch.allclose(TalkingHeadAttn._mix_heads(logits, attn.proj_l), ref, atol=1e-6)


def test_talking_heads_direct_everywhere_and_weights_on_request():
    """One arithmetic (the direct form) whatever the input; ``return_attn`` gives the post-mix weights P with
    ``out = proj(P V)``, ``return_qk`` the unmixed queries and keys, ``attn_mask`` biases the mixed logits."""
    torch.manual_seed(0)
    attn = TalkingHeadAttn(32, num_heads=4).eval()
    x = torch.randn(2, 6, 32)
    out, P, q, k = attn(x, return_attn=True, return_qk=True)
    assert torch.equal(out, attn(x)) and P.shape == (2, 4, 6, 6) and q.shape == k.shape == (2, 4, 6, 8)
    v = attn.qkv(x).view(2, 6, 3, 4, 8)[:, :, 2].transpose(1, 2)
    torch.testing.assert_close(out, attn.proj((P @ v).transpose(1, 2).reshape(2, 6, 32)))
    mix = TalkingHeadAttn._mix_heads
    torch.testing.assert_close(P, mix(mix((q * attn.scale) @ k.transpose(-2, -1), attn.proj_l).softmax(-1),
                                      attn.proj_w))
    bias = torch.randn(2, 1, 1, 6)
    _, Pm = attn(x, attn_mask=bias, return_attn=True)
    logits = mix((q * attn.scale) @ k.transpose(-2, -1), attn.proj_l) + bias
    torch.testing.assert_close(Pm, mix(logits.softmax(-1), attn.proj_w))


def test_intermediates():
    model = vitlab.create_model(NAMES[0], img_size=(64, 96), depth=4).eval()
    x = torch.randn(2, 3, 64, 96)
    assert [f["reduction"] for f in model.feature_info] == [16] * 4
    with torch.no_grad():
        final, feats = model.forward_intermediates(x)
        assert torch.allclose(final, model.forward_features(x))
        assert final.shape == (2, 1 + 4 * 6, 192)
        assert len(feats) == 4 and all(f.shape == (2, 192, 4, 6) for f in feats)
        nlc = model.forward_intermediates(x, indices=[1], output_fmt="NLC", norm=True, intermediates_only=True)
        assert nlc[0].shape == (2, 24, 192)
        assert torch.allclose(nlc[0], model.norm(feats[1].flatten(2).transpose(1, 2)), atol=1e-6)


def test_bad_sizes_and_dynamic():
    with pytest.raises(ValueError, match="divisible by the patch"):
        vitlab.create_model(NAMES[0], img_size=(224, 230), depth=1)
    model = vitlab.create_model(NAMES[0], **SMALL)
    with pytest.raises(ValueError, match="input size"):
        model(torch.randn(1, 3, 96, 96))
    with pytest.raises(ValueError, match="channels"):
        model(torch.randn(1, 1, 64, 64))
    with pytest.raises(ValueError, match="global_pool"):
        vitlab.create_model(NAMES[0], global_pool="max", **SMALL)
    dyn = vitlab.create_model(NAMES[0], dynamic_img_size=True, **SMALL).eval()
    with torch.no_grad():
        assert dyn(torch.randn(1, 3, 96, 48)).shape == (1, 1000)


def test_grad_checkpointing_and_api():
    torch.manual_seed(0)
    model = vitlab.create_model(NAMES[0], num_classes=10, in_chans=1, **SMALL)
    assert isinstance(model, Cait)
    x = torch.randn(2, 1, 64, 64)
    model.eval()
    out = model(x)
    model.set_grad_checkpointing(True)
    assert torch.allclose(out, model(x), atol=1e-6)
    model.train()
    model(x).sum().backward()
    assert model.blocks[0].attn.proj_l.weight.grad is not None and model.cls_token.grad is not None
    assert model.no_weight_decay() == {"pos_embed", "cls_token"}
    model.reset_classifier(5, global_pool="avg")
    assert model(x).shape == (2, 5) and model.get_classifier().out_features == 5
    model.reset_classifier(0)
    assert model(x).shape == (2, 192)
    assert model.forward_head(model.forward_features(x), pre_logits=True).shape == (2, 192)
