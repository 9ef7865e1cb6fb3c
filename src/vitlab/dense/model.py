"""``DenseModel`` (a backbone read at chosen blocks + a decoder), :func:`create` and the registered end-to-end
configurations (``dpt_vit_base_patch16_384`` ...), listed by :func:`list_models` and ``vitlab models``.

The configurations live in their own registry rather than :mod:`vitlab.registry`: that one holds classifiers
(every entry answers the classifier API its registry-wide tests check); a dense model's output is a map. Each
record is the same :class:`vitlab.registry.ModelConfig`, so the profile (parameters, GMACs) is computed alike.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import replace
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

import vitlab
from vitlab.convert import load_state_dict, read_state_dict
from vitlab.dense.adapter import ViTAdapter
from vitlab.dense.backbone import feature_specs, is_plain, num_levels, vitdet_backbone
from vitlab.dense.dpt import DPT, convert_hf_state_dict
from vitlab.dense.heads import (
    SETRMLA,
    SETRPUP,
    LinearDepthHead,
    PyramidSegHead,
    SegmenterLinear,
    SegmenterMask,
    SemanticFPNHead,
    SETRNaive,
    SimpleFeaturePyramid,
)
from vitlab.registry import ModelConfig, UnknownModelError

HEADS = ("setr_naive", "setr_pup", "setr_mla", "segmenter_linear", "segmenter_mask", "dpt", "vitdet_sfp",
         "vit_adapter", "linear_depth")
DEPTH_HEADS = ("dpt", "linear_depth")
TASKS = ("segment", "depth")


def _four(n: int) -> list[int]:
    """Four evenly spaced blocks ending with the last (12 blocks: 2, 5, 8, 11; 24: 5, 11, 17, 23)."""
    return [n // 4 * (i + 1) - 1 for i in range(4)]


class DenseModel(nn.Module):
    """``forward(x) -> (B, K, H, W)`` class logits (segment) or (B, 1, H, W) depth (depth) at the input's size.

    ``backbone``: a vitlab model read through ``forward_intermediates`` at ``indices`` (``norm``: its final norm
    applied to each map), or wrapped by ``adapter`` (ViT-Adapter); ``head``: a decoder of :mod:`vitlab.dense`."""

    def __init__(self, backbone: nn.Module, head: nn.Module, indices: list[int], norm: bool, task: str,
                 num_classes: int, adapter: ViTAdapter | None = None):
        super().__init__()
        # the decoder is not called ``head``: vitlab.convert treats 'head.*' keys as a replaceable classifier
        self.backbone, self.decoder, self.adapter = backbone, head, adapter
        self.indices, self.norm, self.task, self.num_classes = list(indices), norm, task, num_classes
        self.prefix = is_plain(backbone) and getattr(backbone, "num_prefix_tokens", 0) > 0
        # parts of the classifier the dense forward never runs: dropped, so no parameter lacks a gradient (DDP)
        if hasattr(backbone, "fc_norm"):
            backbone.fc_norm = nn.Identity()
        if (adapter is not None or not norm) and hasattr(backbone, "norm"):
            backbone.norm = nn.Identity()
        self.grad_checkpointing = False

    def features(self, x: torch.Tensor):
        if self.adapter is not None:
            return self.adapter(x), None
        kw = dict(indices=self.indices, norm=self.norm, intermediates_only=True)
        if self.prefix:
            out = self.backbone.forward_intermediates(x, return_prefix_tokens=True, **kw)
            return [m for m, _ in out], [p for _, p in out]
        return list(self.backbone.forward_intermediates(x, **kw)), None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.decoder(*self.features(x))
        if tuple(y.shape[-2:]) != tuple(x.shape[-2:]):
            y = F.interpolate(y, size=x.shape[-2:], mode="bilinear", align_corners=False)
        return y

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable
        self.backbone.set_grad_checkpointing(enable)

    def shard_units(self) -> list[nn.Module]:
        """FSDP units: the backbone's blocks (or stages), then the decoder."""
        from vitlab.train.strategy import shard_units

        return [*shard_units(self.backbone), self.decoder]

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        fn = getattr(self.backbone, "no_weight_decay", None)
        return {f"backbone.{n}" for n in fn()} if callable(fn) else set()

    def checkpoint_filter_fn(self, sd: dict, model: nn.Module) -> dict:
        """Hugging Face DPT state dicts -> our keys; the backbone's own filter (position-embedding resampling)."""
        sd = convert_hf_state_dict(sd)
        if not any(k.startswith("dpt.") for k in sd) and hasattr(self.backbone, "checkpoint_filter_fn"):
            bb = {k[len("backbone."):]: v for k, v in sd.items() if k.startswith("backbone.")}
            bb = self.backbone.checkpoint_filter_fn(bb, self.backbone)
            sd = {**{k: v for k, v in sd.items() if not k.startswith("backbone.")},
                  **{f"backbone.{k}": v for k, v in bb.items()}}
        own = self.state_dict()
        unused = ("backbone.norm.", "backbone.fc_norm.", "backbone.head.")
        return {k: v for k, v in sd.items() if k in own or not k.startswith(unused)}


