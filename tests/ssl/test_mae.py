"""MAE against Hugging Face transformers' ViTMAEForPreTraining (dev-only oracle) with shared random weights."""

from __future__ import annotations

import pytest
import torch

import vitlab
from vitlab.ssl.mae import MAE, patchify, random_masking, reconstruction_png, unpatchify

transformers = pytest.importorskip("transformers")


def _hf_pair(img=32, patch=8, dim=64, depth=2, heads=4, ddim=32, ddepth=2, dheads=4, ratio=0.75, chans=3):
    cfg = transformers.ViTMAEConfig(image_size=img, patch_size=patch, num_channels=chans, hidden_size=dim,
                                    num_hidden_layers=depth, num_attention_heads=heads, intermediate_size=4 * dim,
                                    decoder_hidden_size=ddim, decoder_num_hidden_layers=ddepth,
                                    decoder_num_attention_heads=dheads, decoder_intermediate_size=4 * ddim,
                                    mask_ratio=ratio, norm_pix_loss=True, layer_norm_eps=1e-6,
                                    hidden_act="gelu", attn_implementation="eager")
    ref = transformers.ViTMAEForPreTraining(cfg).eval()
    backbone = vitlab.create_model("vit_tiny_patch16_224", img_size=img, patch_size=patch, in_chans=chans,
                                   embed_dim=dim, depth=depth, num_heads=heads, num_classes=0)
    ours = MAE(backbone, mask_ratio=ratio, decoder_dim=ddim, decoder_depth=ddepth, decoder_heads=dheads).eval()
    with torch.no_grad():
        for p in ours.parameters():  # fresh random values everywhere, then copied into the reference
            p.normal_(0, 0.05)
    ref.decoder.initialize_weights(16)  # its fixed sin-cos table (MAE's h/w layout); the rest is copied from ours
    _copy_into_hf(ours, ref)
    return ours, ref


def _layer(hf_layer, blk):
    a = hf_layer.attention
    q, k, v = blk.attn.qkv.weight.chunk(3)
    qb, kb, vb = blk.attn.qkv.bias.chunk(3)
    pairs = [(hf_layer.layernorm_before.weight, blk.norm1.weight), (hf_layer.layernorm_before.bias, blk.norm1.bias),
             (a.q_proj.weight, q), (a.q_proj.bias, qb), (a.k_proj.weight, k), (a.k_proj.bias, kb),
             (a.v_proj.weight, v), (a.v_proj.bias, vb), (a.o_proj.weight, blk.attn.proj.weight),
             (a.o_proj.bias, blk.attn.proj.bias), (hf_layer.layernorm_after.weight, blk.norm2.weight),
             (hf_layer.layernorm_after.bias, blk.norm2.bias), (hf_layer.mlp.fc1.weight, blk.mlp.fc1.weight),
             (hf_layer.mlp.fc1.bias, blk.mlp.fc1.bias), (hf_layer.mlp.fc2.weight, blk.mlp.fc2.weight),
             (hf_layer.mlp.fc2.bias, blk.mlp.fc2.bias)]
    return pairs


@torch.no_grad()
def _copy_into_hf(ours, ref):
    m, d = ours.model, ours.decoder
    e = ref.vit.embeddings
    pairs = [(e.patch_embeddings.projection.weight, m.patch_embed.proj.weight),
             (e.patch_embeddings.projection.bias, m.patch_embed.proj.bias), (e.cls_token, m.cls_token),
             (e.position_embeddings, m.pos_embed), (ref.vit.layernorm.weight, m.norm.weight),
             (ref.vit.layernorm.bias, m.norm.bias), (ref.decoder.decoder_embed.weight, d.embed.weight),
             (ref.decoder.decoder_embed.bias, d.embed.bias), (ref.decoder.mask_token, d.mask_token),
             (ref.decoder.decoder_norm.weight, d.norm.weight), (ref.decoder.decoder_norm.bias, d.norm.bias),
             (ref.decoder.decoder_pred.weight, d.pred.weight), (ref.decoder.decoder_pred.bias, d.pred.bias)]
    for hf, blk in zip(ref.vit.layers, m.blocks, strict=True):
        pairs += _layer(hf, blk)
    for hf, blk in zip(ref.decoder.decoder_layers, d.blocks, strict=True):
        pairs += _layer(hf, blk)
    for dst, src in pairs:
        dst.copy_(src)


def test_decoder_positions_are_maes_fixed_sincos():
    ours, ref = _hf_pair()
    torch.testing.assert_close(ours.decoder.pos_embed, ref.decoder.decoder_pos_embed.detach())


@pytest.mark.parametrize("chans", [3, 1])
def test_mae_equals_transformers(chans):
    torch.manual_seed(0)
    ours, ref = _hf_pair(chans=chans)
    x = torch.randn(3, chans, 32, 32)
    noise = torch.rand(3, 16)
    with torch.no_grad():
        want = ref(pixel_values=x, noise=noise)
        got = ours(x, noise=noise)
    torch.testing.assert_close(got["mask"], want.mask)
    torch.testing.assert_close(got["pred"], want.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got["loss"], want.loss, atol=1e-5, rtol=1e-5)


