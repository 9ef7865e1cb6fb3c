"""The registered vision-language configurations. :mod:`vitlab.registry` imports this module on its first listing or
lookup, so ``vitlab.create_model("blip_base")`` works after a bare ``import vitlab``.

- BLIP (Li et al., 2022, "BLIP: Bootstrapping Language-Image Pre-training", Sec. 3.1 and 4.1): ``blip_base``, a
  ViT-B/16 image encoder at 384 x 384 and BERT-base text transformers (encoder for ITC / ITM, decoder for
  captioning), task ``blip`` (the Trainer task that trains each); ``blip_base_caption`` (the captioner alone:
  ``--task blip`` trains its captioning objective) and ``blip_base_retrieval`` (ITC / ITM alone) hold the parts
  of transformers' ``BlipForConditionalGeneration`` / ``BlipForImageTextRetrieval``; ``blip_tiny*`` for tests.
- LLaVA (Liu et al., 2023, "Visual Instruction Tuning"; LLaVA-1.5: "Improved Baselines with Visual Instruction
  Tuning", Table 1 / Sec. 3.1), task ``caption`` (text from an image and a prompt: captions and answers):
  ``llava15_7b`` (CLIP ViT-L/14 at 336 px, features of the penultimate block without [CLS], a two-layer GELU
  projector, Llama-2-7B with LLaVA-1.5's 32,064-token vocabulary and ``<image>`` = 32000; built without weights),
  ``llava_tiny`` (tests) and ``llava_scenes`` (the offline scenes demo, trained from scratch).
"""

from __future__ import annotations

from vitlab.models import OPENAI_MEAN, OPENAI_STD
from vitlab.registry import ModelConfig, register_model
from vitlab.vlm.blip import BLIP, build_blip
from vitlab.vlm.llava import LLaVA, build_llava

_BLIP_PAPER = "Li et al., BLIP: Bootstrapping Language-Image Pre-training for Unified Vision-Language Understanding " \
              "and Generation, ICML 2022"
_BLIP_SMOKE = {"img_size": 32, "vision_depth": 1, "text_depth": 1}


def _blip_cfg(**kw) -> ModelConfig:
    base = dict(family="blip", task="blip", paper=_BLIP_PAPER, input_size=(3, 384, 384), mean=OPENAI_MEAN,
                std=OPENAI_STD, crop_pct=1.0, num_classes=0, smoke_kwargs=_BLIP_SMOKE)
    return ModelConfig(**{**base, **kw})


# ViT-B/16 at 384 (LayerNorm eps 1e-5, as transformers' BLIP configs); BERT-base with BERT's dropout 0.1
_BASE_VISION = {"img_size": 384, "norm_layer": "layernorm_eps5"}
_BASE_TEXT = {"dropout": 0.1, "attn_dropout": 0.1}


@register_model(config=_blip_cfg())
def blip_base(**kwargs) -> BLIP:
    """BLIP with ViT-B/16 (384 x 384) and BERT-base: ITC, ITM (hard negatives) and captioning heads."""
    return build_blip("vit_base_patch16_224", _BASE_VISION, _BASE_TEXT, **kwargs)


@register_model(config=_blip_cfg())
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
    return build_blip("vit_base_patch16_224", _TINY_VISION, _TINY_TEXT, **{"embed_dim": 16, **kwargs})


@register_model(config=_blip_cfg(**_TINY))
def blip_tiny_caption(**kwargs) -> BLIP:
    """The tiny BLIP's captioner alone."""
    return build_blip("vit_base_patch16_224", _TINY_VISION, _TINY_TEXT, heads=("lm",), **{"embed_dim": 16, **kwargs})


@register_model(config=_blip_cfg(**_TINY))
def blip_tiny_retrieval(**kwargs) -> BLIP:
    """The tiny BLIP's ITC and ITM heads alone."""
    return build_blip("vit_base_patch16_224", _TINY_VISION, _TINY_TEXT, heads=("itc", "itm"),
                      **{"embed_dim": 16, **kwargs})


