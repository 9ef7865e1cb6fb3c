"""Equality with transformers' CLIP (a dev-only oracle): a ``CLIPModel`` / ``CLIPVisionModel`` with random weights,
saved by ``save_pretrained``, loads into vitlab's CLIP and gives the same image and text embeddings (within
1e-4). No weights are downloaded."""

from __future__ import annotations

import re

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


@pytest.mark.parametrize("act, text_eps", [("quick_gelu", 1e-5), ("gelu", 1e-6)])
def test_clip_model_embeddings_equal(tmp_path, act, text_eps):
    cfg = transformers.CLIPConfig(text_config={**TEXT, "hidden_act": act, "layer_norm_eps": text_eps},
                                  vision_config={**VISION, "hidden_act": act}, projection_dim=24)
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


# the second: a width whose quotient's product rounds below it (56 * (115 / 56) = 114.99999999999999)
@pytest.mark.parametrize("projection, widths", [(False, {}), (True, dict(hidden_size=56, intermediate_size=115))])
def test_clip_vision_model_equal(tmp_path, projection, widths):
    cls = transformers.CLIPVisionModelWithProjection if projection else transformers.CLIPVisionModel
    ref = _perturbed(cls(transformers.CLIPVisionConfig(**{**VISION, **widths}, projection_dim=24,
                                                       layer_norm_eps=1e-6)))
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


# ViT-B/32's image tower and CLIP's text tower, shrunk by keyword to the shapes of a tiny transformers CLIPModel
SMALL_VISION = dict(image_size=64, patch_size=32, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                    num_attention_heads=4)
SHRUNK = dict(quick_gelu=True, img_size=64, image_embed_dim=64, image_depth=2, image_num_heads=4, text_width=48,
              text_depth=2, text_num_heads=4, text_vocab_size=100, text_context_length=12)


def _clip_dir(path, vision=None, text=None):
    """A perturbed transformers CLIPModel of ``SHRUNK``'s shapes (QuickGELU, eps 1e-5: OpenAI's), saved in ``path``
    with the fields of ``vision`` / ``text`` changed."""
    cfg = transformers.CLIPConfig(text_config={**TEXT, **(text or {})},
                                  vision_config={**SMALL_VISION, **(vision or {})}, projection_dim=512)
    ref = _perturbed(transformers.CLIPModel(cfg))
    ref.save_pretrained(path)
    return ref


def test_create_model_reads_a_save_pretrained_directory(tmp_path):
    """``create_model("clip_*", checkpoint_path=DIR)``: a transformers ``CLIPModel`` directory loads into the
    registered architecture (here ViT-B/32 and the CLIP text tower, shrunk by keyword) with the same embeddings."""
    ref = _clip_dir(tmp_path)
    ours = vitlab.create_model("clip_vit_base_patch32", checkpoint_path=str(tmp_path), **SHRUNK).eval()
    x, text = torch.randn(2, 3, 64, 64), _texts(12, 100)
    assert_same_embeddings(ours, ref, x, text)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):  # checked before any tensor is read
        vitlab.create_model("clip_vit_base_patch32", checkpoint_path=str(tmp_path / "empty"), **SHRUNK)
    (tmp_path / "empty" / "config.json").write_text((tmp_path / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        vitlab.create_model("clip_vit_base_patch32", checkpoint_path=str(tmp_path / "empty"), **SHRUNK)


# config.json fields the tensors' shapes do not show, each changed from SHRUNK's model, and the refusal's words;
# transformers computes each differently from the model (a tolerance of 1e-4 tells them apart, checked below)
ANOTHER_FUNCTION = [
    ({"hidden_act": "gelu"}, None, "vision_config.hidden_act 'gelu' (this model 'quick_gelu')"),
    ({"layer_norm_eps": 1e-3}, None, "vision_config.layer_norm_eps 0.001 (this model 1e-05)"),
    ({"num_attention_heads": 2}, None, "vision_config.num_attention_heads 2 (this model 4)"),
    (None, {"hidden_act": "gelu"}, "text_config.hidden_act 'gelu' (this model 'quick_gelu')"),
    (None, {"layer_norm_eps": 1e-3}, "text_config.layer_norm_eps 0.001 (this model 1e-05)"),
    (None, {"num_attention_heads": 2}, "text_config.num_attention_heads 2 (this model 4)"),
    (None, {"eos_token_id": 5}, "text_config.eos_token_id 5 (this model pools at the largest id, 99)"),
]


@pytest.mark.parametrize("vision,text,words", ANOTHER_FUNCTION, ids=lambda c: str(c)[:30])
def test_a_clip_directory_of_another_function_is_refused_in_one_line(tmp_path, vision, text, words):
    """The same tensors under another activation, eps, head split or end-of-text id compute transformers' CLIP
    differently: create_model(checkpoint_path=DIR) refuses, naming the field, and a file of the same tensors
    still loads (unchecked)."""
    ref = _clip_dir(tmp_path, vision, text)
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path}: another CLIP architecture: {words}")) as e:
        vitlab.create_model("clip_vit_base_patch32", checkpoint_path=str(tmp_path), **SHRUNK)
    # the field, then how to load such a checkpoint
    assert "\n" not in str(e.value) and str(e.value).endswith(f"{words}; build the model its config.json describes "
                                                               f"with vitlab.clip.hf.clip_from_hf({str(tmp_path)!r})")
    torch.save(ref.state_dict(), tmp_path / "weights.pt")
    ours = vitlab.create_model("clip_vit_base_patch32", checkpoint_path=str(tmp_path / "weights.pt"), **SHRUNK)
    x, text = torch.randn(2, 3, 64, 64), _texts(12, 100)
    with torch.no_grad():  # the refused difference is real: another image or text embedding
        img = ours.eval().encode_image(x), ref.get_image_features(pixel_values=x).pooler_output
        txt = ours.encode_text(text), ref.get_text_features(input_ids=text).pooler_output
    assert not all(torch.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in (img, txt))


@pytest.mark.parametrize("kwargs,words", [
    ({"image_global_pool": "avg", "image_fc_norm": False}, "pooling 'token' (this model 'avg')"),
    ({"text_post_norm": True}, "text tower 'clip' with pre-norm blocks (this model post-norm blocks)"),
])
def test_a_model_of_another_function_refuses_a_clip_directory(tmp_path, kwargs, words):
    """The model's side: average pooling, or post-norm text blocks, hold the same tensors as transformers' CLIP
    (which pools [CLS] and normalises before each sublayer) but compute another function."""
    _clip_dir(tmp_path)
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path}: another CLIP architecture: {words}")):
        vitlab.create_model("clip_vit_base_patch32", checkpoint_path=str(tmp_path), **SHRUNK, **kwargs)


