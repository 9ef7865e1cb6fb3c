"""EfficientFormer (Li et al., 2022, "EfficientFormer: Vision Transformers at MobileNet Speed", NeurIPS 2022).

What it computes: a dimension-consistent design in two parts.

- a stem of two 3x3 stride-2 convolutions (BatchNorm, ReLU) to stride 4;
- four stages at strides 4, 8, 16, 32 (a 3x3 stride-2 convolution + BatchNorm between stages) of *MetaBlock4D*
  blocks on (B, C, H, W) maps: ``x + ls1 * (AvgPool3x3(x) - x)`` (the PoolFormer pooling token mixer) then
  ``x + ls2 * ConvMLP(x)`` with 1x1 convolutions, BatchNorm after each, GELU, expansion 4; ``ls`` is LayerScale;
- in the last stage, its last ``num_vit`` blocks are *MetaBlock3D* on (B, N, C) tokens (the map is flattened once,
  by the ``Flat`` entry of the stage): pre-LayerNorm multi-head self-attention (8 heads, key dimension 32, value
  dimension 4 * 32, LeViT's learned bias per offset (|dy|, |dx|) instead of a position embedding) and a
  pre-LayerNorm linear MLP, each with LayerScale;
- a final LayerNorm, the average of the tokens, and two linear heads (class and distillation, DeiT-style): the
  mean of both in eval, a tuple of both in training (``distilled_training``).

The attention biases are tied to the last stage's grid (7x7 at 224x224): a model built for another ``img_size``
works at that size; other sizes raise a ``ValueError``. Module names follow timm, so timm state dicts load as is.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from vitlab.attention.offset_bias import EfficientFormerAttention, fold_offset_biases
from vitlab.layers import (
    DropPath,
    LayerScale,
    LayerScale2d,
    Mlp,
    check_image,
    check_pool,
    checkpoint_seq,
    downsample_size,
    drop_path_schedule,
    init_linears_trunc_normal_,
    intermediates_plan,
    to_2tuple,
)
from vitlab.models._base import TimmApiMixin
from vitlab.registry import ModelConfig, register_model

__all__ = ["EfficientFormer"]


class Stem4(nn.Sequential):
    """conv3x3/2 -> BN -> ReLU -> conv3x3/2 -> BN -> ReLU: (B, 3, H, W) -> (B, C, H/4, W/4)."""

    def __init__(self, in_chs: int, out_chs: int):
        super().__init__()
        self.stride = 4
        self.conv1 = nn.Conv2d(in_chs, out_chs // 2, 3, stride=2, padding=1)
        self.norm1 = nn.BatchNorm2d(out_chs // 2)
        self.act1 = nn.ReLU()
        self.conv2 = nn.Conv2d(out_chs // 2, out_chs, 3, stride=2, padding=1)
        self.norm2 = nn.BatchNorm2d(out_chs)
        self.act2 = nn.ReLU()


class Downsample(nn.Module):
    """conv3x3/2 -> BN between stages: (B, Cin, H, W) -> (B, Cout, ceil(H/2), ceil(W/2))."""

    def __init__(self, in_chs: int, out_chs: int):
        super().__init__()
        self.conv = nn.Conv2d(in_chs, out_chs, 3, stride=2, padding=1)
        self.norm = nn.BatchNorm2d(out_chs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.conv(x))


class Flat(nn.Module):
    """(B, C, H, W) -> (B, H*W, C): the switch from the 4-D to the 3-D blocks."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(2).transpose(1, 2)


