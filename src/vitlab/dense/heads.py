"""Decoders over backbone feature maps -- SETR, Segmenter, the ViTDet simple feature pyramid, a semantic FPN and
DINOv2's linear depth head -- and the dense head registry that :func:`vitlab.dense.create` builds from.

A head is an ``nn.Module`` built as ``cls(in_channels: list[int], num_classes: int, **kwargs)`` whose
``forward(features: list[Tensor])`` takes the backbone's NCHW maps at the chosen blocks (their channels:
``in_channels``) and returns (B, num_classes, h, w) at some stride (a depth head: num_classes 1); the model
upsamples to the input. ``@register_head(name, ...)`` adds one; its metadata says which tasks it predicts, whether
its forward also takes the prefix ([CLS]) tokens (``forward(features, prefix)``, prefix: one (B, P, C) tensor a
map, or None for a backbone without them), which blocks it reads by default, and defaults for the backbone. A head
that needs more than channels and classes to be built (strides, the backbone itself) registers a builder
``fn(ctx: HeadContext, **kwargs) -> Decoder`` with ``builder=True``; the built-in heads below show both forms
(DPT, :mod:`vitlab.dense.dpt`, and ViT-Adapter, :mod:`vitlab.dense.adapter`, register here too).

- SETR (Zheng et al., 2021, "Rethinking Semantic Segmentation from a Sequence-to-Sequence Perspective",
  Sec. 3.3, Fig. 1): *naive* -- 1x1 conv, BN, ReLU, 1x1 conv to classes, bilinear to full size; *PUP* --
  progressive upsampling, four times conv 3x3 + BN + ReLU + 2x bilinear (16x in all), then a 1x1 classifier;
  *MLA* -- four levels (blocks 2, 5, 8, 11 of ViT-B: evenly spaced), each reduced by a 1x1 conv, aggregated
  top-down by element-wise addition, each stream through two 3x3 convs and 4x bilinear upsampling, concatenated,
  then a 1x1 classifier.
- Segmenter (Strudel et al., 2021, "Segmenter: Transformer for Semantic Segmentation", Sec. 3.2): *linear* -- a
  point-wise linear layer on the patch tokens; *mask transformer* -- K learned class embeddings appended to the
  (projected) patch tokens as extra tokens, M transformer layers over the joint sequence, then the L2-normalised
  patch and class embeddings give masks = patches . classes^T (Eq. 2), a LayerNorm over the K masks, reshaped to
  the grid.
- ViTDet simple feature pyramid (Li et al., 2022, Sec. 3, Fig. 2c): from the last (stride-16) map only,
  strides 4 / 8 / 16 / 32 by two stride-2 deconvolutions (with LayerNorm + GELU between) / one deconvolution /
  identity / 2x2 max-pooling, each followed by a 1x1 and a 3x3 conv with LayerNorm.
- Semantic FPN head (Kirillov et al., 2019, "Panoptic Feature Pyramid Networks", Sec. 3, Fig. 3): each pyramid
  level to stride 4 by conv 3x3 + BN + ReLU + 2x upsampling stages, summed, a 1x1 classifier -- the decoder
  put on the ViTDet pyramid and the ViT-Adapter pyramid here (ViT-Adapter itself uses UperNet).
- Linear depth head of DINOv2 (Oquab et al., 2023, Sec. 7.4, "lin. 1" / "lin. 4"): the [CLS] token
  concatenated to every patch token of the last (or last four) blocks, BatchNorm, a 1x1 conv to 256 depth bins,
  bilinear 4x; depth = sum of uniformly spaced bin centres weighted by the normalised ReLU of the logits
  (the "classification" regression of AdaBins used in DINOv2's depth evaluation).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from vitlab.attention import Block
from vitlab.dense.adapter import ViTAdapter
from vitlab.dense.backbone import is_plain, vitdet_backbone
from vitlab.dense.dpt import DPT

TASKS = ("segment", "depth")  # what a dense head predicts: class logits a pixel, or depth


@dataclass(frozen=True)
class HeadContext:
    """What a head builder may read: the built backbone, the maps it gives at the chosen blocks and the output."""

    backbone: nn.Module
    in_channels: list[int]  # channels of each map
    strides: list[int]      # input pixels per map cell, each map
    num_classes: int        # output channels: the classes (segment) or 1 (depth)
    task: str               # 'segment' or 'depth'
    in_chans: int           # image channels
    has_prefix: bool        # the backbone gives prefix ([CLS]) tokens


class Decoder(NamedTuple):
    """What a builder returns: the head and, for a head that replaces how the backbone is read (ViT-Adapter), the
    module that turns the image into the head's maps."""

    head: nn.Module
    adapter: nn.Module | None = None


