"""The one-page ViT (:mod:`vitlab.models.simple_vit`) computes what the registry's plain ViTs compute: the same
weights give the same logits, for mean-pooled and class-token configs."""

import pytest
import torch

import vitlab
from vitlab.models.simple_vit import ViT, from_timm_keys


def _perturbed(name: str, **kwargs) -> torch.nn.Module:
    """A registry model whose every parameter (zero biases and unit norms included) is moved off its init, so a
    wrongly mapped bias or norm shows in the logits."""
    torch.manual_seed(0)
    model = vitlab.create_model(name, **kwargs).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("name, config, batch", [
    ("vit_pico_patch8_32", dict(image_size=32, patch_size=8, num_classes=10, dim=64, depth=4, heads=4, mlp_dim=128,
                                pool="mean", channels=1), 8),
    ("deit_tiny_patch16_224", dict(image_size=224, patch_size=16, num_classes=1000, dim=192, depth=12, heads=3,
                                   mlp_dim=768), 2),
    ("vit_small_patch16_224", dict(image_size=224, patch_size=16, num_classes=1000, dim=384, depth=12, heads=6,
                                   mlp_dim=1536), 2),
])
def test_same_weights_same_logits(name, config, batch):
    reference = _perturbed(name)
    vit = ViT(**config).eval()
    vit.load_state_dict(from_timm_keys(reference.state_dict()))  # strict: every key maps, none is left over
    x = torch.randn(batch, config.get("channels", 3), config["image_size"], config["image_size"])
    with torch.no_grad():
        ours, theirs = vit(x), reference(x)
    assert ours.shape == (batch, config["num_classes"])
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_pooling_and_weights_matter():
    """A mean-pooled model read as class-token pooled, or with one block's heads miscounted, gives other logits."""
    reference = _perturbed("vit_pico_patch8_32")
    sd = from_timm_keys(reference.state_dict())
    x = torch.randn(4, 1, 32, 32)
    base = dict(image_size=32, patch_size=8, num_classes=10, dim=64, depth=4, mlp_dim=128, channels=1)
    for wrong in (dict(heads=4, pool="cls"), dict(heads=2, pool="mean")):
        vit = ViT(**base, **wrong).eval()
        vit.load_state_dict(sd)
        with torch.no_grad():
            assert not torch.allclose(vit(x), reference(x), atol=1e-3)


def test_refuses_what_it_does_not_have():
    distilled = vitlab.create_model("deit_tiny_distilled_patch16_224", depth=1, img_size=32)
    with pytest.raises(ValueError, match="dist_token has no place"):
        from_timm_keys(distilled.state_dict())
    with pytest.raises(ValueError, match="multiple of the patch size"):
        ViT(image_size=30, patch_size=8, num_classes=10, dim=64, depth=1, heads=4, mlp_dim=128)
    with pytest.raises(ValueError, match="pool must be"):
        ViT(image_size=32, patch_size=8, num_classes=10, dim=64, depth=1, heads=4, mlp_dim=128, pool="max")