class Pooling(nn.Module):
    """PoolFormer's token mixer, ``AvgPool3x3(x) - x`` (the block adds x back)."""

    def __init__(self, pool_size: int = 3):
        super().__init__()
        self.pool = nn.AvgPool2d(pool_size, stride=1, padding=pool_size // 2, count_include_pad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(x) - x


class ConvMlpWithNorm(nn.Module):
    """1x1 conv -> BN -> GELU -> 1x1 conv -> BN on (B, C, H, W)."""

    def __init__(self, dim: int, hidden: int, drop: float = 0.0):
        super().__init__()
        self.fc1 = nn.Conv2d(dim, hidden, 1)
        self.norm1 = nn.BatchNorm2d(hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Conv2d(hidden, dim, 1)
        self.norm2 = nn.BatchNorm2d(dim)
        self.drop = nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.act(self.norm1(self.fc1(x))))
        return self.drop(self.norm2(self.fc2(x)))


class MetaBlock2d(nn.Module):
    """MetaBlock4D: pooling mixer + conv MLP, each a LayerScaled residual branch on (B, C, H, W)."""

    def __init__(self, dim: int, mlp_ratio: float = 4.0, drop: float = 0.0, drop_path: float = 0.0,
                 layer_scale_init_value: float = 1e-5):
        super().__init__()
        self.token_mixer = Pooling(3)
        self.ls1 = LayerScale2d(dim, layer_scale_init_value)
        self.drop_path1 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.mlp = ConvMlpWithNorm(dim, int(dim * mlp_ratio), drop=drop)
        self.ls2 = LayerScale2d(dim, layer_scale_init_value)
        self.drop_path2 = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path1(self.ls1(self.token_mixer(x)))
        return x + self.drop_path2(self.ls2(self.mlp(x)))


class MetaBlock1d(nn.Module):
    """MetaBlock3D: pre-LN attention + pre-LN MLP, each a LayerScaled residual branch on (B, N, C)."""

    def __init__(self, dim: int, resolution: tuple[int, int], mlp_ratio: float = 4.0, drop: float = 0.0,
                 drop_path: float = 0.0, layer_scale_init_value: float = 1e-5):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)  # eps 1e-5, as the official code (torch's default)
        self.token_mixer = EfficientFormerAttention(dim, resolution=resolution)
        self.ls1 = LayerScale(dim, layer_scale_init_value)
        self.drop_path1 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer="gelu", drop=drop)
        self.ls2 = LayerScale(dim, layer_scale_init_value)
        self.drop_path2 = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path1(self.ls1(self.token_mixer(self.norm1(x))))
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))


class EfficientFormerStage(nn.Module):
    """[downsample] then ``depth`` blocks, of which the last ``num_vit`` are 3-D (attention) blocks; the ``Flat``
    entry sits in ``blocks`` just before them (timm's layout, which fixes the indices of the keys)."""

    def __init__(self, dim: int, dim_out: int, depth: int, downsample: bool, num_vit: int,
                 resolution: tuple[int, int], mlp_ratio: float, drop: float, drop_path: list[float],
                 layer_scale_init_value: float):
        super().__init__()
        self.grad_checkpointing = False
        if downsample:
            self.downsample = Downsample(dim, dim_out)
            resolution = tuple(downsample_size(r) for r in resolution)
        else:
            if dim != dim_out:
                raise ValueError(f"a stage without downsampling keeps its width: {dim} != {dim_out}")
            self.downsample = nn.Identity()
        self.resolution = resolution
        self.num_vit = min(num_vit, depth)
        blocks: list[nn.Module] = []
        for i in range(depth):
            if i == depth - self.num_vit:
                blocks.append(Flat())
            if i >= depth - self.num_vit:
                blocks.append(MetaBlock1d(dim_out, resolution, mlp_ratio, drop, drop_path[i], layer_scale_init_value))
            else:
                blocks.append(MetaBlock2d(dim_out, mlp_ratio, drop, drop_path[i], layer_scale_init_value))
        self.blocks = nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint_seq(self.blocks, self.downsample(x), enabled=self.grad_checkpointing)


