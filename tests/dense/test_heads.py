"""Every head over plain and hierarchical backbones; the pieces against their definitions or peers:
deformable attention against transformers' Deformable DETR kernel, ViTDet window attention against a global
attention on one window, the simple feature pyramid's strides, Segmenter's mask product; a user's head through the
head registry; the registered configurations through ``vitlab.create_model``."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import vitlab
from vitlab.dense import create, list_heads, register_head
from vitlab.dense.adapter import MSDeformAttn, ms_deform_attn
from vitlab.dense.backbone import (
    RelPosAttention,
    WindowedAttention,
    default_global_blocks,
    rel_pos_table,
    vitdet_backbone,
)

SEG_HEADS = list_heads("segment")
TINY = dict(backbone="vit_tiny_patch16_224", img_size=64, backbone_kwargs={"depth": 4, "embed_dim": 96})


@pytest.mark.parametrize("head", SEG_HEADS)
def test_segmentation_heads_train_and_cover_every_parameter(head):
    torch.manual_seed(0)
    model = create(head, num_classes=5, **TINY)
    x = torch.randn(2, 3, 64, 64)
    y = model(x)
    assert y.shape == (2, 5, 64, 64) and torch.isfinite(y).all()
    F.cross_entropy(y, torch.randint(0, 5, (2, 64, 64))).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"parameters without gradient (DDP would fail): {missing[:4]}"


def test_builtin_heads_are_registered():
    assert set(SEG_HEADS) >= {"setr_naive", "setr_pup", "setr_mla", "segmenter_linear", "segmenter_mask", "dpt",
                              "vitdet_sfp", "vit_adapter"}
    assert list_heads("depth") == ["dpt", "linear_depth"]


@pytest.mark.parametrize("head", ["dpt", "linear_depth"])
def test_depth_heads_predict_non_negative_depth(head):
    model = create(head, task="depth", **TINY).eval()
    with torch.no_grad():
        d = model(torch.randn(2, 3, 64, 64))
    assert d.shape == (2, 1, 64, 64) and (d >= 0).all()


@pytest.mark.parametrize("head", ["setr_mla", pytest.param("dpt", marks=pytest.mark.slow),
                                  "segmenter_linear", "setr_pup"])
def test_heads_over_a_hierarchical_backbone(head):
    model = create(head, backbone="swin_tiny_patch4_window7_224", num_classes=3,
                   backbone_kwargs={"depths": (1, 1, 1, 1)}).eval()
    with torch.no_grad():
        assert model(torch.randn(1, 3, 224, 224)).shape == (1, 3, 224, 224)


def test_dpt_reassembles_to_strides_4_8_16_32_at_hooks_2_5_8_11():
    model = create("dpt", backbone="vit_tiny_patch16_224", num_classes=2, img_size=64)
    assert model.indices == [2, 5, 8, 11]
    maps, prefix = model.features(torch.randn(1, 3, 64, 64))
    out = model.decoder.neck.reassemble_stage(maps, prefix)
    assert [o.shape[-1] for o in out] == [16, 8, 4, 2]


def test_bad_head_task_and_readout_are_one_line_errors():
    with pytest.raises(ValueError, match="unknown dense head"):
        create("unet", **TINY)
    with pytest.raises(ValueError, match="depth heads"):
        create("setr_pup", task="depth", **TINY)
    with pytest.raises(ValueError, match="readout"):
        create("dpt", head_kwargs={"readout": "mean"}, **TINY)
    with pytest.raises(ValueError, match="twice"):
        register_head("dpt")(nn.Identity)
    with pytest.raises(ValueError, match="tasks must be some of segment, depth"):
        register_head("edges", tasks=("edges",))


def test_ms_deform_attn_equals_transformers_deformable_detr_kernel():
    from transformers.models.deformable_detr.modeling_deformable_detr import MultiScaleDeformableAttention

    g = torch.Generator().manual_seed(0)
    shapes = [(8, 6), (4, 3), (2, 2)]
    B, heads, d, Q, P = 2, 4, 8, 5, 3
    value = torch.randn(B, sum(h * w for h, w in shapes), heads, d, generator=g)
    loc = torch.rand(B, Q, heads, len(shapes), P, 2, generator=g) * 1.2 - 0.1  # some samples fall outside
    w = torch.rand(B, Q, heads, len(shapes), P, generator=g)
    ref = MultiScaleDeformableAttention()(value, torch.tensor(shapes), shapes, None, loc, w, 64)
    torch.testing.assert_close(ms_deform_attn(value, shapes, loc, w), ref)


def test_deformable_attention_at_its_initialisation_samples_around_the_reference():
    attn = MSDeformAttn(16, num_heads=4, n_levels=1, n_points=1)
    with torch.no_grad():
        attn.sampling_offsets.bias.zero_()  # zero offsets: each query reads its reference cell exactly
    v = torch.randn(1, 12, 16)
    ref = torch.tensor([[[(0.5 + 1) / 4, (0.5 + 2) / 3]]])[:, :, None]  # centre of cell (row 2, col 1) of 3x4
    out = attn(torch.randn(1, 1, 16), ref, v, [(3, 4)])
    expect = attn.output_proj(attn.value_proj(v)[:, 2 * 4 + 1])
    torch.testing.assert_close(out[0, 0], expect[0], rtol=1e-5, atol=1e-5)


def test_vitdet_window_attention_pads_and_equals_global_attention_within_one_window():
    import vitlab

    vit = vitlab.create_model("vit_tiny_patch16_224", num_classes=0, depth=12, img_size=96, class_token=False,
                              global_pool="avg")
    attn = vit.blocks[0].attn
    x = torch.randn(1, 36, 192)
    win = WindowedAttention(attn, window_size=6)  # one window covers the 6x6 grid: global attention
    torch.testing.assert_close(win(x, (6, 6)), attn(x, (6, 6)), rtol=1e-5, atol=1e-5)
    win4 = WindowedAttention(attn, window_size=4)  # 6x6 padded to 8x8: four windows, the first one alone
    top_left = x.reshape(1, 6, 6, 192)[:, :4, :4].reshape(1, 16, 192)
    torch.testing.assert_close(win4(x, (6, 6)).reshape(1, 6, 6, 192)[:, :4, :4].reshape(1, 16, 192),
                               attn(top_left), rtol=1e-5, atol=1e-5)
    vitdet_backbone(vit, window_size=4)
    assert default_global_blocks(12) == [2, 5, 8, 11]
    assert [type(b.attn).__name__ for b in vit.blocks].count("WindowedAttention") == 8
    with pytest.raises(ValueError, match="prefix"):
        vitdet_backbone(vitlab.create_model("vit_tiny_patch16_224", depth=2))


def test_decomposed_rel_pos_attention_equals_timm_sam_attention():
    """ViTDet's relative position bias against timm's SAM attention (the same MViTv2 bias) with shared weights,
    a table made for another size included (resized linearly)."""
    from timm.models.vision_transformer_sam import Attention as SamAttention
    from timm.models.vision_transformer_sam import get_rel_pos

    from vitlab.attention import MultiHeadSelfAttention

    torch.manual_seed(0)
    for size, table in (((4, 6), (4, 6)), ((5, 5), (3, 4))):
        ours = RelPosAttention(MultiHeadSelfAttention(32, num_heads=4), table)
        ref = SamAttention(32, num_heads=4, use_rel_pos=True, input_size=table)
        with torch.no_grad():
            for p in (ours.rel_pos_h, ours.rel_pos_w):
                p.normal_()
        ref.load_state_dict({k.removeprefix("attn."): v for k, v in ours.state_dict().items()})
        x = torch.randn(2, size[0] * size[1], 32)
        torch.testing.assert_close(ours(x, size), ref(x.reshape(2, *size, 32)).reshape(2, -1, 32),
                                   rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rel_pos_table(3, 5, ours.rel_pos_h), get_rel_pos(3, 5, ours.rel_pos_h))


def test_vitdet_rel_pos_backbone_starts_as_the_plain_one():
    kw = dict(backbone="vit_pico_patch4_32", num_classes=2, img_size=32)
    torch.manual_seed(0)
    plain = create("vitdet_sfp", **kw, head_kwargs={"window_size": 4, "global_blocks": [3]}).eval()
    torch.manual_seed(0)
    rel = create("vitdet_sfp", **kw, head_kwargs={"window_size": 4, "global_blocks": [3], "rel_pos": True}).eval()
    attns = [b.attn for b in rel.backbone.blocks]
    assert [a.attn.rel_pos_h.shape[0] for a in attns[:3]] == [7, 7, 7] and attns[3].rel_pos_h.shape[0] == 15
    rel.load_state_dict(plain.state_dict(), strict=False)  # zero-initialised tables: the same function
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(rel(x), plain(x))
        attns[3].rel_pos_w.fill_(0.5)
        assert not torch.allclose(rel(x), plain(x))


def test_simple_feature_pyramid_strides():
    model = create("vitdet_sfp", backbone="vit_tiny_patch16_224", num_classes=2, img_size=128,
                   backbone_kwargs={"depth": 4}, head_kwargs={"window_size": 4})
    maps, _ = model.features(torch.randn(1, 3, 128, 128))
    pyr = model.decoder.neck(maps)
    assert [128 // p.shape[-1] for p in pyr] == [4, 8, 16, 32]
    # a patch-4 ViT reaches the same strides with scales 1, 1/2, 1/4, 1/8 (identity and max-pools)
    small = create("vitdet_sfp", backbone="vit_pico_patch4_32", num_classes=2, img_size=64,
                   head_kwargs={"window_size": 4, "global_blocks": [3]})
    assert small.decoder.neck.scales == (1.0, 0.5, 0.25, 0.125)
    assert [64 // p.shape[-1] for p in small.decoder.neck(small.features(torch.randn(1, 3, 64, 64))[0])] == \
        [4, 8, 16, 32]
    with pytest.raises(ValueError, match="power of two"):
        create("vitdet_sfp", backbone="vit_pico_patch4_32", num_classes=2, img_size=64,
               head_kwargs={"scales": [3, 1]})


def test_vit_adapter_pyramid_and_zero_initialised_injection():
    model = create("vit_adapter", num_classes=2, **TINY)
    assert all((inj.gamma == 0).all() for inj in model.adapter.injectors)  # the ViT starts unchanged
    feats = model.adapter(torch.randn(1, 3, 64, 64))
    assert [64 // f.shape[-1] for f in feats] == [4, 8, 16, 32]


def test_vit_adapter_extra_extractors_refine_the_last_interaction():
    torch.manual_seed(0)
    model = create("vit_adapter", num_classes=2, **TINY, head_kwargs={"extra_extractors": 2})
    assert len(model.adapter.extra_extractors) == 2 and len(model.adapter.extractors) == 4
    F.cross_entropy(model(torch.randn(1, 3, 64, 64)), torch.randint(0, 2, (1, 64, 64))).backward()
    assert all(p.grad is not None for p in model.adapter.extra_extractors.parameters())


def test_registered_configs_in_vitlab_models(capsys):
    import json

    from vitlab.cli import main
    from vitlab.dense import list_models

    assert {"dpt_vit_base_patch16_384", "dpt_vit_base_patch16_384_depth", "vitdet_sfp_vit_base_patch16_1024",
            "vit_adapter_vit_small_patch16_512"} <= set(list_models())
    assert main(["models", "segmenter_linear_*", "--json"]) == 0
    row, = json.loads(capsys.readouterr().out)
    assert row["family"] == "dense" and row["input_size"] == [3, 512, 512]
    # ViT-S/16 (timm: 22.05M, its 1000-class head 0.385M) with a 32 x 32 (+1) position table instead of 14 x 14,
    # plus a 384 x 150 linear decoder
    expect = 22.05 - 0.385 + (1025 - 197) * 384 / 1e6 + (384 * 150 + 150) / 1e6
    assert row["params_m"] == pytest.approx(expect, abs=0.01)


@register_head("conv1x1_test_head")
class Conv1x1Head(nn.Module):
    """A user's head: the head-registry convention and nothing more (no prefix tokens, no builder)."""

    def __init__(self, in_channels: list[int], num_classes: int):
        super().__init__()
        self.proj = nn.Conv2d(in_channels[-1], num_classes, 1)

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        return self.proj(features[-1])


