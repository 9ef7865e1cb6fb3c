"""The registered LLaVA configurations take the caller's image placeholder id over their own default."""

from __future__ import annotations

import pytest

import vitlab


@pytest.mark.parametrize("name, default", [("llava_tiny", 110), ("llava_scenes", 3)])
def test_image_token_id_override(name, default):
    assert vitlab.create_model(name).image_token_id == default
    assert vitlab.create_model(name, image_token_id=5).image_token_id == 5
