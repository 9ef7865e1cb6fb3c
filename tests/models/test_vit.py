"""ViT and DeiT: equal to timm for the same weights, the published sizes, the API's errors and options."""

from __future__ import annotations

import pytest
import torch

import vitlab

timm = pytest.importorskip("timm")

VIT_DEIT = [n for n in vitlab.list_models(["vit_*", "deit_*"], task="classify") if n in timm.list_models()]  # in timm
# base and larger: full widths, two blocks deep by default; full depth under -m slow
BIG = {n for n in VIT_DEIT if "base" in n or "large" in n} | {"vit_large_patch16_224", "vit_huge_patch14_224",
                                              "vit_giant_patch14_224", "vit_gigantic_patch14_224"}


def _timm_equal(name: str, tmp_path, img_size=None, **kw) -> float:
    """Save timm's randomly initialised weights, load them into ours, return max |logit difference|."""
    ref = timm.create_model(name, pretrained=False, num_classes=1000, **kw).eval()
    path = tmp_path / "timm.pth"
    torch.save(ref.state_dict(), path)
    ours = vitlab.create_model(name, checkpoint_path=str(path), num_classes=1000, **kw).eval()
    size = img_size or vitlab.get_model_config(name).input_size[-1]
    x = torch.randn(2, 3, size, size)
    with torch.no_grad():
        return (ours(x) - ref(x)).abs().max().item()


@pytest.mark.parametrize("name", sorted(set(VIT_DEIT) - BIG))
def test_equal_to_timm(name, tmp_path):
    assert _timm_equal(name, tmp_path) <= 1e-4


@pytest.mark.parametrize("name", sorted(BIG))
def test_equal_to_timm_big_configs_reduced_depth(name, tmp_path):
    """The full widths and patch sizes, two blocks deep (the full depth runs under -m slow)."""
    assert _timm_equal(name, tmp_path, depth=2) <= 1e-4


