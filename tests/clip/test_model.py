"""vitlab's CLIP models: every registered configuration trains (all parameters get gradients), checkpoints its
activations, declares FSDP units and is profiled image + text; the text towers are causal and pool the
end-of-text token; a hierarchical image model plugs in through its pooled features."""

from __future__ import annotations

import pytest
import torch

import vitlab
from vitlab.clip import CLIP, TextTransformer, build_clip
from vitlab.profile import count_macs

NAMES = vitlab.list_models(task="contrastive")


def _smoke(name):
    cfg = vitlab.get_model_config(name)
    model = vitlab.create_model(name, **cfg.smoke_kwargs)
    size = cfg.smoke_kwargs.get("img_size", cfg.input_size[1])
    x = torch.randn(2, cfg.input_size[0], size, size)
    text = torch.randint(1, model.text.vocab_size - 1, (2, model.context_length))
    text[:, -3] = model.text.vocab_size - 1
    return model, x, text


def test_registered():
    assert {"clip_vit_base_patch16", "clip_vit_base_patch32", "clip_vit_large_patch14"} <= set(NAMES)
    assert all(vitlab.get_model_config(n).family == "clip" for n in NAMES)
    assert vitlab.list_models("clip_*") == NAMES  # every CLIP is registered with task 'contrastive'


@pytest.mark.parametrize("name", NAMES)
def test_train_step_checkpointing_and_shard_units(name):
    model, x, text = _smoke(name)
    assert isinstance(model, CLIP)
    img, txt, scale = model(x, text)
    assert img.shape == txt.shape == (2, model.embed_dim)
    torch.testing.assert_close(img.norm(dim=-1), torch.ones(2))
    torch.testing.assert_close(scale, torch.tensor(1 / 0.07))
    (scale * img @ txt.T).logsumexp(-1).sum().backward()
    assert not [n for n, p in model.named_parameters() if p.grad is None]
    model.set_grad_checkpointing(True)
    torch.testing.assert_close(model(x, text)[0], img)
    units = model.shard_units()
    assert units[-1] is model.text.blocks[-1] and len(units) == len(model.visual.trunk.blocks) + len(model.text.blocks)
    assert {"logit_scale", "text.pos_embed"} <= model.no_weight_decay()


@pytest.mark.parametrize("style", ["clip", "llama"])
def test_text_tower_is_causal_and_pools_end_of_text(style):
    tower = TextTransformer(vocab_size=40, context_length=10, width=32, depth=2, num_heads=2, embed_dim=16,
                            style=style).eval()
    text = torch.tensor([[3, 5, 7, 39, 0, 0, 0, 0, 0, 0]])
    out = tower(text)
    changed = text.clone()
    changed[0, 5:] = 12  # after the end-of-text token: unseen by a causal tower
    torch.testing.assert_close(tower(changed), out)
    earlier = text.clone()
    earlier[0, 1] = 6  # before it: seen
    assert not torch.allclose(tower(earlier), out)
    if style == "llama":  # RoPE, RMSNorm, SwiGLU, no learned positions
        assert tower.pos_embed is None and tower.rope is not None
        assert type(tower.norm).__name__ == "RMSNorm" and type(tower.blocks[0].mlp).__name__ == "SwiGLU"
    with pytest.raises(ValueError, match="longer than the context length"):
        tower(torch.zeros(1, 11, dtype=torch.long))
    with pytest.raises(ValueError, match="unknown text tower style"):
        TextTransformer(style="gpt")


def test_hierarchical_image_tower_through_pooling():
    model = build_clip(32, "pvt_tiny", {"depths": (1, 1, 1, 1), "img_size": 64}, dict(
        vocab_size=30, context_length=8, width=32, depth=1, num_heads=2), image_pre_norm=False)
    assert model.encode_image(torch.randn(2, 3, 64, 64)).shape == (2, 32)
    with pytest.raises(ValueError, match="pre-norm needs a ViT trunk"):
        build_clip(32, "pvt_tiny", {"depths": (1, 1, 1, 1), "img_size": 64}, {})


def test_profile_counts_both_towers():
    model = vitlab.create_model("clip_vit_pico_patch8")
    prof = vitlab.profile_model("clip_vit_pico_patch8", activations=False)
    image = count_macs(model.visual, torch.zeros(1, 1, 32, 32))
    text = count_macs(model.text, torch.zeros(1, model.context_length, dtype=torch.long))
    assert image > 0 and text > 0 and prof.gmacs * 1e9 == pytest.approx(image + text)
    assert prof.params_m * 1e6 == sum(p.numel() for p in model.parameters())


def test_a_run_of_an_image_model_builds_its_tower_with_the_models_own_embed_dim():
    """clip_for_task's model_kwargs are the image model's (a ViT's embed_dim among them); the joint width is its own
    argument, so the two never collide."""
    from vitlab.clip.model import clip_for_task

    model = clip_for_task("vit_pico_patch8_32", 32, 1, vocab_size=50, context_length=8, joint_dim=24, embed_dim=32)
    assert model.visual.trunk.embed_dim == 32
    assert model.encode_image(torch.randn(2, 1, 32, 32)).shape == (2, 24)
