"""LeViT: published sizes, equality with timm for the same weights, BatchNorm fusion, the feature pyramid,
input checks, resolution handling, compile."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import vitlab
from tests.conftest import check_published, check_published_params, timm_pair
from vitlab.attention import OffsetBiasAttentionBase
from vitlab.models.levit import Levit

NAMES = ["levit_128s", "levit_128", "levit_192", "levit_256", "levit_384"]
SMALL = dict(img_size=64, depth=(1, 1, 1))


def _tolerance(published: float) -> float:
    """1% for a figure of three or more significant digits, 3% for one of two (7.8M, 11M, 39M)."""
    digits = len(f"{published:g}".replace(".", "").lstrip("0"))
    return 0.03 if digits <= 2 else 0.01


def _randomize(model: nn.Module, seed: int = 0) -> nn.Module:
    """Non-trivial BatchNorm affine and running statistics, attention biases and heads (the init zeroes the
    residual branches' BatchNorm weights and biases, which would make most comparisons vacuous)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.weight.copy_(torch.rand(m.weight.shape, generator=g) + 0.5)
                m.bias.copy_(torch.randn(m.bias.shape, generator=g) * 0.1)
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)
        for name, p in model.named_parameters():
            if "attention_biases" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif name.startswith("head") and name.endswith("linear.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model


def _timm_pair(name: str, tmp_path, **kwargs):
    return timm_pair(name, tmp_path, prepare=_randomize, **kwargs)


# ---- published figures --------------------------------------------------------------------------------------
def _check_published(name):
    cfg = vitlab.get_model_config(name)
    check_published(name, _tolerance(cfg.published_params_m), _tolerance(cfg.published_gmacs * 1000))


def test_published_params_and_gmacs_128s():
    _check_published("levit_128s")


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES[1:])
def test_published_params_and_gmacs(name):
    _check_published(name)


@pytest.mark.parametrize("name", NAMES[1:])
def test_published_params(name):
    """The parameter counts alone (cheap: the model is built on the meta device, nothing runs)."""
    check_published_params(name, rel=_tolerance(vitlab.get_model_config(name).published_params_m))


@pytest.mark.parametrize("name", ["levit_128s_ablation_a1", "levit_128s_ablation_a6"])
def test_ablations_keep_levit_128s_flops(name):
    """LeViT's ablations (Graham et al., 2021): A1 and A6 are built to keep LeViT-128S's FLOP count (305M)."""
    prof = vitlab.profile_model(name)
    assert prof.gmacs == pytest.approx(0.305, rel=0.03)


def test_ablation_shapes():
    with torch.device("meta"):
        a1 = vitlab.create_model("levit_128s_ablation_a1")
        a6 = vitlab.create_model("levit_128s_ablation_a6")
    # A1: one stage of 11 blocks at 14x14, D = 19, N = 3, C = 114 (values 2D per head: 3 * 38 = 114)
    assert len(a1.stages) == 1 and len(a1.stages[0].blocks) == 11 and a1.stages[0].resolution == (14, 14)
    att = a1.stages[0].blocks[0].attn
    assert (att.key_dim, att.num_heads, att.val_attn_dim, a1.num_features) == (19, 3, 114, 114)
    # A6: D = 30 for Q, K and V, C = ND = 120/180/240, MLP ratio 4, shrinking attentions with 16 and 24 heads
    assert a6.embed_dim == (120, 180, 240)
    for stage, heads in zip(a6.stages, (4, 6, 8), strict=True):
        att = stage.blocks[0].attn
        assert (att.key_dim, att.val_dim, att.num_heads) == (30, 30, heads)
        assert stage.blocks[0].mlp.ln1.linear.out_features == 4 * att.num_heads * 30
    for stage, heads in zip(a6.stages[1:], (16, 24), strict=True):
        down = stage.downsample.attn_downsample
        assert (down.num_heads, down.key_dim, down.val_dim) == (heads, 30, 30)


