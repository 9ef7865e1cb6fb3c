"""The registered vision-language configurations. :mod:`vitlab.registry` imports this module on its first listing or
lookup, so ``vitlab.create_model("blip_base")`` works after a bare ``import vitlab``.

- BLIP (Li et al., 2022, "BLIP: Bootstrapping Language-Image Pre-training", Sec. 3.1 and 4.1): ``blip_base``, a
  ViT-B/16 image encoder at 384 x 384 and BERT-base text transformers (encoder for ITC / ITM, decoder for
  captioning), task ``blip``; ``blip_base_caption`` (the captioner alone, task ``caption``) and
  ``blip_base_retrieval`` (ITC / ITM alone, task ``blip``) hold the parts of transformers'
  ``BlipForConditionalGeneration`` / ``BlipForImageTextRetrieval``; ``blip_tiny*`` for tests.
"""

from __future__ import annotations

from vitlab.registry import ModelConfig, register_model
from vitlab.vlm.blip import BLIP, build_blip

_BLIP_PAPER = "Li et al., BLIP: Bootstrapping Language-Image Pre-training for Unified Vision-Language Understanding " \
              "and Generation, ICML 2022"
_OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)  # BLIP's image normalisation (CLIP's)
_OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)
_BLIP_SMOKE = {"img_size": 32, "vision_depth": 1, "text_depth": 1}


def _blip_cfg(task: str = "blip", **kw) -> ModelConfig:
    base = dict(family="blip", task=task, paper=_BLIP_PAPER, input_size=(3, 384, 384), mean=_OPENAI_MEAN,
                std=_OPENAI_STD, crop_pct=1.0, num_classes=0, smoke_kwargs=_BLIP_SMOKE)
    return ModelConfig(**{**base, **kw})


# ViT-B/16 at 384 (LayerNorm eps 1e-5, as transformers' BLIP configs); BERT-base with BERT's dropout 0.1
_BASE_VISION = {"img_size": 384, "norm_layer": "layernorm_eps5"}
_BASE_TEXT = {"dropout": 0.1, "attn_dropout": 0.1}


@register_model(config=_blip_cfg())
def blip_base(**kwargs) -> BLIP:
    """BLIP with ViT-B/16 (384 x 384) and BERT-base: ITC, ITM (hard negatives) and captioning heads."""
    return build_blip("vit_base_patch16_224", _BASE_VISION, _BASE_TEXT, **kwargs)


@register_model(config=_blip_cfg("caption"))
def blip_base_caption(**kwargs) -> BLIP:
    """BLIP's captioner (ViT-B/16 384, BERT-base decoder): transformers' ``BlipForConditionalGeneration``."""
    return build_blip("vit_base_patch16_224", _BASE_VISION, _BASE_TEXT, heads=("lm",), **kwargs)


@register_model(config=_blip_cfg())
def blip_base_retrieval(**kwargs) -> BLIP:
    """BLIP's retrieval model (ViT-B/16 384, BERT-base encoder; ITC and ITM): ``BlipForImageTextRetrieval``."""
    return build_blip("vit_base_patch16_224", _BASE_VISION, _BASE_TEXT, heads=("itc", "itm"), **kwargs)


# A tiny BLIP for tests: a 2-block ViT of width 48 (32 x 32, 8 x 8 patches), a 2-layer text transformer of width 32
# over a 100-token vocabulary ([DEC] 98, [ENC] 99, [SEP] 3, padding 0), 16-d contrastive space
_TINY_VISION = {"img_size": 32, "patch_size": 8, "embed_dim": 48, "depth": 2, "num_heads": 4, "mlp_ratio": 2.0,
                "norm_layer": "layernorm_eps5"}
_TINY_TEXT = {"vocab_size": 100, "dim": 32, "depth": 2, "num_heads": 4, "mlp_dim": 64, "max_len": 40,
              "cls_token_id": 1, "sep_token_id": 3, "bos_token_id": 98, "enc_token_id": 99}
_TINY = dict(input_size=(3, 32, 32), smoke_kwargs={})


@register_model(config=_blip_cfg(**_TINY))
def blip_tiny(**kwargs) -> BLIP:
    """A tiny BLIP with all three heads."""
    return build_blip("vit_base_patch16_224", _TINY_VISION, _TINY_TEXT, embed_dim=16, **kwargs)


@register_model(config=_blip_cfg("caption", **_TINY))
def blip_tiny_caption(**kwargs) -> BLIP:
    """The tiny BLIP's captioner alone."""
    return build_blip("vit_base_patch16_224", _TINY_VISION, _TINY_TEXT, heads=("lm",), embed_dim=16, **kwargs)


@register_model(config=_blip_cfg(**_TINY))
def blip_tiny_retrieval(**kwargs) -> BLIP:
    """The tiny BLIP's ITC and ITM heads alone."""
    return build_blip("vit_base_patch16_224", _TINY_VISION, _TINY_TEXT, heads=("itc", "itm"), embed_dim=16, **kwargs)