@dataclass(frozen=True)
class HeadSpec:
    """A registered head: how it is built and what it needs (see :func:`register_head`)."""

    name: str
    build: Callable[..., Any]
    tasks: tuple[str, ...] = ("segment",)
    prefix_tokens: bool = False
    multi_level: bool = False
    norm: bool = True
    backbone_kwargs: Mapping[str, Any] = field(default_factory=dict)
    builder: bool = False

    def make(self, ctx: HeadContext, kwargs: dict) -> Decoder:
        if self.builder:
            return self.build(ctx, **kwargs)
        return Decoder(self.build(ctx.in_channels, ctx.num_classes, **kwargs))


_HEADS: dict[str, HeadSpec] = {}


def register_head(name: str, *, tasks: tuple[str, ...] = ("segment",), prefix_tokens: bool = False,
                  multi_level: bool = False, norm: bool = True, backbone_kwargs: Mapping[str, Any] | None = None,
                  builder: bool = False):
    """Decorator: register a dense head under ``name``.

    ``tasks``: what it predicts (``segment``, ``depth`` or both; the first is the default). ``prefix_tokens``: its
    forward takes ``(features, prefix)``. ``multi_level``: it reads four evenly spaced blocks of a plain ViT (every
    stage of a hierarchical backbone) by default instead of the last. ``norm``: the backbone's final norm is applied
    to each map. ``backbone_kwargs``: defaults for the backbone's ``create_model``. ``builder``: the decorated
    object is ``fn(ctx: HeadContext, **head_kwargs) -> Decoder`` instead of a class built as
    ``cls(in_channels, num_classes, **head_kwargs)``."""
    bad = [t for t in tasks if t not in TASKS]
    if not tasks or bad:
        raise ValueError(f"head {name!r}: tasks must be some of {', '.join(TASKS)}, got {tasks!r}")

    def deco(obj):
        if name in _HEADS:
            raise ValueError(f"dense head {name!r} is registered twice")
        _HEADS[name] = HeadSpec(name, obj, tasks=tuple(tasks), prefix_tokens=prefix_tokens, multi_level=multi_level,
                                norm=norm, backbone_kwargs=dict(backbone_kwargs or {}), builder=builder)
        return obj

    return deco


def list_heads(task: str | None = None) -> list[str]:
    """The registered heads (that predict ``task``, if given), sorted."""
    return sorted(n for n, h in _HEADS.items() if task is None or task in h.tasks)


def get_head(name: str) -> HeadSpec:
    if name not in _HEADS:
        raise ValueError(f"unknown dense head {name!r}; heads: {', '.join(list_heads())}")
    return _HEADS[name]


def conv_bn_relu(cin: int, cout: int, k: int = 3) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, k, padding=k // 2, bias=False), nn.BatchNorm2d(cout), nn.ReLU(True))


def _up(x: torch.Tensor, size) -> torch.Tensor:
    return x if tuple(x.shape[-2:]) == tuple(size) else F.interpolate(x, size=size, mode="bilinear",
                                                                       align_corners=False)


class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over the channels of an NCHW map (ViTDet's, ConvNeXt's)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias,
                            self.eps).permute(0, 3, 1, 2)


@register_head("setr_naive")
class SETRNaive(nn.Module):
    """SETR-Naive: 1x1 conv + BN + ReLU + 1x1 conv to classes on the last map (stride 16)."""

    def __init__(self, in_channels: list[int], num_classes: int, channels: int = 256):
        super().__init__()
        self.fc = nn.Sequential(conv_bn_relu(in_channels[-1], channels, 1), nn.Conv2d(channels, num_classes, 1))

    def forward(self, maps: list[torch.Tensor]) -> torch.Tensor:
        return self.fc(maps[-1])


class SETRPUP(nn.Module):
    """SETR-PUP: ``num_up`` stages of conv 3x3 + BN + ReLU + 2x bilinear, then a 1x1 classifier; ``num_up``
    defaults to log2 of the map's stride (4 for patch 16: back to full resolution)."""

    def __init__(self, in_channels: list[int], num_classes: int, channels: int = 256, num_up: int | None = None,
                 stride: int = 16):
        super().__init__()
        num_up = max(1, stride.bit_length() - 1) if num_up is None else num_up
        self.stages = nn.ModuleList(conv_bn_relu(in_channels[-1] if i == 0 else channels, channels)
                                    for i in range(num_up))
        self.cls = nn.Conv2d(channels, num_classes, 1)

    def forward(self, maps: list[torch.Tensor]) -> torch.Tensor:
        x = maps[-1]
        for stage in self.stages:
            x = F.interpolate(stage(x), scale_factor=2, mode="bilinear", align_corners=False)
        return self.cls(x)


