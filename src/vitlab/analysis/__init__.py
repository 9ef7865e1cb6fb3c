"""Analysis tools: attention maps and rollout, frequency spectra, attention biases, position-embedding
similarity, per-component block timings, memory, and the LITv2 window / pooled-queries studies (seeds 001-004).

Every function returns data (dicts, tensors); :mod:`vitlab.analysis.plots` draws it and ``vitlab analyze TOOL``
writes both (JSON + PNG). Models are read, never changed: what a tool needs from inside a model is patched in
from outside for the duration of one call.
"""

from vitlab.analysis.attention import (
    AttentionLayer,
    analyze_attention,
    attention_maps,
    attention_rollout,
    capture_attention,
    rollout_map,
)
from vitlab.analysis.images import DEFAULT_IMAGES, Images, load_images, model_images

__all__ = [
    "DEFAULT_IMAGES", "AttentionLayer", "Images", "analyze_attention", "attention_maps", "attention_rollout",
    "capture_attention", "load_images", "model_images", "rollout_map",
]
