"""Analysis tools: attention maps and rollout, frequency spectra, attention biases, position-embedding
similarity, per-component block timings, memory, and the LITv2 window / pooled-queries studies.

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
from vitlab.analysis.bias import bias_maps
from vitlab.analysis.images import DEFAULT_IMAGES, Images, load_images, model_images
from vitlab.analysis.posembed import cosine_similarity_grid, posembed_similarity
from vitlab.analysis.spectrum import block_spectra, frequency_magnitude, hilo_spectra, relative_log_amplitude
from vitlab.analysis.timings import PAPER_TABLE1, block_timings, component_timings, levit_table1

__all__ = [
    "DEFAULT_IMAGES", "PAPER_TABLE1", "AttentionLayer", "Images", "analyze_attention", "attention_maps",
    "attention_rollout", "bias_maps", "block_spectra", "block_timings", "capture_attention", "component_timings",
    "cosine_similarity_grid", "frequency_magnitude", "hilo_spectra", "levit_table1", "load_images",
    "model_images", "posembed_similarity", "relative_log_amplitude", "rollout_map",
]
