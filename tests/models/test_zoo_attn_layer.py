"""ViT, DeiT and CaiT take any mechanism of the attention zoo (``attn_layer=``, by name or class) that works on
their token layout; a grid mechanism with prefix tokens is refused with one clear ValueError when the model is
built."""

from __future__ import annotations

import pytest
import torch

import vitlab
from vitlab.attention import accepts_prefix_tokens, get_attention, list_attention

ZOO = list_attention()
SMALL = dict(img_size=64, patch_size=16, embed_dim=64, depth=1, num_heads=4, num_classes=3)  # a 4x4 grid


def _forward_backward(model, x):
    model.train()
    out = model(x)
    out = sum(out) / len(out) if isinstance(out, tuple) else out
    assert out.shape == (x.shape[0], 3) and torch.isfinite(out).all()
    out.square().mean().backward()
    assert all(p.grad is not None for p in model.blocks[0].attn.parameters() if p.requires_grad)


@pytest.mark.parametrize("name", ZOO)
@pytest.mark.parametrize("family", ["vit_tiny_patch16_224", "deit_tiny_distilled_patch16_224"])
def test_vit_and_deit_take_any_zoo_mechanism(family, name):
    x = torch.randn(2, 3, 64, 64)
    if accepts_prefix_tokens(name):
        model = vitlab.create_model(family, attn_layer=name, **SMALL)
        assert isinstance(model.blocks[0].attn, get_attention(name))
        _forward_backward(model, x)
    else:
        with pytest.raises(ValueError, match="no prefix tokens"):
            vitlab.create_model(family, attn_layer=name, **SMALL)
        if family.startswith("vit"):  # without a class token the grid mechanism runs
            model = vitlab.create_model(family, attn_layer=name, class_token=False, global_pool="avg", **SMALL)
            _forward_backward(model, x)


@pytest.mark.parametrize("name", ZOO)
def test_cait_self_attention_takes_any_zoo_mechanism(name):
    """CaiT's self-attention blocks see only the patch grid: every mechanism works, grid ones included."""
    model = vitlab.create_model("cait_xxs24_224", attn_layer=name, img_size=64, embed_dim=64, depth=1,
                                num_heads=4, num_classes=3)
    assert isinstance(model.blocks[0].attn, get_attention(name))
    _forward_backward(model, torch.randn(2, 3, 64, 64))


def test_attn_layer_as_a_class_and_with_options():
    from vitlab.attention.hilo import HiLo

    model = vitlab.create_model("vit_tiny_patch16_224", attn_layer=HiLo, attn_kwargs={"alpha": 0.5},
                                class_token=False, global_pool="avg", **SMALL).eval()
    assert isinstance(model.blocks[0].attn, HiLo)
    with torch.no_grad():
        assert model(torch.randn(1, 3, 64, 64)).shape == (1, 3)


def test_layout_arguments_are_passed_and_rope_is_checked():
    # Linformer's sequence projections are sized for the model's grid and prefix tokens
    model = vitlab.create_model("deit_tiny_distilled_patch16_224", attn_layer="linformer", **SMALL)
    attn = model.blocks[0].attn
    assert attn.num_prefix_tokens == 2 and attn.grid_size == (4, 4)
    with pytest.raises(ValueError, match="rope"):
        vitlab.create_model("vit_tiny_patch16_224", attn_layer="sra", pos_embed="rope", **SMALL)
    with pytest.raises(ValueError, match="unknown attention"):
        vitlab.create_model("vit_tiny_patch16_224", attn_layer="nope", **SMALL)


def test_cait_default_is_talking_heads():
    from vitlab.models.cait import TalkingHeadAttn

    model = vitlab.create_model("cait_xxs24_224", img_size=64, depth=1)
    assert isinstance(model.blocks[0].attn, TalkingHeadAttn)
