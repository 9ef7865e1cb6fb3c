"""Equality with transformers' CLIP (a dev-only oracle): a ``CLIPModel`` / ``CLIPVisionModel`` with random weights,
saved by ``save_pretrained``, loads into vitlab's CLIP and gives the same image and text embeddings (within
1e-4). No weights are downloaded."""

from __future__ import annotations

import pytest
import torch

import vitlab
from vitlab.clip.hf import clip_from_hf, clip_text_kwargs, clip_vision_from_hf, convert_hf_clip_vision_state_dict

transformers = pytest.importorskip("transformers")

VISION = dict(image_size=32, patch_size=8, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
              num_attention_heads=4)
TEXT = dict(vocab_size=100, hidden_size=48, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=12, eos_token_id=99, bos_token_id=98, pad_token_id=0)


def _perturbed(model):
    """Every parameter moved off its init (LayerNorms, biases), so no term of the map hides."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def _texts(context_length: int, vocab_size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    text = torch.zeros(3, context_length, dtype=torch.long)
    for i, length in enumerate((4, context_length, 7)):  # short, full (end-of-text last), middle
        text[i, :length] = torch.randint(1, vocab_size - 2, (length,), generator=g)
        text[i, length - 1] = vocab_size - 1
    return text


@torch.no_grad()
def assert_same_embeddings(ours, ref, x, text):
    """vitlab's image and text embeddings equal transformers' ``get_image_features`` / ``get_text_features``."""
    torch.testing.assert_close(ours.encode_image(x), ref.get_image_features(pixel_values=x).pooler_output,
                               rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours.encode_text(text), ref.get_text_features(input_ids=text).pooler_output,
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("act", ["quick_gelu", "gelu"])
def test_clip_model_embeddings_equal(tmp_path, act):
    cfg = transformers.CLIPConfig(text_config={**TEXT, "hidden_act": act}, vision_config={**VISION, "hidden_act": act},
                                  projection_dim=24)
    ref = _perturbed(transformers.CLIPModel(cfg))
    ref.save_pretrained(tmp_path)
    ours = clip_from_hf(str(tmp_path)).eval()
    x, text = torch.randn(2, 3, 32, 32), _texts(12, 100)
    assert_same_embeddings(ours, ref, x, text)
    with torch.no_grad():
        out = ref(input_ids=text, pixel_values=x)
        img, txt, scale = ours(x, text)
        torch.testing.assert_close(scale * img @ txt.T, out.logits_per_image, rtol=1e-4, atol=1e-4)
    assert ours.embed_dim == 24 and ours.context_length == 12


@pytest.mark.parametrize("projection", [False, True])
def test_clip_vision_model_equal(tmp_path, projection):
    cls = transformers.CLIPVisionModelWithProjection if projection else transformers.CLIPVisionModel
    ref = _perturbed(cls(transformers.CLIPVisionConfig(**VISION, projection_dim=24, layer_norm_eps=1e-6)))
    ref.save_pretrained(tmp_path)
    ours = clip_vision_from_hf(str(tmp_path)).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        out = ref(pixel_values=x, output_hidden_states=True)
        torch.testing.assert_close(ours(x), out.image_embeds if projection else out.pooler_output,
                                   rtol=1e-4, atol=1e-4)
        trunk = ours.trunk if projection else ours
        # every block's tokens: hidden_states[i + 1] is the output of block i (hidden_states[0]: the embeddings)
        feats = trunk.forward_intermediates(x, output_fmt="NLC", intermediates_only=True, return_prefix_tokens=True)
        for i, (patches, prefix) in enumerate(feats):
            torch.testing.assert_close(torch.cat([prefix, patches], 1), out.hidden_states[i + 1],
                                       rtol=1e-4, atol=1e-4)


def test_older_prefixed_vision_layout_and_refusals(tmp_path):
    ref = transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**VISION))
    bare = ref.state_dict()
    prefixed = {f"vision_model.{k}": v for k, v in bare.items()}  # transformers 4's CLIPVisionModel keys
    a, b = convert_hf_clip_vision_state_dict(bare), convert_hf_clip_vision_state_dict(prefixed)
    assert a.keys() == b.keys() and "blocks.1.attn.qkv.weight" in a and "pos_drop.norm.weight" in a
    with pytest.raises(ValueError, match="no CLIP vision tower"):
        convert_hf_clip_vision_state_dict({"x": torch.zeros(1)})
    with pytest.raises(ValueError, match="pools at the largest token id"):
        clip_text_kwargs({**TEXT, "eos_token_id": 5})
    with pytest.raises(ValueError, match="unsupported activation"):
        clip_text_kwargs({**TEXT, "hidden_act": "relu6"})
    ref.save_pretrained(tmp_path)
    with pytest.raises(ValueError):  # a CLIPVisionModel directory is not a CLIPModel
        clip_from_hf(str(tmp_path))


def test_create_model_reads_a_save_pretrained_directory(tmp_path):
    """``create_model("clip_*", checkpoint_path=DIR)``: a transformers ``CLIPModel`` directory loads into the
    registered architecture (here ViT-B/32 and the CLIP text tower, shrunk by keyword) with the same embeddings."""
    vision = dict(image_size=64, patch_size=32, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4)
    cfg = transformers.CLIPConfig(text_config=TEXT, vision_config=vision, projection_dim=512)  # quick_gelu: OpenAI's
    ref = _perturbed(transformers.CLIPModel(cfg))
    ref.save_pretrained(tmp_path)
    shrunk = dict(quick_gelu=True, img_size=64, image_embed_dim=64, image_depth=2, image_num_heads=4, text_width=48,
                  text_depth=2, text_num_heads=4, text_vocab_size=100, text_context_length=12)
    ours = vitlab.create_model("clip_vit_base_patch32", checkpoint_path=str(tmp_path), **shrunk).eval()
    x, text = torch.randn(2, 3, 64, 64), _texts(12, 100)
    assert_same_embeddings(ours, ref, x, text)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        vitlab.create_model("clip_vit_base_patch32", checkpoint_path=str(tmp_path / "empty"), **shrunk)


@pytest.mark.parametrize("cls", ["CLIPVisionModel", "CLIPVisionModelWithProjection", "CLIPModel"])
def test_registered_image_tower_reads_a_save_pretrained_directory(tmp_path, cls):
    """``create_model("vit_base_patch32_clip_quickgelu_224", checkpoint_path=DIR)`` (OpenAI's ViT-B/32 image tower,
    shrunk by keyword): ``pooler_output`` and every block's tokens of a transformers directory's image tower."""
    vision = dict(image_size=64, patch_size=32, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4)  # quick_gelu and eps 1e-5: transformers' defaults, OpenAI's
    if cls == "CLIPModel":
        ref = _perturbed(transformers.CLIPModel(transformers.CLIPConfig(text_config=TEXT, vision_config=vision)))
    else:
        ref = _perturbed(getattr(transformers, cls)(transformers.CLIPVisionConfig(**vision, projection_dim=24)))
    ref.save_pretrained(tmp_path)
    ours = vitlab.create_model("vit_base_patch32_clip_quickgelu_224", checkpoint_path=str(tmp_path), img_size=64,
                               embed_dim=64, depth=2, num_heads=4).eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        out = (ref.vision_model if cls == "CLIPModel" else ref)(pixel_values=x, output_hidden_states=True)
        if cls != "CLIPVisionModelWithProjection":  # with a projection, its output is image_embeds
            torch.testing.assert_close(ours(x), out.pooler_output, rtol=1e-4, atol=1e-4)
        feats = ours.forward_intermediates(x, output_fmt="NLC", intermediates_only=True, return_prefix_tokens=True)
        for i, (patches, prefix) in enumerate(feats):
            torch.testing.assert_close(torch.cat([prefix, patches], 1), out.hidden_states[i + 1],
                                       rtol=1e-4, atol=1e-4)


def test_registered_image_tower_refuses_a_directory_of_another_activation(tmp_path):
    """The weights cannot tell GELU (LAION's CLIPs) from QuickGELU (OpenAI's): config.json decides, in one line."""
    vision = dict(image_size=64, patch_size=32, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, hidden_act="gelu")
    transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**vision)).save_pretrained(tmp_path)
    kw = dict(img_size=64, embed_dim=64, depth=2, num_heads=4)
    with pytest.raises(ValueError, match=r"its image tower uses hidden_act 'gelu' .* create it with "
                                         r"act_layer='gelu'") as e:
        vitlab.create_model("vit_base_patch32_clip_quickgelu_224", checkpoint_path=str(tmp_path), **kw)
    assert "\n" not in str(e.value)
    vitlab.create_model("vit_base_patch32_clip_quickgelu_224", checkpoint_path=str(tmp_path), act_layer="gelu", **kw)