class EfficientFormer(TimmApiMixin, nn.Module):
    """EfficientFormer (V1) with the class and distillation heads."""

    pool_types = ("avg", "")

    def __init__(
        self,
        depths: tuple[int, ...] = (3, 2, 6, 4),
        embed_dims: tuple[int, ...] = (48, 96, 224, 448),
        img_size: int | tuple[int, int] = 224,
        in_chans: int = 3,
        num_classes: int = 1000,
        global_pool: str = "avg",
        num_vit: int = 1,
        mlp_ratio: float = 4.0,
        layer_scale_init_value: float = 1e-5,
        drop_rate: float = 0.0,
        proj_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
    ):
        super().__init__()
        if len(depths) != len(embed_dims):
            raise ValueError(f"{len(depths)} depths for {len(embed_dims)} stage widths")
        check_pool(global_pool, self.pool_types, "EfficientFormer")
        self.img_size = to_2tuple(img_size)
        self.in_chans = in_chans
        self.num_classes = num_classes
        self.global_pool = global_pool
        self.num_features = self.head_hidden_size = embed_dims[-1]
        self.distilled_training = True  # in train mode return (cls_logits, dist_logits), as vitlab's DeiT
        self.grad_checkpointing = False
        self.fused = False

        self.stem = Stem4(in_chans, embed_dims[0])
        resolution = tuple(downsample_size(downsample_size(r)) for r in self.img_size)
        dpr = drop_path_schedule(drop_path_rate, sum(depths))  # linear over all blocks, as the official code
        stages, self.feature_info = [], []
        start, prev = 0, embed_dims[0]
        for i, (depth, dim) in enumerate(zip(depths, embed_dims, strict=True)):
            stage = EfficientFormerStage(
                prev, dim, depth, downsample=i > 0, num_vit=num_vit if i == len(depths) - 1 else 0,
                resolution=resolution, mlp_ratio=mlp_ratio, drop=proj_drop_rate, drop_path=dpr[start:start + depth],
                layer_scale_init_value=layer_scale_init_value)
            resolution = stage.resolution
            stages.append(stage)
            self.feature_info.append(dict(num_chs=dim, reduction=2 ** (i + 2), module=f"stages.{i}"))
            start, prev = start + depth, dim
        self.stages = nn.Sequential(*stages)
        self.grid_size = resolution  # of the last stage
        self.norm = nn.LayerNorm(self.num_features)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = self._make_head(num_classes)
        self.head_dist = self._make_head(num_classes)
        init_linears_trunc_normal_(self)

    # ---- timm-style API -------------------------------------------------------------------------------
    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        return {k for k, _ in self.named_parameters() if "attention_biases" in k}

    @torch.jit.ignore
    def set_distilled_training(self, enable: bool = True) -> None:
        self.distilled_training = enable

    def shard_units(self) -> list[nn.Module]:
        """The meta blocks (4-D and 3-D) of every stage, in forward order; downsampling convs stay with the root."""
        return [b for s in self.stages for b in s.blocks if isinstance(b, (MetaBlock2d, MetaBlock1d))]

    @staticmethod
    def checkpoint_filter_fn(state_dict: dict, model: EfficientFormer) -> dict:
        """timm / vitlab state dict -> ``model``: drop timm's (persistent, derived) ``attention_bias_idxs``."""
        return {k: v for k, v in state_dict.items() if "attention_bias_idxs" not in k}

    # ---- forward ---------------------------------------------------------------------------------------
    def _check_input(self, x: torch.Tensor) -> None:
        check_image(x, self.in_chans)
        if tuple(x.shape[-2:]) != self.img_size:
            raise ValueError(
                f"EfficientFormer's attention biases are tied to the last stage's grid: this model was built for "
                f"{self.img_size[0]}x{self.img_size[1]} inputs ({self.grid_size[0]}x{self.grid_size[1]} tokens), "
                f"got {x.shape[-2]}x{x.shape[-1]}; build it with img_size={tuple(x.shape[-2:])}")

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, in_chans, H, W) -> (B, N, C) normalised tokens of the last stage."""
        self._check_input(x)
        return self.norm(self.stages(self.stem(x)))

    def fuse(self) -> EfficientFormer:
        """For inference: gather each attention's offset bias once (the BatchNorms after convolutions are left to
        Inductor's freezing). Returns ``self`` in eval mode."""
        self.eval()
        fold_offset_biases(self)
        self.fused = True
        return self

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False):
        if self.global_pool == "avg":
            x = x.mean(dim=1)  # (B, N, C) -> (B, C)
        x = self.head_drop(x)
        if pre_logits:
            return x
        x, x_dist = self.head(x), self.head_dist(x)
        if self.distilled_training and self.training:
            return x, x_dist
        return (x + x_dist) / 2

    def forward_intermediates(self, x: torch.Tensor, indices: int | list[int] | None = None, norm: bool = False,
                              output_fmt: str = "NCHW", intermediates_only: bool = False,
                              stop_early: bool = False):
        """The feature pyramid at strides 4, 8, 16, 32 (an int n = the last n stages; None = all), (B, C, H, W)
        (or 'NLC': (B, H*W, C)). ``norm`` applies the final LayerNorm to the last stage's features. Returns
        ``(final_features, intermediates)`` unless ``intermediates_only``; ``final_features`` equals
        :meth:`forward_features`."""
        take, stop = intermediates_plan(len(self.stages), indices, output_fmt, stop_early, intermediates_only)
        self._check_input(x)
        x = self.stem(x)
        last = len(self.stages) - 1
        stages = self.stages[: stop + 1]
        feats = []
        for i, stage in enumerate(stages):
            x = stage(x)
            if i not in take:
                continue
            y = self.norm(x) if (norm and i == last) else x
            if y.ndim == 3 and output_fmt == "NCHW":  # (B, N, C) tokens of the attention blocks
                y = y.transpose(1, 2).reshape(y.shape[0], -1, *stage.resolution)
            elif y.ndim == 4 and output_fmt == "NLC":
                y = y.flatten(2).transpose(1, 2)
            feats.append(y)
        if intermediates_only:
            return feats
        return self.norm(x), feats


