"""Equality with OpenCLIP (open_clip_torch, a dev-only oracle): an open_clip state dict with random weights loads
into vitlab's CLIP through ``checkpoint_path=`` / :func:`clip_from_openclip` and gives the same image and text
embeddings (within 1e-4). No weights are downloaded."""

from __future__ import annotations

import pytest
import torch

import vitlab
from vitlab.clip import clip_from_openclip
from vitlab.clip.openclip import convert_openclip_state_dict, openclip_config

open_clip = pytest.importorskip("open_clip")


def _perturbed(model):
    """Random-init open_clip weights, every parameter moved off its init (LayerNorms too), so no term hides."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model.eval()


def _texts(context_length, vocab_size, n=3):
    g = torch.Generator().manual_seed(1)
    text = torch.zeros(n, context_length, dtype=torch.long)
    for i, length in enumerate((5, context_length, 9)[:n]):  # short, full (EOT last), middle
        text[i, :length] = torch.randint(1, vocab_size - 1, (length,), generator=g)
        text[i, length - 1] = vocab_size - 1  # the end-of-text token has the largest id
    return text


def _check_equal(ref, ours, img_size, in_chans=3):
    x = torch.randn(2, in_chans, img_size, img_size)
    text = _texts(ref.context_length, ref.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(ours.encode_image(x), ref.encode_image(x), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(ours.encode_text(text), ref.encode_text(text), rtol=1e-4, atol=1e-4)
        a, b, s = ours(x, text)
        ra, rb, rs = ref(x, text)[:3]
        torch.testing.assert_close((a, b, s), (ra, rb, rs), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("quick_gelu", [False, True])
def test_tiny_openclip_config_equal(tmp_path, quick_gelu):
    from open_clip.model import CLIP, CLIPTextCfg, CLIPVisionCfg

    ref = _perturbed(CLIP(48, CLIPVisionCfg(layers=2, width=128, patch_size=8, image_size=32, head_width=64),
                          CLIPTextCfg(context_length=12, vocab_size=300, width=128, heads=2, layers=2),
                          quick_gelu=quick_gelu))
    path = tmp_path / "open_clip_tiny.pt"
    torch.save(ref.state_dict(), path)
    ours = clip_from_openclip(str(path), quick_gelu=quick_gelu).eval()
    assert ours.embed_dim == 48 and ours.context_length == 12
    _check_equal(ref, ours, 32)


def test_config_inference_and_unsupported_keys():
    from open_clip.model import CLIP, CLIPTextCfg, CLIPVisionCfg

    ref = CLIP(32, CLIPVisionCfg(layers=3, width=64, patch_size=4, image_size=16),
               CLIPTextCfg(context_length=8, vocab_size=50, width=64, heads=1, layers=1))
    cfg = openclip_config(ref.state_dict())
    assert cfg["embed_dim"] == 32
    assert (cfg["image_kwargs"]["depth"], cfg["image_kwargs"]["img_size"], cfg["image_kwargs"]["patch_size"]) == (
        3, 16, 4)
    assert (cfg["text_kwargs"]["context_length"], cfg["text_kwargs"]["vocab_size"]) == (8, 50)
    with pytest.raises(ValueError, match="not an open_clip"):
        openclip_config({"a": torch.zeros(1)})
    with pytest.raises(ValueError, match="unsupported open_clip model"):
        convert_openclip_state_dict({**ref.state_dict(), "logit_bias": torch.zeros(())})


@pytest.mark.slow
@pytest.mark.parametrize("name,openclip_name", [("clip_vit_base_patch16", "ViT-B-16"),
                                                ("clip_vit_base_patch32", "ViT-B-32")])
def test_base_configs_equal_openclip(tmp_path, name, openclip_name):
    """The registered ViT-B/16 and B/32 configs load open_clip's random-init ViT-B-16 / ViT-B-32 (no download)."""
    torch.set_num_threads(2)
    ref = _perturbed(open_clip.create_model(openclip_name, pretrained=None))
    path = tmp_path / f"{openclip_name}.pt"
    torch.save(ref.state_dict(), path)
    ours = vitlab.create_model(name, checkpoint_path=str(path)).eval()
    n_ref = sum(p.numel() for p in ref.parameters())
    assert sum(p.numel() for p in ours.parameters()) == n_ref
    assert vitlab.profile_model(name, activations=False).params_m * 1e6 == pytest.approx(n_ref)
    _check_equal(ref, ours, 224)