# ---- timm equality ---------------------------------------------------------------------------------------------
def _check_timm(name, tmp_path, batch=2):
    ref, ours = _timm_pair(name, tmp_path)
    x = torch.randn(batch, 3, 224, 224)
    with torch.no_grad():
        a, b = ref(x), ours(x)
        fa, fb = ref.forward_features(x), ours.forward_features(x)
    assert a.abs().max() > 0.1  # non-trivial logits
    assert (fa - fb).abs().max() < 1e-4
    assert (a - b).abs().max() < 1e-4
    return ours, x, a


def test_timm_equality_128s(tmp_path):
    _check_timm("levit_128s", tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES[1:])
def test_timm_equality_all(name, tmp_path):
    ours, x, a = _check_timm(name, tmp_path)
    with torch.no_grad():
        assert (ours.fuse()(x) - a).abs().max() < 1e-4


def test_timm_equality_train_mode_small(tmp_path):
    """Train mode (batch statistics, a distilled model's two logits) matches timm's in distilled training."""
    ref, ours = _timm_pair("levit_128s", tmp_path, img_size=64)
    ref.train().set_distilled_training(True)
    ours.train()
    x = torch.randn(4, 3, 64, 64)
    (a, a_dist), (b, b_dist) = ref(x), ours(x)
    assert (a - b).abs().max() < 1e-4 and (a_dist - b_dist).abs().max() < 1e-4


# ---- fuse ---------------------------------------------------------------------------------------------------
def test_fuse_same_outputs():
    torch.manual_seed(0)
    model = _randomize(vitlab.create_model("levit_128s")).eval()
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        ref = model(x)
        feats = model.forward_features(x)
        fused = model.fuse()
        out = fused(x)
        assert (fused.forward_features(x) - feats).abs().max() < 1e-5
    assert (out - ref).abs().max() < 1e-5
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in fused.modules())
    assert fused.fused and not fused.training
    attns = [m for m in fused.modules() if isinstance(m, OffsetBiasAttentionBase)]
    assert len(attns) == 2 + 3 + 4 + 2  # blocks + shrinking attentions, each with its bias gathered once
    for m in attns:
        assert torch.equal(m.attention_bias_folded, m.attention_biases[:, m.attention_bias_idxs])
    assert not any("attention_bias_folded" in k for k in fused.state_dict())  # derived, timm's keys unchanged


def test_fuse_small_configs_and_train_after_fuse():
    for name in ("levit_128s_ablation_a1", "levit_128s_ablation_a6"):
        model = _randomize(vitlab.create_model(name, img_size=64)).eval()
        x = torch.randn(2, 3, 64, 64)
        with torch.no_grad():
            ref = model(x)
            assert (model.fuse()(x) - ref).abs().max() < 1e-5
    model.train()  # a fused model still runs (and backpropagates) in train mode
    y, y_dist = model(x)
    (y.sum() + y_dist.sum()).backward()


# ---- API --------------------------------------------------------------------------------------------------------
def test_forward_intermediates_pyramid():
    model = _randomize(vitlab.create_model("levit_128s")).eval()
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        final, feats = model.forward_intermediates(x)
        assert torch.equal(final, model.forward_features(x))
        assert [tuple(f.shape) for f in feats] == [(2, 128, 14, 14), (2, 256, 7, 7), (2, 384, 4, 4)]
        assert [i["reduction"] for i in model.feature_info] == [16, 32, 64]
        assert [i["num_chs"] for i in model.feature_info] == [128, 256, 384]
        # NCHW is the (B, N, C) token grid, row-major
        nlc = model.forward_intermediates(x, indices=[1], output_fmt="NLC", intermediates_only=True)[0]
        assert torch.equal(nlc.transpose(1, 2).reshape(2, 256, 7, 7), feats[1])
        only = model.forward_intermediates(x, indices=1, intermediates_only=True, stop_early=True)
        assert len(only) == 1 and torch.equal(only[0], feats[2])
        first = model.forward_intermediates(x, indices=[0], intermediates_only=True)
        assert torch.equal(first[0], feats[0])
    with pytest.raises(ValueError):
        model.forward_intermediates(x, output_fmt="NHWC")