def test_masking_keeps_the_lowest_noise():
    x = torch.arange(8.0).view(1, 8, 1).repeat(2, 1, 3)
    noise = torch.tensor([[0.9, 0.1, 0.8, 0.2, 0.7, 0.3, 0.6, 0.4], [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7]])
    kept, mask, restore = random_masking(x, 0.75, noise)
    assert kept[:, :, 0].tolist() == [[1.0, 3.0], [0.0, 1.0]]
    assert mask.tolist() == [[1, 0, 1, 0, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1, 1]]
    assert torch.equal(torch.argsort(torch.argsort(noise, 1), 1), restore)


def test_patchify_roundtrip_and_png():
    x = torch.randn(2, 3, 16, 16)
    p = patchify(x, 4)
    assert p.shape == (2, 16, 48)
    torch.testing.assert_close(unpatchify(p, 4, (4, 4), 3), x)
    backbone = vitlab.create_model("vit_pico_patch8_32", num_classes=0)
    mae = MAE(backbone, decoder_dim=32, decoder_depth=1, decoder_heads=4).eval()
    imgs = torch.randn(3, 1, 32, 32)
    rec, m = mae.reconstruct(imgs)
    assert rec.shape == imgs.shape and m.shape == imgs.shape
    assert m.mean().item() == pytest.approx(12 / 16)  # 12 of 16 patches masked
    png = reconstruction_png(imgs, rec, m, mean=[0.5], std=[0.5])
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("name", ["deit_tiny_patch16_224", "halvit_tiny_patch16_224"])
def test_mae_trains_on_plain_vit_families(name):
    backbone = vitlab.create_model(name, img_size=32, patch_size=8, embed_dim=64, depth=1, num_heads=2,
                                   dim_head=32, num_classes=0) if name.startswith("halvit") else \
        vitlab.create_model(name, img_size=32, patch_size=8, embed_dim=64, depth=1, num_heads=2, num_classes=0)
    mae = MAE(backbone, decoder_dim=32, decoder_depth=1, decoder_heads=4)
    out = mae(torch.randn(2, 3, 32, 32))
    out["loss"].backward()
    assert backbone.blocks[0] is mae.model.blocks[0]
    assert all(p.grad is not None for n, p in backbone.named_parameters() if "head" not in n and p.requires_grad)


def test_mae_bad_input():
    with pytest.raises(ValueError, match="plain ViT"):
        MAE(vitlab.create_model("swin_tiny_patch4_window7_224", **vitlab.get_model_config(
            "swin_tiny_patch4_window7_224").smoke_kwargs))
    with pytest.raises(ValueError, match=r"mask_ratio must be in \(0, 1\)"):
        MAE(vitlab.create_model("vit_pico_patch8_32"), mask_ratio=1.0)


def _hand_written_encode(mae: MAE, imgs, noise):
    """MAE's encoder spelled out on the backbone's parameters (the official ``forward_encoder``): patches plus
    their positions, masked, the prefix tokens (plus theirs) in front, the blocks, the final norm."""
    m = mae.model
    x = m.patch_embed(imgs)
    P = m.num_prefix_tokens
    patch_pos, prefix_pos = (m.pos_embed, None) if m.no_embed_class else (m.pos_embed[:, P:], m.pos_embed[:, :P])
    x, mask, ids_restore = random_masking(x + patch_pos, mae.mask_ratio, noise)
    prefix = [t for t in (m.cls_token, m.dist_token, m.reg_token) if t is not None]
    if prefix:
        tok = torch.cat(prefix, dim=1)
        tok = tok if prefix_pos is None else tok + prefix_pos
        x = torch.cat([tok.expand(x.shape[0], -1, -1), x], dim=1)
    for blk in m.blocks:
        x = blk(x)
    return (m.fc_norm if isinstance(m.norm, torch.nn.Identity) else m.norm)(x), mask, ids_restore


@pytest.mark.parametrize("kwargs", [
    dict(),                                                           # class token
    dict(dist_token=True, reg_tokens=2),                              # class, distillation and register tokens
    dict(class_token=False, global_pool="avg"),                       # no prefix: the norm is fc_norm
    dict(reg_tokens=1, no_embed_class=True),                          # prefix tokens without positions
])
def test_encode_through_the_token_interface_equals_the_hand_written_encoder(kwargs):
    torch.manual_seed(0)
    backbone = vitlab.create_model("vit_pico_patch8_32", num_classes=0, depth=2, **kwargs)
    with torch.no_grad():
        for p in backbone.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # class / register tokens and positions off their init
    mae = MAE(backbone, decoder_dim=32, decoder_depth=1, decoder_heads=4).eval()
    imgs, noise = torch.randn(3, 1, 32, 32), torch.rand(3, 16)
    with torch.no_grad():
        got, want = mae.encode(imgs, noise), _hand_written_encode(mae, imgs, noise)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    torch.manual_seed(5)
    with torch.no_grad():
        drawn = mae.encode(imgs)[1]
    torch.manual_seed(5)
    assert torch.equal(drawn, mae.encode(imgs, torch.rand(3, 16))[1])  # no noise: drawn from the global generator
