"""The public token interface of the plain-ViT family (:class:`vitlab.models.TokenModel`): what it computes, and
that the capabilities built on it (token merging, pruning, DINOv2's masked tokens, attention analysis, the
ViT-Adapter) give the numbers they gave when they reached into private members.

``token_interface_reference.json`` holds fixed-seed statistics (sum, absolute sum, first three values) of each
output, computed by the code before the capabilities moved onto the interface; every case is recomputed here
through the public API and must agree: the sums within 1e-6 of the absolute sum (a sum of gradients or of
normalised tokens sits near 0, where the summation order of the threads decides its last digits), each value
within 1e-4 of itself with a floor of 1e-3 (fp32 GEMM kernels differ between AVX2 and AVX-512 machines in the
last bits, and a gradient carries those differences through every layer; a changed computation moves the values
by far more)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import vitlab
import vitlab.prune as prune
import vitlab.tome as tome
from vitlab.analysis.attention import capture_attention
from vitlab.models import TokenModel, mix_in, mix_out, mixin_of

REFERENCE = json.loads((Path(__file__).parent / "token_interface_reference.json").read_text())
CASES = {
    "vit": ("vit_tiny_patch16_224", dict(img_size=64, depth=2)),
    "vit_avg": ("vit_tiny_patch16_224", dict(img_size=64, depth=2, global_pool="avg")),
    "deit_dist": ("deit_tiny_distilled_patch16_224", dict(img_size=64, depth=2)),
    "halvit": ("halvit_tiny_patch16_224", dict(img_size=64, depth=2)),
    "cait": ("cait_xxs24_224", dict(img_size=64, depth=2)),
}


def stats(t: torch.Tensor) -> list[float]:
    t = t.detach().double()
    return [float(t.sum()), float(t.abs().sum()), *[float(v) for v in t.flatten()[:3]]]


def check(key: str, got: list[float], want: list[float] | None = None) -> None:
    want = REFERENCE[key] if want is None else want
    assert len(got) == len(want)
    tolerances = [1e-6 * abs(want[1]), 1e-6 * abs(want[1]), *(1e-4 * max(abs(w), 1e-3) for w in want[2:])]
    for g, w, tol in zip(got, want, tolerances, strict=True):
        assert abs(g - w) <= tol, (key, got, want)


def model(name: str, **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    return vitlab.create_model(name, **kw)


def images(n: int = 2, size: int = 64) -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(n, 3, size, size)


def first(y):
    return y[0] if isinstance(y, tuple) else y


# ---------------------------------------------------------------- against the numbers of the code before


@pytest.mark.parametrize("key", ["vit", "vit_avg", "deit_dist", "halvit", "cait"])
def test_tome_unchanged(key):
    name, kw = CASES[key]
    m = model(name, **kw).eval()
    x = images()
    with torch.no_grad():
        check(f"plain/{key}", stats(m(x)))
        tome.apply(m, r=3, prop_attn=True, trace_source=True)
        check(f"tome/{key}", stats(m(x)))
        feats = m.forward_intermediates(x, indices=[0, 1], output_fmt="NCHW", intermediates_only=True)
    check(f"tome_int/{key}", stats(torch.stack(feats)))
    m.train()
    torch.manual_seed(2)
    first(m(x)).square().mean().backward()
    check(f"tome_grad/{key}", stats(next(p for p in m.parameters() if p.grad is not None).grad))


@pytest.mark.parametrize("key", ["vit", "deit_dist"])
@pytest.mark.parametrize("method", ["evit", "topk", "dynamicvit", "adaptive"])
def test_prune_unchanged(key, method):
    name, kw = CASES[key]
    m = model(name, **kw)
    prune.apply(m, method=method, keep_rate=0.6, locations=[0, 1])
    x = images()
    with torch.no_grad():
        check(f"prune/{key}/{method}/eval", stats(m.eval()(x)))
    m.train()
    torch.manual_seed(3)
    check(f"prune/{key}/{method}/train", stats(first(m(x))))


def test_evit_on_avg_pooled_model_unchanged():
    name, kw = CASES["vit_avg"]
    m = model(name, **kw)
    prune.apply(m, method="evit", keep_rate=0.6, locations=[0, 1])
    with torch.no_grad():
        check("prune/vit_avg/evit/eval", stats(m.eval()(images())))


ANALYSIS = [("vit", "deit_tiny_distilled_patch16_224", dict(img_size=64, depth=2), 64),
            ("halvit", "halvit_tiny_patch16_224", dict(img_size=64, depth=2), 64),
            ("cait", "cait_xxs24_224", dict(img_size=64, depth=2), 64),
            ("swin", "swin_tiny_patch4_window7_224",
             dict(img_size=32, window_size=4, depths=(2, 2), num_heads=(3, 6), embed_dim=48), 32),
            ("pvt", "pvt_tiny", None, None), ("levit", "levit_128s", None, None),
            ("mobilevit", "mobilevit_xxs", None, None)]


@pytest.mark.parametrize("key,name,kw,size", ANALYSIS, ids=[a[0] for a in ANALYSIS])
def test_attention_maps_unchanged(key, name, kw, size):
    kw = vitlab.get_model_config(name).smoke_kwargs if kw is None else kw
    m = model(name, **kw).eval()
    size = size or kw.get("img_size", 224)
    layers = capture_attention(m, images(2, size if isinstance(size, int) else size[0]))
    keys = [k for k in REFERENCE if k.startswith(f"attn/{key}/")]
    assert len(layers) == len(keys)
    for i, lay in enumerate(layers):
        check(f"attn/{key}/{i}/{lay.kind}/{lay.name}/{lay.q_grid}/{lay.k_grid}/{lay.num_prefix}", stats(lay.attn))


def test_dinov2_masked_tokens_unchanged():
    from vitlab.ssl.methods import vit_tokens

    m = model("vit_tiny_patch16_224", img_size=64, depth=2).eval()
    x = images()
    torch.manual_seed(4)
    mask = torch.rand(2, 16) < 0.4
    tok = torch.randn(1, 1, 192)
    with torch.no_grad():
        check("dinov2/tokens", stats(vit_tokens(m, x, mask, tok)))


def test_vit_adapter_unchanged():
    from vitlab.dense.adapter import ViTAdapter

    vit = model("vit_tiny_patch16_224", img_size=64, depth=4, num_classes=0)
    torch.manual_seed(5)
    ad = ViTAdapter(vit, interactions=[[0, 0], [1, 1], [2, 2], [3, 3]]).eval()
    with torch.no_grad():
        feats = ad(images())
    for i, f in enumerate(feats):
        check(f"adapter/{i}", stats(f), REFERENCE["adapter"][i])


# ---------------------------------------------------------------- what the interface computes


@pytest.mark.parametrize("name", ["vit_tiny_patch16_224", "deit_tiny_distilled_patch16_224",
                                  "halvit_tiny_patch16_224", "cait_xxs24_224"])
def test_features_are_embed_blocks_finish(name):
    m = model(name, img_size=64, depth=2).eval()
    assert isinstance(m, TokenModel)
    x = images()
    with torch.no_grad():
        tokens, hw = m.embed(x)
        assert hw == (4, 4) and tokens.shape[1] == m.num_block_prefix_tokens + 16
        y = tokens
        for blk in m.blocks:  # each block is its two residual steps
            step = blk.forward_mlp(blk.forward_attention(y, hw))
            y = blk(y, hw)
            assert torch.equal(step, y)
        assert torch.equal(m.forward_blocks(tokens, hw), y)
        assert torch.equal(m.finish_tokens(y), m.forward_features(x))
        _, q, k = m.blocks[0].forward_attention(tokens, hw, return_qk=True)
        _, attn = m.blocks[0].forward_attention(tokens, hw, return_attn=True)
    assert q.shape == k.shape and q.shape[:3] == (2, m.blocks[0].attn.num_heads, tokens.shape[1])
    assert attn.shape == (2, q.shape[1], tokens.shape[1], tokens.shape[1])


@pytest.mark.parametrize("name", ["vit_tiny_patch16_224", "cait_xxs24_224"])
def test_embed_with_mask_and_kept_patches(name):
    m = model(name, img_size=64, depth=1).eval()
    x = images()
    P = m.num_block_prefix_tokens
    with torch.no_grad():
        full, _ = m.embed(x)
        mask = torch.zeros(2, 16, dtype=torch.bool)
        mask[0, 3] = mask[1, :5] = True
        token = torch.randn(m.embed_dim)
        masked, _ = m.embed(x, mask, token)
        pos = m.pos_embed[:, -16:]  # the patches' position embeddings
        torch.testing.assert_close(masked[:, P:][mask], (token + pos.expand(2, -1, -1)[mask]))
        assert torch.equal(masked[:, P:][~mask], full[:, P:][~mask]) and torch.equal(masked[:, :P], full[:, :P])
        keep = torch.tensor([[0, 5, 7], [15, 1, 2]])
        kept, _ = m.embed(x, keep=keep)
        assert torch.equal(kept[:, :P], full[:, :P])
        assert torch.equal(kept[:, P:], full[:, P:].gather(1, keep[..., None].expand(-1, -1, m.embed_dim)))
    with pytest.raises(ValueError, match="mask_token"):
        m.embed(x, mask)
    with pytest.raises(ValueError, match="mask must be"):
        m.embed(x, mask[:, :4], token)


def test_final_norm_pool_and_cait_key_bias():
    vit = model("vit_tiny_patch16_224", img_size=64, depth=1, global_pool="avg").eval()
    assert vit.final_norm is vit.fc_norm
    x = torch.randn(2, 5, 192)
    size = torch.tensor([1.0, 3.0, 1.0, 1.0, 1.0])[None, :, None].expand(2, -1, -1)
    torch.testing.assert_close(vit.pool(x, size), (x[:, 1:] * size[:, 1:]).sum(1) / size[:, 1:].sum(1))
    with pytest.raises(ValueError, match="does not match"):
        vit.pool(x, size[:, :3])
    cait = model("cait_xxs24_224", img_size=64, depth=1).eval()
    assert cait.final_norm is cait.norm and cait.num_block_prefix_tokens == 0
    with torch.no_grad():
        tokens = cait.forward_blocks(*cait.embed(images()))
        zero = cait.finish_tokens(tokens, torch.zeros(2, 1, 1, 16))
        assert torch.allclose(zero, cait.finish_tokens(tokens), atol=1e-6)
        bias = torch.zeros(2, 1, 1, 16)
        bias[..., 3] = -float("inf")  # the class token no longer sees patch 3
        blocked = cait.finish_tokens(tokens, bias)
        tokens[:, 3] += 100.0
        assert torch.allclose(cait.finish_tokens(tokens, bias)[:, 0], blocked[:, 0], atol=1e-5)


def test_clip_image_tower_trunk_is_a_token_model():
    clip = vitlab.create_model("clip_vit_base_patch16", **vitlab.get_model_config("clip_vit_base_patch16")
                               .smoke_kwargs).eval()
    trunk = clip.visual.trunk
    assert isinstance(trunk, TokenModel)
    x = torch.randn(1, 3, trunk.patch_embed.img_size[0], trunk.patch_embed.img_size[1])
    with torch.no_grad():
        tokens, hw = trunk.embed(x)  # CLIP's ln_pre is part of the embedding
        torch.testing.assert_close(trunk.finish_tokens(trunk.forward_blocks(tokens, hw)), trunk.forward_features(x))


def test_mix_in_and_out():
    class Twice:
        def forward_features(self, x):
            return 2 * super().forward_features(x)

    m = model("vit_tiny_patch16_224", img_size=32, depth=1).eval()
    base, x = type(m), images(1, 32)
    with torch.no_grad():
        ref = m.forward_features(x)
        mix_in(m, Twice)
        assert isinstance(m, base) and type(m).__name__ == "TwiceVisionTransformer" and mixin_of(m) is Twice
        assert torch.equal(m.forward_features(x), 2 * ref)
        with pytest.raises(ValueError, match="already carries the Twice patch"):
            mix_in(m, Twice)
        assert mix_out(m, Twice) and type(m) is base and not mix_out(m, Twice) and mixin_of(m) is None


def test_one_token_reduction_at_a_time():
    m = model("deit_tiny_patch16_224", img_size=64, depth=2)
    prune.apply(m, "evit")
    assert prune.is_applied(m) and not tome.is_applied(m)
    with pytest.raises(ValueError, match="patched with Pruned"):
        tome.apply(m, r=2)
    prune.remove(m)
    tome.apply(m, r=2)
    assert tome.info(m).r == [2, 2]
    with pytest.raises(ValueError, match="already patched"):
        prune.apply(m, "evit")


@pytest.mark.parametrize("name", ["deit_tiny_patch16_224", "deit_tiny_distilled_patch16_224"])
def test_forward_runs_timms_operators(name):
    """The same ATen operators with the same shapes as timm's eager forward (the embedding included: prefix tokens
    in front, then one add of the whole position table), so plain eager does timm's work and no more."""
    timm = pytest.importorskip("timm")
    from torch.profiler import ProfilerActivity, profile

    def ops(model, x):
        with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            model(x)
        return sorted((e.name, str(e.input_shapes)) for e in prof.events() if e.name.startswith("aten::"))

    kw = dict(img_size=32, patch_size=8, depth=1, num_classes=4)
    ref = timm.create_model(name, **kw).eval()
    ours = vitlab.create_model(name, **kw).eval()
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(ours(x), ref(x))
    assert ops(ours, x) == ops(ref, x)
