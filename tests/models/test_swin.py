"""Swin Transformer: published size and cost, equality with timm for the same weights, the feature pyramid,
non-square inputs and the size constraints."""

from __future__ import annotations

import pytest
import torch

import vitlab
from tests.conftest import check_published, timm_pair
from vitlab.attention.local_window import _WindowAttentionBase
from vitlab.models.swin import SwinTransformer

timm = pytest.importorskip("timm")

NAMES = ["swin_tiny_patch4_window7_224", "swin_small_patch4_window7_224", "swin_base_patch4_window7_224"]
# a small instance of the same architecture: stages of 16, 8, 4, 2 tokens with 4x4 windows
SMALL = dict(img_size=64, window_size=4, depths=(2, 2, 2, 2))


_timm_pair = timm_pair


@pytest.mark.parametrize("name", NAMES)
def test_published_params_and_gmacs(name):
    check_published(name)  # on the meta device


def test_equals_timm_tiny(tmp_path):
    ref, ours = _timm_pair(NAMES[0], tmp_path)
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        assert (ours(x) - ref(x)).abs().max().item() < 1e-4
        assert torch.allclose(ours.forward_features(x), ref.forward_features(x), atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_equals_timm_full(name, tmp_path):
    ref, ours = _timm_pair(name, tmp_path)
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        assert (ours(x) - ref(x)).abs().max().item() < 1e-4


@pytest.mark.parametrize("img_size", [(64, 128), (128, 64)])
def test_equals_timm_non_square(img_size, tmp_path):
    ref, ours = _timm_pair(NAMES[0], tmp_path, img_size=img_size, window_size=4, depths=(2, 2, 2, 2))
    x = torch.randn(2, 3, *img_size)
    with torch.no_grad():
        assert (ours(x) - ref(x)).abs().max().item() < 1e-4
        _, feats = ours.forward_intermediates(x)
        _, ref_feats = ref.forward_intermediates(x)
    for a, b in zip(feats, ref_feats, strict=True):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-4)


def test_loads_state_dict_with_buffers_and_original_layout(tmp_path):
    """timm versions that saved relative_position_index / attn_mask, and the original (Microsoft) layout with
    the downsampling at the end of a stage and a bare ``head``, load the same."""
    torch.manual_seed(0)
    ref = timm.create_model(NAMES[0], **SMALL).eval()
    ours = vitlab.create_model(NAMES[0], **SMALL).eval()
    sd = dict(ref.state_dict())
    for name, mod in ref.named_modules():
        if hasattr(mod, "relative_position_index"):
            sd[f"{name}.relative_position_index"] = mod.relative_position_index
        if getattr(mod, "attn_mask", None) is not None:
            sd[f"{name}.attn_mask"] = mod.attn_mask
    original = {}
    for k, v in sd.items():
        for i in (1, 2, 3):
            k = k.replace(f"layers.{i}.downsample", f"layers.{i - 1}.downsample")
        original[k.replace("head.fc.", "head.")] = v
    x = torch.randn(1, 3, 64, 64)
    for state in (sd, original):
        path = tmp_path / "ckpt.pth"
        torch.save(state, path)
        vitlab.load_checkpoint(ours, path)
        with torch.no_grad():
            assert (ours(x) - ref(x)).abs().max().item() < 1e-4