def test_distilled_outputs_and_head_api():
    model = vitlab.create_model("levit_128s", **SMALL)
    x = torch.randn(3, 3, 64, 64)
    model.train()
    out = model(x)
    assert isinstance(out, tuple) and out[0].shape == (3, 1000)
    model.set_distilled_training(False)
    assert model(x).shape == (3, 1000)
    model.eval()
    with torch.no_grad():
        feats = model.forward_features(x)
        pooled = model.forward_head(feats, pre_logits=True)
        assert pooled.shape == (3, 384)
        assert torch.allclose(model(x), (model.head(pooled) + model.head_dist(pooled)) / 2, atol=1e-6)
    model.reset_classifier(10)
    assert model(x).shape == (3, 10) and model.num_classes == 10
    model.reset_classifier(0)
    assert model(x).shape == (3, 384)
    assert all("attention_biases" in k for k in model.no_weight_decay())
    assert len(model.no_weight_decay()) == 3 + 2  # 3 blocks + 2 shrinking attentions
    assert isinstance(model.get_classifier(), nn.Module)


def test_grad_checkpointing_same_gradients():
    torch.manual_seed(0)
    model = _randomize(vitlab.create_model("levit_128s", **SMALL)).train()
    model.set_distilled_training(False)
    x = torch.randn(2, 3, 64, 64)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model(x).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.load_state_dict(state)  # BatchNorm running statistics moved: restore them
    model.zero_grad()
    model.set_grad_checkpointing(True)
    model(x).sum().backward()
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, grads[n], atol=1e-5), n


def test_in_chans_and_bad_input():
    model = vitlab.create_model("levit_128s", in_chans=1, **SMALL).eval()
    with torch.no_grad():
        assert model(torch.randn(2, 1, 64, 64)).shape == (2, 1000)
    with pytest.raises(ValueError, match="input channels"):
        model(torch.randn(2, 3, 64, 64))
    with pytest.raises(ValueError, match="attention biases are tied"):
        model(torch.randn(2, 1, 96, 96))
    with pytest.raises(ValueError):
        vitlab.create_model("levit_128s", global_pool="token")


def test_other_resolution_and_bias_fitting(tmp_path):
    """A model built for another size runs; a 224 checkpoint loads into it (bias tables fitted to the grid:
    known offsets keep their bias)."""
    src = _randomize(vitlab.create_model("levit_128s", **SMALL))
    path = tmp_path / "small.pth"
    torch.save(src.state_dict(), path)
    big = vitlab.create_model("levit_128s", img_size=96, depth=(1, 1, 1), checkpoint_path=str(path)).eval()
    assert big.grid_size == (6, 6)
    with torch.no_grad():
        assert big(torch.randn(1, 3, 96, 96)).shape == (1, 1000)
    b_src = src.stages[0].blocks[0].attn.attention_biases.reshape(4, 4, 4)
    b_big = big.stages[0].blocks[0].attn.attention_biases.reshape(4, 6, 6)
    assert torch.equal(b_big[:, :4, :4], b_src)
    assert torch.equal(b_big[:, 5, :4], b_src[:, 3])  # a new, larger offset takes the largest known one's bias
    odd = vitlab.create_model("levit_128s", img_size=(80, 48), depth=(1, 1, 1)).eval()  # 5x3 -> 3x2 -> 2x1
    with torch.no_grad():
        _, feats = odd.forward_intermediates(torch.randn(1, 3, 80, 48))
    assert [tuple(f.shape[-2:]) for f in feats] == [(5, 3), (3, 2), (2, 1)]