_LLAVA_PAPER = "Liu et al., Improved Baselines with Visual Instruction Tuning (LLaVA-1.5), CVPR 2024; Liu et al., " \
               "Visual Instruction Tuning, NeurIPS 2023"


def _llava_cfg(**kw) -> ModelConfig:
    base = dict(family="llava", task="caption", paper=_LLAVA_PAPER, input_size=(3, 336, 336), mean=OPENAI_MEAN,
                std=OPENAI_STD, crop_pct=1.0, num_classes=0)
    return ModelConfig(**{**base, **kw})


# CLIP ViT-L/14-336 (openai/clip-vit-large-patch14-336), as a transformers CLIPVisionConfig
_CLIP_L14_336 = dict(image_size=336, patch_size=14, hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                     num_attention_heads=16, hidden_act="quick_gelu", layer_norm_eps=1e-5)


@register_model(config=_llava_cfg(published_params_m=7000.0,  # the paper's "7B"
                                  smoke_kwargs={"vision_depth": 2, "img_size": 28, "text_n_layers": 1,
                                                "text_dim": 64, "text_n_heads": 4, "text_hidden_dim": 128}))
def llava15_7b(**kwargs) -> LLaVA:
    """LLaVA-1.5-7B: CLIP ViT-L/14-336 (block -2, no [CLS]: 576 image tokens) -> MLP 1024 -> 4096 -> 4096 ->
    Llama-2-7B (vocabulary 32064: Llama's 32000, ``<image>`` 32000 and padding 32001, as llava-hf's release)."""
    return build_llava(_CLIP_L14_336, "llama2_7b", language_kwargs={"vocab_size": 32064, "pad_token_id": 32001},
                       **{"image_token_id": 32000, **kwargs})


# the tiny LLaVA of the tests: a 3-block CLIP ViT of width 48 (32 x 32, 8 x 8 patches: 16 image tokens) and a
# 2-layer Llama of width 64 (4 heads, 2 key/value heads) over 120 tokens, <image> = 110
_TINY_CLIP = dict(image_size=32, patch_size=8, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, hidden_act="quick_gelu", layer_norm_eps=1e-5)
_TINY_LLAMA = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=128, vocab_size=120, max_seq_len=128)


@register_model(config=_llava_cfg(input_size=(3, 32, 32)))
def llava_tiny(**kwargs) -> LLaVA:
    """A tiny LLaVA for tests."""
    return build_llava(_TINY_CLIP, "llama_tiny", language_kwargs=_TINY_LLAMA, **{"image_token_id": 110, **kwargs})


# the scenes demo, trained from scratch on 64 x 64 images: a 3-block CLIP-style ViT of width 128 whose 16-pixel
# patches (16 image tokens, the last block's: a tower trained with the task has no better layer) come from a
# convolutional stem (Xiao et al., 2021), a 3-layer Llama of width 128; the caption / vqa tasks set the vocabulary,
# the placeholder and the context. The stem is what lets the tower tell the small objects apart wherever they lie in
# their cell, which a single linear projection of each patch does not learn from a few thousand scenes.
_SCENES_CLIP = dict(image_size=64, patch_size=16, hidden_size=128, intermediate_size=512, num_hidden_layers=3,
                    num_attention_heads=4, hidden_act="gelu", layer_norm_eps=1e-5)
_SCENES_LLAMA = dict(dim=128, n_layers=3, n_heads=4, hidden_dim=384, vocab_size=512, max_seq_len=256)


@register_model(config=_llava_cfg(input_size=(3, 64, 64), mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5)))
def llava_scenes(**kwargs) -> LLaVA:
    """A small LLaVA for the offline scenes: captions and visual questions learned from scratch on a CPU."""
    kw = {"image_token_id": 3, "vision_feature_layer": -1, **kwargs}
    return build_llava(_SCENES_CLIP, "llama_tiny", vision_kwargs={"embed_layer": "conv_stem"},
                       language_kwargs=_SCENES_LLAMA, **kw)