def test_pyramid():
    model = vitlab.create_model(NAMES[0], img_size=(64, 128), window_size=4, depths=(2, 2, 2, 2)).eval()
    x = torch.randn(2, 3, 64, 128)
    assert [f["reduction"] for f in model.feature_info] == [4, 8, 16, 32]
    assert [f["num_chs"] for f in model.feature_info] == [96, 192, 384, 768]
    with torch.no_grad():
        final, feats = model.forward_intermediates(x)
        assert torch.equal(final, model.forward_features(x))
        for f, info in zip(feats, model.feature_info, strict=True):
            r = info["reduction"]
            assert f.shape == (2, info["num_chs"], 64 // r, 128 // r)
        nlc = model.forward_intermediates(x, indices=2, output_fmt="NLC", intermediates_only=True)
        assert [f.shape for f in nlc] == [(2, 4 * 8, 384), (2, 2 * 4, 768)]
        early = model.forward_intermediates(x, indices=[0], stop_early=True, intermediates_only=True)
        assert torch.equal(early[0], feats[0])
        normed = model.forward_intermediates(x, indices=[-1], norm=True, intermediates_only=True)[0]
        assert torch.allclose(normed, final.permute(0, 3, 1, 2))
    assert final.shape == (2, 2, 4, 768)  # NHWC, as timm


def test_shift_mask():
    """The shifted-window mask of the zoo's attention, which Swin uses: Swin's regions of the rolled map."""
    attn = _WindowAttentionBase(32, 2, window_size=4, shift_size=2, rel_pos_bias=False)
    mask = attn._structure_mask(8, 8, 2, 2, "cpu")[:, 0]  # (4 windows, 16, 16) "may attend"
    assert mask.shape == (4, 16, 16)
    assert mask[0].all()  # the top-left window is all one region
    assert not mask[3].all() and torch.equal(mask, mask.transpose(1, 2))
    # the bottom-right window holds four regions of 2x2 tokens: each token attends to its own 4
    assert (mask[3].sum(-1) == 4).all()


def test_one_window_attention_and_one_relative_position_index():
    """Swin's blocks hold the zoo's window attentions (no copy of their own), with timm's parameter names."""
    from vitlab.attention import LocalWindowAttention, ShiftedWindowAttention

    model = vitlab.create_model(NAMES[0], **SMALL)
    kinds = [type(b.attn) for s in model.layers for b in s.blocks]
    assert kinds[:2] == [LocalWindowAttention, ShiftedWindowAttention]
    assert kinds[-1] is LocalWindowAttention  # 2x2 last stage: the window clamps to the grid, no shift
    attn = model.layers[3].blocks[1].attn
    assert attn.relative_position_bias_table.shape == (3 * 3, 24)  # a 2x2 window: (2*2-1)^2 offsets
    assert {n for n, _ in model.layers[0].blocks[1].named_parameters(recurse=True)} >= {
        "attn.qkv.weight", "attn.proj.weight", "attn.relative_position_bias_table"}


def test_bad_sizes():
    with pytest.raises(ValueError, match="window"):
        vitlab.create_model(NAMES[0], img_size=(224, 320))  # 80 patches wide: 80, 40, 20 not multiples of 7
    with pytest.raises(ValueError, match="even"):
        vitlab.create_model(NAMES[0], img_size=(56, 56))  # 14 -> 7 -> 3.5 tokens: cannot merge
    with pytest.raises(ValueError, match="divisible by the patch"):
        vitlab.create_model(NAMES[0], img_size=(66, 64), window_size=4)
    with pytest.raises(ValueError, match="dynamic_img_size"):
        vitlab.create_model(NAMES[0], dynamic_img_size=True)
    model = vitlab.create_model(NAMES[0], **SMALL)
    with pytest.raises(ValueError, match="input size"):
        model(torch.randn(1, 3, 128, 128))
    with pytest.raises(ValueError, match="channels"):
        model(torch.randn(1, 1, 64, 64))


def test_grad_checkpointing_and_api():
    torch.manual_seed(0)
    model = vitlab.create_model(NAMES[0], num_classes=10, in_chans=1, drop_path_rate=0.1, **SMALL)
    assert isinstance(model, SwinTransformer)
    model.eval()
    x = torch.randn(2, 1, 64, 64)
    out = model(x)
    model.set_grad_checkpointing(True)
    out_ckpt = model(x)
    assert torch.allclose(out, out_ckpt, atol=1e-6)
    model.train()
    model(x).sum().backward()
    assert model.layers[1].blocks[1].attn.relative_position_bias_table.grad is not None
    assert all("relative_position_bias_table" in n for n in model.no_weight_decay())
    assert len(model.no_weight_decay()) == 8
    model.reset_classifier(5, global_pool="max")
    assert model(x).shape == (2, 5) and model.get_classifier().out_features == 5
    model.reset_classifier(0)
    assert model(x).shape == (2, model.num_features)
    model.reset_classifier(0, global_pool="")
    assert model(x).shape == (2, 2, 2, 768)
    assert model.forward_head(model.forward_features(x), pre_logits=True).shape == (2, 2, 2, 768)


@pytest.mark.slow
def test_torch_compile_fullgraph():
    torch.manual_seed(0)
    # two stages keep both window kinds (shifted at 8x8 tokens, window clamped to the grid at 4x4)
    model = SwinTransformer(img_size=32, window_size=4, embed_dim=32, depths=(2, 2), num_heads=(2, 4),
                            num_classes=10).eval()
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(compiled(x), model(x), atol=1e-5)