class SETRMLA(nn.Module):
    """SETR-MLA: 1x1 reduce each level, top-down addition, two 3x3 convs and 4x upsampling per stream, concat,
    1x1 classifier (a coarser level of a hierarchical backbone is resized to the finer one before the sum)."""

    def __init__(self, in_channels: list[int], num_classes: int, channels: int = 256, mla_channels: int = 128,
                 up: int = 4):
        super().__init__()
        self.up = up  # 4x per stream (stride 16 -> 4); less for a finer map
        self.reduce = nn.ModuleList(conv_bn_relu(c, channels, 1) for c in in_channels)
        self.streams = nn.ModuleList(
            nn.Sequential(conv_bn_relu(channels, channels), conv_bn_relu(channels, mla_channels)) for _ in in_channels)
        self.cls = nn.Conv2d(mla_channels * len(in_channels), num_classes, 1)

    def forward(self, maps: list[torch.Tensor]) -> torch.Tensor:
        r = [m(x) for m, x in zip(self.reduce, maps, strict=True)]
        agg, acc = [], None
        for x in reversed(r):  # top-down: the deepest level first, each level adds the aggregate above it
            acc = x if acc is None else x + _up(acc, x.shape[-2:])
            agg.append(acc)
        agg = agg[::-1]
        size = (agg[0].shape[-2] * self.up, agg[0].shape[-1] * self.up)
        outs = [_up(F.interpolate(s(a), scale_factor=self.up, mode="bilinear", align_corners=False), size)
                for s, a in zip(self.streams, agg, strict=True)]
        return self.cls(torch.cat(outs, dim=1))


@register_head("segmenter_linear")
class SegmenterLinear(nn.Module):
    """Segmenter's linear decoder: a point-wise linear layer (1x1 conv) on the last map's patch tokens."""

    def __init__(self, in_channels: list[int], num_classes: int):
        super().__init__()
        self.head = nn.Conv2d(in_channels[-1], num_classes, 1)

    def forward(self, maps: list[torch.Tensor]) -> torch.Tensor:
        return self.head(maps[-1])