@pytest.fixture
def one_at_a_time(tmp_path_factory):
    """An exclusive lock shared by the pytest-xdist workers: the full-size giants (ViT-G/14 holds ~15 GB with
    timm's copy and the checkpoint) must not run side by side on a 24 GB machine."""
    fcntl = pytest.importorskip("fcntl")
    with open(tmp_path_factory.getbasetemp().parent / "giant_models.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


@pytest.mark.slow
@pytest.mark.usefixtures("one_at_a_time")
@pytest.mark.parametrize("name", sorted(BIG))
def test_equal_to_timm_big_configs_full(name, tmp_path):
    assert _timm_equal(name, tmp_path) <= 1e-4


def test_equal_to_timm_dynamic_img_size(tmp_path):
    ref = timm.create_model("vit_tiny_patch16_224", dynamic_img_size=True).eval()
    path = tmp_path / "w.safetensors"
    from safetensors.torch import save_file

    save_file(ref.state_dict(), str(path))
    ours = vitlab.create_model("vit_tiny_patch16_224", checkpoint_path=str(path), dynamic_img_size=True).eval()
    x = torch.randn(2, 3, 160, 224)  # non-square: 10 x 14 grid, position embeddings resampled bicubically
    with torch.no_grad():
        assert (ours(x) - ref(x)).abs().max().item() <= 1e-4


def test_load_timm_weights_at_another_img_size(tmp_path):
    ref = timm.create_model("vit_tiny_patch16_224", img_size=(96, 128)).eval()
    src = timm.create_model("vit_tiny_patch16_224")
    path = tmp_path / "w.pth"
    torch.save(src.state_dict(), path)
    # timm resamples the 14x14 table to 6x8 when loading; so do we
    from timm.models.vision_transformer import checkpoint_filter_fn

    ref.load_state_dict(checkpoint_filter_fn(src.state_dict(), ref))
    ours = vitlab.create_model("vit_tiny_patch16_224", img_size=(96, 128), checkpoint_path=str(path)).eval()
    x = torch.randn(1, 3, 96, 128)
    with torch.no_grad():
        assert (ours(x) - ref(x)).abs().max().item() <= 1e-4


PARAMS = {
    "vit_tiny_patch16_224": 5.72, "vit_small_patch16_224": 22.05, "vit_base_patch16_224": 86.57,
    "vit_large_patch16_224": 304.33, "vit_huge_patch14_224": 630.76, "vit_giant_patch14_224": 1012.61,
    "vit_gigantic_patch14_224": 1844.44, "deit_tiny_distilled_patch16_224": 5.91,
    "deit_small_distilled_patch16_224": 22.44, "deit_base_distilled_patch16_224": 87.34,
}
GMACS = {"vit_base_patch16_224": 17.58, "deit_tiny_patch16_224": 1.26, "vit_large_patch16_224": 61.6}


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_published_params(name):
    cfg = vitlab.get_model_config(name)
    classes = cfg.extra.get("published_num_classes", 1000)  # timm's ViT-H/14 figure is the head-less model
    prof = vitlab.profile_model(name, num_classes=classes)
    assert prof.params_m == pytest.approx(PARAMS[name], abs=0.006)
    assert cfg.published_params_m == PARAMS[name]


@pytest.mark.parametrize("name", sorted(GMACS))
def test_published_gmacs(name):
    assert vitlab.profile_model(name).gmacs == pytest.approx(GMACS[name], rel=0.01)


def test_distilled_train_returns_both_logits_eval_their_mean():
    model = vitlab.create_model("deit_tiny_distilled_patch16_224", img_size=32, num_classes=4)
    x = torch.randn(2, 3, 32, 32)
    model.train()
    cls_logits, dist_logits = model(x)
    model.eval()
    with torch.no_grad():
        feats = model.forward_features(x)
        a, b = model.head(feats[:, 0]), model.head_dist(feats[:, 1])
        torch.testing.assert_close(model(x), (a + b) / 2)
    assert cls_logits.shape == dist_logits.shape == (2, 4)


def test_unknown_model_lists_close_matches():
    with pytest.raises(vitlab.UnknownModelError, match="close matches: vit_base_patch16_224"):
        vitlab.create_model("vit_bse_patch16_224")


def test_list_models_wildcards():
    assert "deit_tiny_distilled_patch16_224" in vitlab.list_models("deit_*distilled*")
    assert all(n.startswith("vit_") for n in vitlab.list_models("vit_*"))
    assert vitlab.list_models("nothing_*") == []


def test_bad_configurations_raise_clear_errors():
    with pytest.raises(ValueError, match="dim 100 is not divisible by num_heads 3"):
        vitlab.create_model("vit_tiny_patch16_224", embed_dim=100)
    with pytest.raises(ValueError, match="not divisible by the patch size"):
        vitlab.create_model("vit_tiny_patch16_224", img_size=200)
    model = vitlab.create_model("vit_tiny_patch16_224", img_size=200, dynamic_img_pad=True, dynamic_img_size=True)
    assert model(torch.randn(1, 3, 200, 120)).shape == (1, 1000)
    with pytest.raises(ValueError, match="global_pool='token' needs a class token"):
        vitlab.create_model("vit_tiny_patch16_224", class_token=False)


@pytest.mark.parametrize("pos_embed", ["learn", "sincos", "rope", "none"])
@pytest.mark.parametrize("pool", ["token", "avg", "max", "attn"])
def test_position_embeddings_and_pools(pos_embed, pool):
    model = vitlab.create_model("vit_tiny_patch16_224", img_size=48, depth=2, pos_embed=pos_embed,
                                global_pool=pool, reg_tokens=2, dynamic_img_size=True, num_classes=3)
    for size in ((48, 48), (32, 64)):
        out = model(torch.randn(2, 3, *size))
        assert out.shape == (2, 3) and torch.isfinite(out).all()
    assert model.num_prefix_tokens == 3


def test_swiglu_rmsnorm_qknorm_layerscale_variant():
    model = vitlab.create_model("vit_small_patch16_224", img_size=32, mlp_layer="swiglu", norm_layer="rmsnorm",
                                qk_norm=True, init_values=1e-5, act_layer="gelu_tanh")
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, 1000)
    assert model.blocks[0].mlp.fc1.out_features == 2 * 1024


def test_forward_intermediates_norm_and_nlc():
    model = vitlab.create_model("vit_tiny_patch16_224", img_size=64, depth=3).eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        final, inter = model.forward_intermediates(x, indices=[0, -1], norm=True, output_fmt="NLC")
        assert [t.shape for t in inter] == [(2, 16, 192)] * 2
        torch.testing.assert_close(inter[-1], model.forward_features(x)[:, 1:])
        nchw = model.forward_intermediates(x, indices=2, intermediates_only=True)
        assert [t.shape for t in nchw] == [(2, 192, 4, 4)] * 2
    with pytest.raises(ValueError):
        model.forward_intermediates(x, indices=[5])


def test_conv_stem_by_name():
    """embed_layer='conv_stem' (Xiao et al., 2021): the same token grid, the stem learns with the rest."""
    plain = vitlab.create_model("vit_tiny_patch16_224", img_size=64, num_classes=3)
    model = vitlab.create_model("vit_tiny_patch16_224", img_size=64, num_classes=3, embed_layer="conv_stem")
    assert type(model.patch_embed).__name__ == "ConvStemEmbed"
    assert model.patch_embed.grid_size == plain.patch_embed.grid_size == (4, 4)
    x = torch.randn(2, 3, 64, 64)
    assert model.forward_features(x).shape == plain.forward_features(x).shape == (2, 17, 192)
    model(x).sum().backward()
    assert model.patch_embed.stem[0].weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="unknown embed_layer"):
        vitlab.create_model("vit_tiny_patch16_224", embed_layer="convstem")