# ---- registered configs -----------------------------------------------------------------------------------------
_PAPER = "Li et al., EfficientFormer: Vision Transformers at MobileNet Speed, NeurIPS 2022"

_CFGS = {
    "efficientformer_l1": dict(depths=(3, 2, 6, 4), embed_dims=(48, 96, 224, 448), num_vit=1),
    "efficientformer_l3": dict(depths=(4, 4, 12, 6), embed_dims=(64, 128, 320, 512), num_vit=4),
    "efficientformer_l7": dict(depths=(6, 6, 18, 8), embed_dims=(96, 192, 384, 768), num_vit=8),
}


def _cfg(name: str, params: float, gmacs: float, top1: float, smoke: dict) -> ModelConfig:
    return ModelConfig(family="efficientformer", paper=_PAPER, crop_pct=0.95, published_params_m=params,
                       published_gmacs=gmacs, published_top1=top1, hf_hub_id=f"timm/{name}.snap_dist_in1k",
                       smoke_kwargs=smoke, extra=dict(fixed_input_size=True))


# small instances: 64x64 images (2x2 tokens in stage 4), one block a stage, the last stage keeping both block
# kinds (L1, L3) or only attention blocks (L7, where every stage-4 block is a 3-D block)
_SMOKE_MIXED = {"img_size": 64, "depths": (1, 1, 1, 2), "num_vit": 1}
_SMOKE_ALL_VIT = {"img_size": 64, "depths": (1, 1, 1, 1), "num_vit": 1}


@register_model(config=_cfg("efficientformer_l1", 12.29, 1.30, 79.2, _SMOKE_MIXED))
def efficientformer_l1(**kwargs) -> EfficientFormer:
    """EfficientFormer-L1: widths 48/96/224/448, depths 3/2/6/4, one attention block."""
    return EfficientFormer(**{**_CFGS["efficientformer_l1"], **kwargs})


@register_model(config=_cfg("efficientformer_l3", 31.41, 3.93, 82.4, _SMOKE_MIXED))
def efficientformer_l3(**kwargs) -> EfficientFormer:
    """EfficientFormer-L3: widths 64/128/320/512, depths 4/4/12/6, four attention blocks."""
    return EfficientFormer(**{**_CFGS["efficientformer_l3"], **kwargs})


@register_model(config=_cfg("efficientformer_l7", 82.23, 10.17, 83.3, _SMOKE_ALL_VIT))
def efficientformer_l7(**kwargs) -> EfficientFormer:
    """EfficientFormer-L7: widths 96/192/384/768, depths 6/6/18/8, eight attention blocks (all of stage 4)."""
    return EfficientFormer(**{**_CFGS["efficientformer_l7"], **kwargs})