def test_a_registered_user_head_is_built_and_forwarded():
    assert "conv1x1_test_head" in list_heads("segment") and "conv1x1_test_head" not in list_heads("depth")
    model = create("conv1x1_test_head", backbone="vit_pico_patch4_32", num_classes=3, img_size=32).eval()
    assert isinstance(model.decoder, Conv1x1Head) and not model.prefix  # the class token is not read
    with torch.no_grad():
        assert model(torch.randn(2, 3, 32, 32)).shape == (2, 3, 32, 32)
    with pytest.raises(ValueError, match="does not predict depth"):
        create("conv1x1_test_head", backbone="vit_pico_patch4_32", task="depth", img_size=32)


def test_registered_configs_build_through_create_model(tmp_path):
    """Every dense configuration is a model of the one registry with its task; ``vitlab.create_model`` builds it
    (shapes only, on meta) as ``vitlab.dense.create`` does, with the same overrides."""
    from vitlab.dense import get_config, list_models

    names = list_models()
    assert names == vitlab.list_models(task=("segment", "depth"))
    assert not set(names) & set(vitlab.list_models(task="classify"))
    for name in names:
        cfg = vitlab.get_model_config(name)
        assert cfg is get_config(name) and cfg.family == "dense" and cfg.task in ("segment", "depth")
        with torch.device("meta"):
            model = vitlab.create_model(name)
        assert model.task == cfg.task and model.num_classes == cfg.num_classes
        assert model.backbone.patch_embed.img_size == cfg.input_size[1:]
    with pytest.raises(vitlab.UnknownModelError, match="not a dense configuration"):
        get_config("vit_pico_patch4_32")
    torch.manual_seed(0)
    a = vitlab.create_model("segmenter_linear_vit_small_patch16_512", num_classes=4, img_size=32, drop_path_rate=0.1)
    torch.manual_seed(0)
    b = create("segmenter_linear_vit_small_patch16_512", num_classes=4, img_size=32, drop_path_rate=0.1)
    assert a.num_classes == b.num_classes == 4 and a.backbone.patch_embed.img_size == (32, 32)
    a, b = a.eval(), b.eval()
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(a(x), b(x))
    torch.save(a.state_dict(), tmp_path / "seg.pth")
    c = vitlab.create_model("segmenter_linear_vit_small_patch16_512", num_classes=4, img_size=32,
                            checkpoint_path=str(tmp_path / "seg.pth")).eval()
    with torch.no_grad():
        torch.testing.assert_close(c(x), a(x))
