"""Model families, one a file; importing this package imports every family module, which registers its
models (a new ``models/<family>.py`` is picked up without editing this file). The token interface of the
plain-ViT family (:class:`TokenModel`), the mixin swap of patches applied from outside (:func:`mix_in`,
:func:`mix_out`) and the classes and checkpoint maps the capabilities build on are public here: a package above the
models imports from ``vitlab.models``, never from a family's module."""

import importlib
import pkgutil

for _mod in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_mod.name}")

from vitlab.models._base import (  # noqa: E402
    TokenModel,
    check_token_model,
    keep_patches,
    mask_patches,
    mix_in,
    mix_out,
    mixin_of,
    set_grad_checkpointing,
)
from vitlab.models.clip_vit import (  # noqa: E402
    CLIP_ARCHITECTURES,
    CLIP_VISION_ARCHITECTURES,
    HF_CLIP_ARCHITECTURES,
    HF_CLIP_VISION_DEFAULTS,
    OPENAI_MEAN,
    OPENAI_STD,
    CLIPVisionTransformer,
    PreNorm,
    clip_vision_transformer,
    clip_vit_kwargs,
    convert_hf_clip_state_dict,
    convert_hf_clip_vision_state_dict,
    hf_act,
    hf_act_pair,
    hf_clip_tower_differences,
    hf_clip_vision_differences,
    hf_clip_vision_kwargs,
    hf_layernorm,
    hf_mlp_ratio,
    is_hf_clip_state_dict,
)
from vitlab.models.halvit import HaLViT  # noqa: E402
from vitlab.models.levit import LevitBlock  # noqa: E402
from vitlab.models.llama import Llama, fill_tied_head, llama_config_from_hf, sample_next_token  # noqa: E402
from vitlab.models.vision_transformer import VisionTransformer  # noqa: E402

__all__ = ["CLIP_ARCHITECTURES", "CLIP_VISION_ARCHITECTURES", "HF_CLIP_ARCHITECTURES", "CLIPVisionTransformer",
           "HF_CLIP_VISION_DEFAULTS", "HaLViT", "LevitBlock", "Llama", "PreNorm", "TokenModel", "VisionTransformer",
           "check_token_model", "clip_vision_transformer", "clip_vit_kwargs", "convert_hf_clip_state_dict",
           "convert_hf_clip_vision_state_dict", "hf_act", "hf_act_pair", "hf_clip_tower_differences",
           "hf_clip_vision_differences", "hf_clip_vision_kwargs", "hf_layernorm", "hf_mlp_ratio",
           "is_hf_clip_state_dict", "keep_patches", "fill_tied_head", "llama_config_from_hf", "mask_patches", "mix_in",
           "mix_out", "mixin_of", "OPENAI_MEAN", "OPENAI_STD", "sample_next_token", "set_grad_checkpointing"]
