"""The registered LLaVA and BLIP configurations: the caller's image placeholder id and contrastive width, and the
published checkpoints' config.json files accepted by their config checks."""

from __future__ import annotations

import pytest

import vitlab


@pytest.mark.parametrize("name, default", [("llava_tiny", 110), ("llava_scenes", 3)])
def test_image_token_id_override(name, default):
    assert vitlab.create_model(name).image_token_id == default
    assert vitlab.create_model(name, image_token_id=5).image_token_id == 5



@pytest.mark.parametrize("name", ["blip_tiny", "blip_tiny_retrieval", "blip_tiny_caption"])
def test_tiny_blip_takes_the_callers_contrastive_width(name):
    model = vitlab.create_model(name, embed_dim=24)  # over the config's 16
    widths = {getattr(model, p).out_features for p in ("vision_proj", "text_proj") if hasattr(model, p)}
    assert widths == (set() if name == "blip_tiny_caption" else {24})


# what the published checkpoints' config.json files state (the fields transformers does not default to them):
# llava-hf/llava-1.5-7b-hf, meta-llama/Llama-2-7b-hf and Salesforce/blip-image-captioning-base (BLIP-base's
# ViT-B/16 at 384 and BERT-base text transformer, which the retrieval model shares)
_LLAVA_15_7B = dict(
    vision_config=dict(model_type="clip_vision_model", hidden_size=1024, image_size=336, intermediate_size=4096,
                       num_attention_heads=16, num_hidden_layers=24, patch_size=14, projection_dim=768),
    text_config=dict(model_type="llama", max_position_embeddings=4096, rms_norm_eps=1e-5, vocab_size=32064),
    image_token_index=32000, projector_hidden_act="gelu", vision_feature_layer=-2,
    vision_feature_select_strategy="default", pad_token_id=32001)
_BLIP_BASE = dict(vision_config=dict(image_size=384, layer_norm_eps=1e-5, hidden_act="gelu"),
                  text_config=dict(num_attention_heads=12, bos_token_id=30522, pad_token_id=0, sep_token_id=102,
                                   layer_norm_eps=1e-12, hidden_act="gelu"))


@pytest.mark.parametrize("name, config", [("llava15_7b", ("LlavaConfig", _LLAVA_15_7B)),
                                          ("blip_base_caption", ("BlipConfig", _BLIP_BASE)),
                                          ("blip_base_retrieval", ("BlipConfig", _BLIP_BASE))])
def test_registered_full_size_configs_accept_the_published_checkpoints(name, config):
    """The config checks of create_model(checkpoint_path=) pass the published checkpoints' config.json (built on
    the meta device: no weights), and refuse one field changed."""
    transformers = pytest.importorskip("transformers")
    import torch

    cls, kwargs = config
    with torch.device("meta"):
        model = vitlab.create_model(name)
    cfg = getattr(transformers, cls)(**kwargs).to_dict()
    model.check_hf_config(cfg, name)
    cfg["text_config"]["hidden_act"] = "relu"
    with pytest.raises(ValueError, match="relu"):
        model.check_hf_config(cfg, name)


def test_llama2_7b_accepts_the_published_checkpoint_config():
    transformers = pytest.importorskip("transformers")
    import torch

    from vitlab.models import llama_config_from_hf

    with torch.device("meta"):
        model = vitlab.create_model("llama2_7b")
    hf = transformers.LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                  num_attention_heads=32, num_key_value_heads=32, rms_norm_eps=1e-5,
                                  vocab_size=32000, max_position_embeddings=4096).to_dict()
    model.check_config(llama_config_from_hf(hf), "Llama-2-7b-hf")