def test_checkpoint_with_other_classifier(tmp_path):
    src = vitlab.create_model("levit_128s", **SMALL)
    path = tmp_path / "src.pth"
    torch.save(src.state_dict(), path)
    with pytest.warns(UserWarning, match="not loaded"):
        model = vitlab.create_model("levit_128s", num_classes=10, checkpoint_path=str(path), **SMALL)
    assert torch.equal(model.stem.conv1.linear.weight, src.stem.conv1.linear.weight)
    assert model.head.linear.weight.shape == (10, 384)


def test_attention_bias_follows_parameters():
    """The bias is gathered from the table on every call: an in-place update shows at once, and the table gets a
    gradient in eval mode too."""
    model = _randomize(vitlab.create_model("levit_128s", **SMALL)).eval()
    x = torch.randn(2, 3, 64, 64)
    attn = model.stages[0].blocks[0].attn
    with torch.no_grad():
        y0 = model(x)
        attn.attention_biases.add_(1.0 + torch.arange(16.0))
        y1 = model(x)
    assert not torch.allclose(y0, y1)
    model.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.equal(model(x), y1)
    model(x).sum().backward()
    assert attn.attention_biases.grad is not None and attn.attention_biases.grad.abs().sum() > 0


def test_explicit_path_equals_sdpa_with_the_bias_as_mask():
    """The one path (softmax(q k^T s + bias) v) is the function SDPA computes with the gathered bias as a mask."""
    model = _randomize(vitlab.create_model("levit_128s", **SMALL)).eval()
    attn = model.stages[1].downsample.attn_downsample  # queries on the subsampled grid: Nq != Nk
    q, k, v = torch.randn(2, attn.num_heads, 4, 16), torch.randn(2, attn.num_heads, 16, 16), torch.randn(
        2, attn.num_heads, 16, 64)
    with torch.no_grad():
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=attn.get_attention_biases(), scale=attn.scale)
        torch.testing.assert_close(attn._attend(q, k, v), ref, rtol=1e-5, atol=1e-5)


def test_batch_one_training_forward_and_meta():
    model = vitlab.create_model("levit_128s", **SMALL).train()
    out = model(torch.randn(1, 3, 64, 64))  # BatchNorm over a single row falls back to running statistics
    assert out[0].shape == (1, 1000)
    with torch.device("meta"):
        meta = vitlab.create_model("levit_256").eval()
    assert meta(torch.empty(2, 3, 224, 224, device="meta")).shape == (2, 1000)


@pytest.mark.slow
def test_compile_no_graph_breaks_eager_backend():
    """Dynamo traces the whole model in one graph (fullgraph) in eval, fused and train mode."""
    torch._dynamo.reset()
    model = _randomize(vitlab.create_model("levit_128s", **SMALL)).eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        ref = model(x)
        assert torch.allclose(torch.compile(model, fullgraph=True, backend="eager")(x), ref, atol=1e-6)
    model.train()
    out = torch.compile(model, fullgraph=True, backend="eager")(x)
    assert isinstance(out, tuple)
    torch._dynamo.reset()


@pytest.mark.slow
def test_compile_inductor_fullgraph():
    torch._dynamo.reset()
    model = _randomize(vitlab.create_model("levit_128s", **SMALL)).eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        ref = model(x)
        assert (torch.compile(model, fullgraph=True)(x) - ref).abs().max() < 1e-4
        model.fuse()
        assert (torch.compile(model, fullgraph=True)(x) - ref).abs().max() < 1e-4
    torch._dynamo.reset()


def test_registry_configs():
    for name in NAMES + ["levit_128s_ablation_a1", "levit_128s_ablation_a6"]:
        cfg = vitlab.get_model_config(name)
        assert cfg.family == "levit" and cfg.smoke_kwargs
        model = vitlab.create_model(name, **cfg.smoke_kwargs)
        assert isinstance(model, Levit)
    assert math.isclose(_tolerance(7.8), 0.03) and math.isclose(_tolerance(305), 0.01)