@pytest.mark.parametrize("text", [{"eos_token_id": 2}, {"pad_token_id": 7, "bos_token_id": 1}])
def test_a_clip_directory_of_the_same_function_loads(tmp_path, text):
    """transformers' configs before PR #24773 (``eos_token_id == 2``) pool at the largest id as vitlab does, and
    the padding and start ids play no part in the text embedding: these load, with transformers' embeddings."""
    ref = _clip_dir(tmp_path, text=text)
    ours = vitlab.create_model("clip_vit_base_patch32", checkpoint_path=str(tmp_path), **SHRUNK).eval()
    assert_same_embeddings(ours, ref, torch.randn(2, 3, 64, 64), _texts(12, 100))


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


@pytest.mark.parametrize("cls", ["CLIPVisionModel", "CLIPModel"])
@pytest.mark.parametrize("change,words,fix", [
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' (this model 'quick_gelu')", {"act_layer": "gelu"}),
    ({"layer_norm_eps": 1e-6}, "layer_norm_eps 1e-06 (this model 1e-05)", {"norm_layer": "layernorm"}),
    ({"num_attention_heads": 2}, "num_attention_heads 2 (this model 4)", {"num_heads": 2}),
])
def test_registered_image_tower_refuses_a_directory_of_another_function(tmp_path, cls, change, words, fix):
    """The weights cannot tell GELU (LAION's CLIPs) from QuickGELU (OpenAI's), the LayerNorm's eps, or how the
    heads split the fused projection: config.json decides, in one line that names the field (under
    ``vision_config.`` in a CLIPModel) and the arguments that build the checkpoint's tower, which then loads."""
    vision = {**SMALL_VISION, **change}
    if cls == "CLIPModel":
        transformers.CLIPModel(transformers.CLIPConfig(text_config=TEXT, vision_config=vision)).save_pretrained(
            tmp_path)
    else:
        transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**vision)).save_pretrained(tmp_path)
    kw = dict(img_size=64, embed_dim=64, depth=2, num_heads=4)
    field = ("vision_config." if cls == "CLIPModel" else "") + words
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path}: its image tower uses {field}: create it with ")) as e:
        vitlab.create_model("vit_base_patch32_clip_quickgelu_224", checkpoint_path=str(tmp_path), **kw)
    assert "\n" not in str(e.value) and f"{next(iter(fix))}=" in str(e.value)
    vitlab.create_model("vit_base_patch32_clip_quickgelu_224", checkpoint_path=str(tmp_path), **{**kw, **fix})


@pytest.mark.parametrize("name, vision, text", [
    ("clip_vit_base_patch32", dict(patch_size=32), {}),
    ("clip_vit_large_patch14", dict(hidden_size=1024, intermediate_size=4096, num_attention_heads=16,
                                    num_hidden_layers=24, patch_size=14), dict(hidden_size=768, intermediate_size=3072,
                                                                               num_attention_heads=12))])
def test_openai_checkpoint_configs_fit_the_registered_models_with_quick_gelu(name, vision, text):
    """openai/clip-vit-*'s config.json (QuickGELU, eos_token_id 2 as those files state it) fits the registered
    model created with quick_gelu=True; the registered GELU model refuses it, saying how to load it."""
    import torch

    from vitlab.clip.model import check_hf_config

    cfg = transformers.CLIPConfig(vision_config=vision, text_config=dict(text, bos_token_id=0, eos_token_id=2,
                                                                         pad_token_id=1)).to_dict()
    with torch.device("meta"):
        check_hf_config(vitlab.create_model(name, quick_gelu=True), cfg, "DIR")
        with pytest.raises(ValueError, match=r"hidden_act 'quick_gelu' \(this model 'gelu'\); create it with "
                                             r"quick_gelu=True .*clip_from_hf\('DIR'\)$"):
            check_hf_config(vitlab.create_model(name), cfg, "DIR")