@register_head("segmenter_mask")
class SegmenterMask(nn.Module):
    """Segmenter's mask transformer: class embeddings as tokens beside the patch tokens, ``depth`` pre-norm
    blocks over both, masks from the product of L2-normalised patch and class embeddings, LayerNorm over classes."""

    def __init__(self, in_channels: list[int], num_classes: int, dim: int | None = None, depth: int = 2,
                 num_heads: int | None = None, drop_path: float = 0.0):
        super().__init__()
        cin = in_channels[-1]
        dim = dim or cin
        num_heads = num_heads or max(1, dim // 64)
        self.num_classes = num_classes
        self.proj_dec = nn.Linear(cin, dim)
        self.cls_emb = nn.Parameter(torch.randn(1, num_classes, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, num_heads, drop_path=drop_path) for _ in range(depth))
        self.decoder_norm = nn.LayerNorm(dim)
        self.proj_patch = nn.Parameter(dim ** -0.5 * torch.randn(dim, dim))
        self.proj_classes = nn.Parameter(dim ** -0.5 * torch.randn(dim, dim))
        self.mask_norm = nn.LayerNorm(num_classes)

    def forward(self, maps: list[torch.Tensor]) -> torch.Tensor:
        x = maps[-1]
        B, _, h, w = x.shape
        t = self.proj_dec(x.flatten(2).transpose(1, 2))
        t = torch.cat([t, self.cls_emb.expand(B, -1, -1)], dim=1)
        for blk in self.blocks:
            t = blk(t)
        t = self.decoder_norm(t)
        patches, classes = t[:, : h * w] @ self.proj_patch, t[:, h * w:] @ self.proj_classes
        patches, classes = F.normalize(patches, dim=-1), F.normalize(classes, dim=-1)
        masks = self.mask_norm(patches @ classes.transpose(1, 2))  # (B, h*w, K)
        return masks.transpose(1, 2).reshape(B, self.num_classes, h, w)


class SimpleFeaturePyramid(nn.Module):
    """ViTDet's simple feature pyramid from the last map (stride s): one stage per scale -- 4: two 2x deconvs
    (LayerNorm + GELU between), 2: one deconv, 1: identity, 1/2: 2x2 max-pool -- then a 1x1 and a 3x3 conv, each
    followed by LayerNorm (Li et al., 2022, Sec. 3 and Fig. 2). Scales 4, 2, 1, 0.5 give strides 4, 8, 16, 32
    for a patch-16 ViT; other powers of two extend the same rule (2^n: n deconvs; 1/k: k x k max-pool), so a
    patch-4 ViT reaches the same strides with 1, 1/2, 1/4, 1/8. ``forward(maps) -> list`` of
    (B, out_channels, .) maps."""

    def __init__(self, in_channels: list[int], out_channels: int = 256, scales=(4.0, 2.0, 1.0, 0.5)):
        super().__init__()
        c = in_channels[-1]
        self.scales = tuple(float(s) for s in scales)
        self.stages = nn.ModuleList()
        for s in self.scales:
            n = math.log2(s)
            if s <= 0 or n != round(n):
                raise ValueError(f"simple feature pyramid scale {s} is not a power of two (4, 2, 1, 0.5 ...)")
            layers, cout = [], c
            for i in range(max(0, round(n))):  # upsampling: deconvs halving the width, LN + GELU between
                if i:
                    layers += [LayerNorm2d(cout, eps=1e-6), nn.GELU()]
                layers += [nn.ConvTranspose2d(cout, cout // 2, 2, 2)]
                cout //= 2
            if n < 0:
                layers += [nn.MaxPool2d(round(1 / s), round(1 / s))]
            layers += [nn.Conv2d(cout, out_channels, 1, bias=False), LayerNorm2d(out_channels, eps=1e-6),
                       nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False),
                       LayerNorm2d(out_channels, eps=1e-6)]
            self.stages.append(nn.Sequential(*layers))

    def forward(self, maps: list[torch.Tensor]) -> list[torch.Tensor]:
        return [stage(maps[-1]) for stage in self.stages]


class SemanticFPNHead(nn.Module):
    """Panoptic FPN's semantic branch over a pyramid (strides 4, 8, 16, 32): each level to stride 4 through
    conv + BN + ReLU (+ 2x upsampling) stages, summed, then a 1x1 classifier."""

    def __init__(self, in_channels: list[int], strides: list[int], num_classes: int, channels: int = 128):
        super().__init__()
        base = min(strides)
        self.levels = nn.ModuleList()
        for c, s in zip(in_channels, strides, strict=True):
            n = max(1, (s // base).bit_length() - 1)  # stride 4 -> 1 conv, 8 -> 1 (+2x), 16 -> 2, 32 -> 3
            self.levels.append(nn.ModuleList(conv_bn_relu(c if i == 0 else channels, channels) for i in range(n)))
        self.ups = [s // base for s in strides]
        self.cls = nn.Conv2d(channels, num_classes, 1)

    def forward(self, maps: list[torch.Tensor]) -> torch.Tensor:
        out = None
        for convs, up, x in zip(self.levels, self.ups, maps, strict=True):
            for conv in convs:
                x = conv(x)
                if up > 1:
                    x = F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)
            out = x if out is None else out + _up(x, out.shape[-2:])
        return self.cls(out)


class PyramidSegHead(nn.Module):
    """A neck that returns a pyramid (SFP) followed by the semantic FPN head."""

    def __init__(self, neck: nn.Module, head: nn.Module):
        super().__init__()
        self.neck, self.head = neck, head

    def forward(self, maps: list[torch.Tensor]) -> torch.Tensor:
        return self.head(self.neck(maps))


class LinearDepthHead(nn.Module):
    """DINOv2's linear depth head: [patch tokens, CLS] of each chosen block concatenated, BatchNorm, 1x1 conv to
    ``n_bins`` logits, 4x bilinear, then depth = sum_k softmax-free weights (ReLU + eps, normalised) x centres."""

    def __init__(self, in_channels: list[int], n_bins: int = 256, min_depth: float = 1e-3, max_depth: float = 10.0,
                 use_cls: bool = True, upsample: int = 4):
        super().__init__()
        c = sum(in_channels) * (2 if use_cls else 1)
        self.use_cls, self.upsample = use_cls, upsample
        self.bn = nn.BatchNorm2d(c)
        self.conv_depth = nn.Conv2d(c, n_bins, 1)
        self.register_buffer("bins", torch.linspace(min_depth, max_depth, n_bins), persistent=False)

    def forward(self, maps: list[torch.Tensor], prefix: list[torch.Tensor] | None = None) -> torch.Tensor:
        feats = []
        for i, m in enumerate(maps):
            feats.append(m)
            if self.use_cls:
                if prefix is None:
                    raise ValueError("the linear depth head with use_cls needs a backbone with a class token")
                feats.append(prefix[i][:, 0, :, None, None].expand_as(m))
        logits = self.conv_depth(self.bn(torch.cat(feats, dim=1)))
        if self.upsample > 1:
            logits = F.interpolate(logits, scale_factor=self.upsample, mode="bilinear", align_corners=False)
        w = torch.relu(logits) + 0.1  # DINOv2 / Depth-Anything's 'linear' normalisation of the bin weights
        w = w / w.sum(dim=1, keepdim=True)
        return torch.einsum("bkhw,k->bhw", w, self.bins.to(w.dtype)).unsqueeze(1)


# ---------------------------------------------------------------- built-in heads that need more than channels

@register_head("setr_pup", builder=True)
def _setr_pup(ctx: HeadContext, **kwargs) -> Decoder:
    return Decoder(SETRPUP(ctx.in_channels, ctx.num_classes, stride=ctx.strides[-1], **kwargs))


@register_head("setr_mla", multi_level=True, builder=True)
def _setr_mla(ctx: HeadContext, **kwargs) -> Decoder:
    return Decoder(SETRMLA(ctx.in_channels, ctx.num_classes, up=max(1, min(4, ctx.strides[0] // 4)), **kwargs))


@register_head("dpt", tasks=("segment", "depth"), prefix_tokens=True, multi_level=True, norm=False, builder=True)
def _dpt(ctx: HeadContext, **kwargs) -> Decoder:
    """DPT reads the blocks' raw outputs (no final norm); without prefix tokens its readout is ``ignore``."""
    if not ctx.has_prefix:
        kwargs.setdefault("readout", "ignore")
    return Decoder(DPT(ctx.in_channels, ctx.strides, ctx.num_classes, ctx.task, **kwargs))


@register_head("vitdet_sfp", backbone_kwargs={"class_token": False, "global_pool": "avg"}, builder=True)
def _vitdet_sfp(ctx: HeadContext, window_size: int = 14, global_blocks: list[int] | None = None,
                rel_pos: bool = False, out_channels: int = 256, scales: list[float] | None = None,
                **kwargs) -> Decoder:
    """ViTDet: the backbone (patch tokens only) made windowed in place, the simple feature pyramid from its last
    map at the paper's strides 4, 8, 16, 32 whatever the patch (ViT-B/16: scales 4, 2, 1, 1/2), a semantic FPN."""
    vitdet_backbone(ctx.backbone, window_size, global_blocks, rel_pos)
    sfp = SimpleFeaturePyramid(ctx.in_channels, out_channels, scales or [ctx.strides[-1] / t for t in (4, 8, 16, 32)])
    out_strides = [int(ctx.strides[-1] / s) for s in sfp.scales]
    return Decoder(PyramidSegHead(sfp, SemanticFPNHead([out_channels] * 4, out_strides, ctx.num_classes, **kwargs)))


@register_head("vit_adapter", builder=True)
def _vit_adapter(ctx: HeadContext, interactions: list[list[int]] | None = None, num_heads: int | None = None,
                 extra_extractors: int = 0, **kwargs) -> Decoder:
    """ViT-Adapter around the plain ViT (its pyramid at strides 4, 8, 16, 32), a semantic FPN head over it."""
    if not is_plain(ctx.backbone):
        raise ValueError("ViT-Adapter needs a plain ViT backbone")
    adapter = ViTAdapter(ctx.backbone, interactions=interactions, num_heads=num_heads, in_chans=ctx.in_chans,
                         extra_extractors=extra_extractors)
    dim = ctx.backbone.embed_dim
    return Decoder(SemanticFPNHead([dim] * 4, [4, 8, 16, 32], ctx.num_classes, **kwargs), adapter)


@register_head("linear_depth", tasks=("depth",), prefix_tokens=True, builder=True)
def _linear_depth(ctx: HeadContext, **kwargs) -> Decoder:
    """DINOv2's linear depth head, with the [CLS] token where the backbone has one."""
    return Decoder(LinearDepthHead(ctx.in_channels, use_cls=ctx.has_prefix, **kwargs))
