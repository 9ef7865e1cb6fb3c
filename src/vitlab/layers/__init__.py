"""Building blocks of vision transformers. Imports only torch and einops; knows no model."""

from vitlab.layers.checkpoint import checkpoint_seq
from vitlab.layers.classifier import check_pool, create_classifier
from vitlab.layers.drop import DropPath, drop_path, drop_path_schedule
from vitlab.layers.features import feature_take_indices, intermediates_plan
from vitlab.layers.helpers import (
    check_heads,
    check_image,
    downsample_size,
    init_linears_trunc_normal_,
    make_divisible,
    same_size,
    to_2tuple,
)
from vitlab.layers.layer_scale import LayerScale, LayerScale2d
from vitlab.layers.mask import attention_mask, causal_mask
from vitlab.layers.mlp import Mlp, QuickGELU, SwiGLU, create_mlp, get_act_layer, swiglu_hidden_dim
from vitlab.layers.norm import RMSNorm, get_norm_layer
from vitlab.layers.patch_embed import (
    EMBED_LAYERS,
    ConvStemEmbed,
    LinearPatchEmbed,
    PatchEmbed,
    conv_to_linear_patch_weight,
    get_embed_layer,
)
from vitlab.layers.pool import AttentionPool, check_pool_type, pool_tokens
from vitlab.layers.pos_embed import (
    RotaryEmbedding1D,
    RotaryEmbedding2D,
    apply_rope,
    apply_rotary_embs,
    precompute_freqs_cis,
    resample_abs_pos_embed,
    rope_frequencies,
    rope_rotate,
    sincos_2d_pos_embed,
)

__all__ = [
    "apply_rope", "apply_rotary_embs", "attention_mask", "AttentionPool", "causal_mask", "check_heads",
    "checkpoint_seq", "check_image",
    "check_pool",
    "check_pool_type", "conv_to_linear_patch_weight", "ConvStemEmbed", "EMBED_LAYERS", "get_embed_layer",
    "create_classifier", "create_mlp",
    "downsample_size", "drop_path", "drop_path_schedule", "DropPath", "feature_take_indices", "get_act_layer",
    "get_norm_layer", "init_linears_trunc_normal_", "intermediates_plan", "LayerScale", "LayerScale2d",
    "LinearPatchEmbed", "make_divisible", "Mlp", "PatchEmbed", "QuickGELU",
    "pool_tokens", "precompute_freqs_cis", "resample_abs_pos_embed", "RMSNorm", "rope_frequencies", "rope_rotate",
    "RotaryEmbedding1D", "RotaryEmbedding2D", "same_size", "sincos_2d_pos_embed", "SwiGLU", "swiglu_hidden_dim",
    "to_2tuple",
]
