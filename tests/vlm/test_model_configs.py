"""The registered LLaVA configurations take the caller's image placeholder id over their own default."""

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