def create(head: str, backbone: str = "vit_base_patch16_224", num_classes: int | None = None, task: str | None = None,
           img_size: int | None = None, in_chans: int = 3, indices: list[int] | None = None,
           backbone_kwargs: dict | None = None, head_kwargs: dict | None = None, checkpoint_path: str | None = None,
           backbone_checkpoint: str | None = None, drop_path_rate: float = 0.0, strict: bool = True) -> DenseModel:
    """Build a dense model: a registered configuration by name (``create('dpt_vit_base_patch16_384')``), or a
    ``head`` of :data:`HEADS` over any registered ``backbone`` (plain or hierarchical).

    ``indices``: the blocks / stages the head reads (default: the head's: last block; four evenly spaced for
    SETR-MLA and DPT; all four stages of a hierarchical backbone). ``backbone_checkpoint``: classifier weights
    for the backbone (timm / vitlab file); ``checkpoint_path``: weights of the whole dense model (ours, or a
    Hugging Face DPT state dict). ``head_kwargs``: the decoder's options (e.g. ``readout='add'``,
    ``window_size=14``, ``global_blocks=[2, 5, 8, 11]`` for ViTDet, ``interactions`` for ViT-Adapter)."""
    if head in _CONFIGS:
        return create_registered(head, num_classes=num_classes, task=task, img_size=img_size,
                                 checkpoint_path=checkpoint_path, strict=strict, drop_path_rate=drop_path_rate)
    if head not in HEADS:
        raise ValueError(f"unknown dense head or model {head!r}; heads: {', '.join(HEADS)}; "
                         f"models: {', '.join(list_models())}")
    task = task or "segment"
    num_classes = 150 if num_classes is None else num_classes
    if task not in TASKS:
        raise ValueError(f"unknown dense task {task!r}; choose from {', '.join(TASKS)}")
    if task == "depth" and head not in DEPTH_HEADS:
        raise ValueError(f"head {head!r} predicts classes; depth heads: {', '.join(DEPTH_HEADS)}")
    if task == "segment" and head == "linear_depth":
        raise ValueError("linear_depth is a depth head; use task='depth'")
    if task == "segment" and num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    hk = dict(head_kwargs or {})
    bk = dict(backbone_kwargs or {})
    if img_size is not None:
        bk["img_size"] = img_size
    if head == "vitdet_sfp":
        bk.setdefault("class_token", False)  # ViTDet's backbone: patch tokens only, windowed
        bk.setdefault("global_pool", "avg")
    bb = vitlab.create_model(backbone, num_classes=0, in_chans=in_chans, drop_path_rate=drop_path_rate,
                             checkpoint_path=backbone_checkpoint, strict=False if backbone_checkpoint else True, **bk)
    plain = is_plain(bb)
    n = num_levels(bb)
    if head == "vitdet_sfp":
        vitdet_backbone(bb, hk.pop("window_size", 14), hk.pop("global_blocks", None), hk.pop("rel_pos", False))
    if indices is None:
        indices = _four(n) if plain and head in ("setr_mla", "dpt") else (
            list(range(n)) if not plain and head in ("setr_mla", "dpt") else [n - 1])
    indices = [i % n for i in indices]
    ch_st = feature_specs(bb, indices)
    chans, strides = [c for c, _ in ch_st], [s for _, s in ch_st]
    norm, adapter = True, None
    K = num_classes if task == "segment" else 1
    if head == "setr_naive":
        dec = SETRNaive(chans, K, **hk)
    elif head == "setr_pup":
        dec = SETRPUP(chans, K, stride=strides[-1], **hk)
    elif head == "setr_mla":
        dec = SETRMLA(chans, K, up=max(1, min(4, strides[0] // 4)), **hk)
    elif head == "segmenter_linear":
        dec = SegmenterLinear(chans, K)
    elif head == "segmenter_mask":
        dec = SegmenterMask(chans, K, **hk)
    elif head == "dpt":
        norm = False  # DPT reads the blocks' raw outputs
        if not getattr(bb, "num_prefix_tokens", 0) or not plain:
            hk.setdefault("readout", "ignore")
        dec = DPT(chans, strides, K, task, **hk)
    elif head == "vitdet_sfp":
        out_ch = hk.pop("out_channels", 256)
        # the paper's strides 4, 8, 16, 32 whatever the patch (ViT-B/16: scales 4, 2, 1, 1/2)
        scales = hk.pop("scales", None) or [strides[-1] / t for t in (4, 8, 16, 32)]
        sfp = SimpleFeaturePyramid(chans, out_ch, scales)
        out_strides = [int(strides[-1] / s) for s in sfp.scales]
        dec = PyramidSegHead(sfp, SemanticFPNHead([out_ch] * 4, out_strides, K, **hk))
    elif head == "vit_adapter":
        if not plain:
            raise ValueError("ViT-Adapter needs a plain ViT backbone")
        adapter = ViTAdapter(bb, interactions=hk.pop("interactions", None), num_heads=hk.pop("num_heads", None),
                             in_chans=in_chans, extra_extractors=hk.pop("extra_extractors", 0))
        dec = SemanticFPNHead([bb.embed_dim] * 4, [4, 8, 16, 32], K, **hk)
    else:  # linear_depth
        dec = LinearDepthHead(chans, use_cls=bool(getattr(bb, "num_prefix_tokens", 0)), **hk)
    model = DenseModel(bb, dec, indices, norm, task, K, adapter)
    model.pretrained_cfg = ModelConfig(name=f"{head}_{backbone}", family="dense", input_size=(
        in_chans, *(bb.patch_embed.img_size if hasattr(bb, "patch_embed") else (224, 224))),
        mean=bb.pretrained_cfg.mean, std=bb.pretrained_cfg.std, num_classes=K)
    if checkpoint_path is not None:
        load_state_dict(model, read_state_dict(checkpoint_path), strict=strict, source=str(checkpoint_path))
    return model


# ---------------------------------------------------------------- registered configurations

_CONFIGS: dict[str, ModelConfig] = {}
_BUILDERS: dict[str, Callable[..., dict]] = {}


def register(name: str, config: ModelConfig, **spec) -> None:
    """Register an end-to-end configuration: ``spec`` holds :func:`create`'s arguments."""
    if name in _CONFIGS:
        raise ValueError(f"dense model {name!r} is registered twice")
    _CONFIGS[name] = replace(config, name=name, family=config.family or "dense")
    _BUILDERS[name] = spec


def list_models(pattern: str | list[str] = "*") -> list[str]:
    """Registered dense configurations matching an fnmatch ``pattern`` (or any of a list), sorted."""
    pats = [pattern] if isinstance(pattern, str) else list(pattern)
    return sorted(n for n in _CONFIGS if any(fnmatch.fnmatch(n, p) for p in pats))


def get_config(name: str) -> ModelConfig:
    if name not in _CONFIGS:
        import difflib

        close = difflib.get_close_matches(name, list(_CONFIGS), n=5, cutoff=0.6)
        raise UnknownModelError(f"unknown dense model {name!r}" + (f"; close matches: {', '.join(close)}" if close
                                                                  else f"; see {', '.join(list_models())}"))
    return _CONFIGS[name]


def create_registered(name: str, num_classes: int | None = None, task: str | None = None,
                      img_size: int | None = None, checkpoint_path: str | None = None, strict: bool = True,
                      **overrides) -> DenseModel:
    cfg = get_config(name)
    spec = {**_BUILDERS[name], **{k: v for k, v in overrides.items() if v}}
    if num_classes is not None:
        spec["num_classes"] = num_classes
    if task is not None:
        spec["task"] = task
    spec["img_size"] = img_size or cfg.input_size[-1]
    model = create(spec.pop("head"), checkpoint_path=checkpoint_path, strict=strict, **spec)
    model.pretrained_cfg = replace(cfg, input_size=(cfg.input_size[0], spec["img_size"], spec["img_size"]))
    return model


def model_rows(pattern: str | list[str] = "*") -> list[dict]:
    """Rows like :func:`vitlab.profile.model_rows` (params, GMACs at the default input) for ``vitlab models``."""
    from vitlab.profile import profile_model, profile_row

    rows = []
    for name in list_models(pattern):
        with torch.device("meta"):
            model = create_registered(name)
        rows.append(profile_row(get_config(name), profile_model(model, activations=False)))
    return rows


def _cfg(paper: str, size: int, num_classes: int = 150, **kw) -> ModelConfig:
    from vitlab.registry import INCEPTION_MEAN, INCEPTION_STD

    return ModelConfig(family="dense", paper=paper, input_size=(3, size, size), mean=INCEPTION_MEAN,
                       std=INCEPTION_STD, crop_pct=1.0, num_classes=num_classes, **kw)


_DPT = "Ranftl et al., Vision Transformers for Dense Prediction, ICCV 2021"
_SETR = "Zheng et al., Rethinking Semantic Segmentation from a Sequence-to-Sequence Perspective, CVPR 2021"
_SEG = "Strudel et al., Segmenter: Transformer for Semantic Segmentation, ICCV 2021"
_VITDET = "Li et al., Exploring Plain Vision Transformer Backbones for Object Detection, ECCV 2022"
_ADAPTER = "Chen et al., Vision Transformer Adapter for Dense Predictions, ICLR 2023"
_DINO2 = "Oquab et al., DINOv2: Learning Robust Visual Features without Supervision, TMLR 2024"
# Hugging Face's DPT configs use LayerNorm eps 1e-12 in the ViT (timm's is 1e-6): kept so HF weights predict alike
_HF_LN = {"norm_layer": partial(nn.LayerNorm, eps=1e-12)}

register("dpt_vit_base_patch16_384", _cfg(_DPT, 384), head="dpt", backbone="vit_base_patch16_224",
         backbone_kwargs=_HF_LN)
register("dpt_vit_base_patch16_384_depth", _cfg(_DPT, 384, num_classes=1), head="dpt", task="depth",
         backbone="vit_base_patch16_224", backbone_kwargs=_HF_LN)
register("dpt_vit_large_patch16_384", _cfg(_DPT, 384), head="dpt", backbone="vit_large_patch16_224",
         backbone_kwargs=_HF_LN, head_kwargs={"hidden": (256, 512, 1024, 1024)})
register("dpt_vit_large_patch16_384_depth", _cfg(_DPT, 384, num_classes=1), head="dpt", task="depth",
         backbone="vit_large_patch16_224", backbone_kwargs=_HF_LN, head_kwargs={"hidden": (256, 512, 1024, 1024)})
register("setr_naive_vit_large_patch16_512", _cfg(_SETR, 512), head="setr_naive", backbone="vit_large_patch16_224")
register("setr_pup_vit_large_patch16_512", _cfg(_SETR, 512), head="setr_pup", backbone="vit_large_patch16_224")
register("setr_mla_vit_large_patch16_512", _cfg(_SETR, 512), head="setr_mla", backbone="vit_large_patch16_224")
register("segmenter_linear_vit_small_patch16_512", _cfg(_SEG, 512), head="segmenter_linear",
         backbone="vit_small_patch16_224")
register("segmenter_mask_vit_small_patch16_512", _cfg(_SEG, 512), head="segmenter_mask",
         backbone="vit_small_patch16_224")
register("segmenter_mask_vit_base_patch16_512", _cfg(_SEG, 512), head="segmenter_mask", backbone="vit_base_patch16_224")
register("vitdet_sfp_vit_base_patch16_1024", _cfg(_VITDET, 1024), head="vitdet_sfp", backbone="vit_base_patch16_224")
register("vit_adapter_vit_small_patch16_512", _cfg(_ADAPTER, 512), head="vit_adapter",
         backbone="vit_small_patch16_224")
register("linear_depth_vit_small_patch16_448", _cfg(_DINO2, 448, num_classes=1), head="linear_depth", task="depth",
         backbone="vit_small_patch16_224")
