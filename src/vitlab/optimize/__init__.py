"""Inference-only speed-ups applied from outside the models (being assembled: see issue 12)."""
