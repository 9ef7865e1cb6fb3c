"""Pyramid Vision Transformer v1 (Wang et al., 2021, "Pyramid Vision Transformer: A Versatile Backbone for
Dense Prediction without Convolutions", ICCV 2021).

A transformer with a CNN-like feature pyramid: four stages at strides 4, 8, 16, 32. Each stage

1. embeds patches of its input map: a P x P stride-P conv (P = 4 for the image, then 2) and LayerNorm, giving
   (B, H_i*W_i, C_i) tokens;
2. adds its own learned absolute position embedding (resampled bilinearly when the input size differs, as
   the paper's code does; the last stage also prepends a class token, which has its own embedding entry);
3. runs pre-norm transformer blocks whose attention is *spatial-reduction attention* (SRA): queries keep
   the full grid, while keys and values come from the grid reduced by a R_i x R_i stride-R_i conv and a
   LayerNorm, so attention costs (H_i W_i)^2 / R_i^2 instead of (H_i W_i)^2. R = 8, 4, 2, 1. This is the
   zoo's ``sra`` mechanism (:class:`vitlab.attention.SpatialReductionAttention`, PVT's parameter names); the
   class token of the last stage (R = 1) is an ordinary query / key there.

Configs (paper Table 1): widths 64/128/320/512, heads 1/2/5/8, MLP ratios 8/8/4/4; depths 2-2-2-2 (Tiny),
3-4-6-3 (Small), 3-4-18-3 (Medium), 3-8-27-3 (Large). Classification uses the class token after a final
LayerNorm. timm has no PVT v1; the module layout is ours (``stages.i.{patch_embed, pos_embed, blocks}``) and
:meth:`PyramidVisionTransformer.checkpoint_filter_fn` maps the reference code's flat names (``patch_embed1``,
``pos_embed1``, ``block1``, ...) onto it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import partial

import torch
import torch.nn as nn

from vitlab.attention import Block, SpatialReductionAttention
from vitlab.layers import (
    PatchEmbed,
    check_heads,
    check_image,
    check_pool_type,
    checkpoint_seq,
    drop_path_schedule,
    get_norm_layer,
    init_linears_trunc_normal_,
    intermediates_plan,
    pool_tokens,
    resample_abs_pos_embed,
    same_size,
    to_2tuple,
)
from vitlab.models._base import TimmApiMixin
from vitlab.registry import ModelConfig, register_model

_PAPER = ("Wang et al., Pyramid Vision Transformer: A Versatile Backbone for Dense Prediction without "
          "Convolutions, ICCV 2021")


class PVTStage(nn.Module):
    """Patch embedding (conv + LayerNorm) -> (+ class token) + position embedding -> SRA blocks."""

    def __init__(self, img_size, patch_size: int, in_chans: int, dim: int, depth: int, num_heads: int,
                 mlp_ratio: float, sr_ratio: int, qkv_bias: bool = True, class_token: bool = False,
                 pos_drop_rate: float = 0.0, proj_drop_rate: float = 0.0, attn_drop_rate: float = 0.0,
                 drop_path: list[float] | None = None, norm_layer: str | Callable = "layernorm",
                 act_layer: str | Callable = "gelu"):
        super().__init__()
        # the reference PatchEmbed uses nn.LayerNorm's default eps (1e-5); the blocks use 1e-6
        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, dim, norm_layer=nn.LayerNorm,
                                      strict_img_size=False)
        self.num_prefix_tokens = int(class_token)
        embed_len = self.num_prefix_tokens + self.patch_embed.num_patches
        self.pos_embed = nn.Parameter(torch.zeros(1, embed_len, dim))  # (1, prefix + h*w, C)
        self.pos_drop = nn.Dropout(pos_drop_rate)
        self.blocks = nn.ModuleList([
            Block(dim, num_heads, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias, proj_drop=proj_drop_rate,
                  attn_drop=attn_drop_rate, drop_path=p, act_layer=act_layer, norm_layer=norm_layer,
                  attn_layer="sra", attn_kwargs={"sr_ratio": sr_ratio})
            for p in (drop_path or [0.0] * depth)])
        self.grad_checkpointing = False

    def embed(self, x: torch.Tensor, cls_token: torch.Tensor | None = None):
        """(B, C_in, H, W) -> ((B, prefix + h*w, C) tokens with position embeddings, (h, w))."""
        hw = self.patch_embed.dynamic_feat_size(x.shape[-2:])
        x = self.patch_embed(x)  # (B, h*w, C)
        pos = self.pos_embed
        if not same_size(hw, self.patch_embed.grid_size):  # the reference code: bilinear, no antialias
            pos = resample_abs_pos_embed(pos, hw, self.patch_embed.grid_size, self.num_prefix_tokens,
                                         interpolation="bilinear", antialias=False)
        if cls_token is not None:
            x = torch.cat([cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        return self.pos_drop(x + pos), hw

    def forward(self, x: torch.Tensor, cls_token: torch.Tensor | None = None):
        x, hw = self.embed(x, cls_token)
        return checkpoint_seq(self.blocks, x, hw, enabled=self.grad_checkpointing), hw  # (B, prefix + h*w, C)


class PyramidVisionTransformer(TimmApiMixin, nn.Module):
    pool_types = ("token", "avg")  # reset_classifier's choice

    def __init__(
        self,
        img_size=224,
        patch_size: int = 4,
        in_chans: int = 3,
        num_classes: int = 1000,
        global_pool: str = "token",
        embed_dims: tuple[int, ...] = (64, 128, 320, 512),
        num_heads: tuple[int, ...] = (1, 2, 5, 8),
        mlp_ratios: tuple[float, ...] = (8.0, 8.0, 4.0, 4.0),
        depths: tuple[int, ...] = (2, 2, 2, 2),
        sr_ratios: tuple[int, ...] = (8, 4, 2, 1),
        qkv_bias: bool = True,
        drop_rate: float = 0.0,
        pos_drop_rate: float = 0.0,
        proj_drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        norm_layer: str | Callable = "layernorm",
        act_layer: str | Callable = "gelu",
        dynamic_img_size: bool = True,  # always on: position embeddings are resampled to the input's grid
    ):
        super().__init__()
        n = len(embed_dims)
        if not (len(num_heads) == len(mlp_ratios) == len(depths) == len(sr_ratios) == n):
            raise ValueError("embed_dims, num_heads, mlp_ratios, depths and sr_ratios need one entry a stage")
        for d, h in zip(embed_dims, num_heads, strict=True):
            check_heads(d, h)
        self.global_pool = check_pool_type(global_pool, True)
        self.num_classes = num_classes
        self.num_features = self.embed_dim = embed_dims[-1]
        self.num_prefix_tokens = 1
        self.in_chans = in_chans
        self.img_size = to_2tuple(img_size)
        # patch 4 then three 2x2 merges: every stage's map (and its R x R reduction) divides evenly
        self.size_divisor = patch_size * 2 ** (n - 1)
        if self.img_size[0] % self.size_divisor or self.img_size[1] % self.size_divisor:
            raise ValueError(f"PVT needs H and W divisible by {self.size_divisor} (a {patch_size}x"
                             f"{patch_size} patch embedding, then 2x2 patch merges), got img_size={img_size}")
        self.grad_checkpointing = False

        dpr = drop_path_schedule(drop_path_rate, sum(depths))
        grid = self.img_size
        stages, prev = [], in_chans
        for i in range(n):
            p = patch_size if i == 0 else 2
            stages.append(PVTStage(
                grid, p, prev, embed_dims[i], depths[i], num_heads[i], mlp_ratios[i], sr_ratios[i], qkv_bias,
                class_token=i == n - 1, pos_drop_rate=pos_drop_rate, proj_drop_rate=proj_drop_rate,
                attn_drop_rate=attn_drop_rate, drop_path=dpr[sum(depths[:i]): sum(depths[: i + 1])],
                norm_layer=norm_layer, act_layer=act_layer))
            grid, prev = stages[-1].patch_embed.grid_size, embed_dims[i]
        self.stages = nn.ModuleList(stages)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dims[-1]))
        self.norm = get_norm_layer(norm_layer)(embed_dims[-1])
        self.head_drop = nn.Dropout(drop_rate)
        self.head = self._make_head(num_classes)
        self.feature_info = [dict(num_chs=d, reduction=patch_size * 2**i, module=f"stages.{i}")
                             for i, d in enumerate(embed_dims)]
        self._init_weights()

    def _init_weights(self) -> None:
        """The reference init: truncated normal (std 0.02) for linears, position embeddings and the class
        token; zero biases; LayerNorm (1, 0); convolutions keep PyTorch's default."""
        for stage in self.stages:
            nn.init.trunc_normal_(stage.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=0.02)
        init_linears_trunc_normal_(self)

    # ---- timm-style API -------------------------------------------------------------------------------
    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        return {"cls_token"} | {f"stages.{i}.pos_embed" for i in range(len(self.stages))}

    def shard_units(self) -> list[nn.Module]:
        """The blocks of every stage, in forward order; patch embeddings and position embeddings stay with
        the root."""
        return [b for stage in self.stages for b in stage.blocks]

    # ---- forward ---------------------------------------------------------------------------------------
    def _check_input(self, x: torch.Tensor) -> None:
        h, w = check_image(x, self.in_chans)
        d = self.size_divisor
        if h % d or w % d:
            p = self.stages[0].patch_embed.patch_size[0]
            raise ValueError(f"PVT needs H and W divisible by {d} (a {p}x{p} patch embedding, then 2x2 patch "
                             f"merges to stride {d}), got {h}x{w}")

    def _stages(self, x: torch.Tensor, last: int | None = None):
        """Yield each stage's (tokens, hw); between stages the patch tokens go back to (B, C, h, w)."""
        B = x.shape[0]
        for i, stage in enumerate(self.stages):
            if last is not None and i > last:
                return
            tokens, hw = stage(x, self.cls_token if stage.num_prefix_tokens else None)
            yield tokens, hw
            x = tokens[:, stage.num_prefix_tokens :].reshape(B, hw[0], hw[1], -1).permute(0, 3, 1, 2)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        for tokens, _ in self._stages(x):
            x = tokens
        return self.norm(x)  # (B, 1 + H/32 * W/32, C_4): class token first

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = self.head_drop(pool_tokens(x, self.global_pool, self.num_prefix_tokens))
        return x if pre_logits else self.head(x)

    def forward_intermediates(self, x: torch.Tensor, indices: int | list[int] | None = None,
                              norm: bool = False, output_fmt: str = "NCHW", intermediates_only: bool = False,
                              stop_early: bool = False):
        """The feature pyramid: each stage's output (strides 4, 8, 16, 32), class token removed, as
        (B, C_i, H_i, W_i) or (B, H_i*W_i, C_i). ``norm`` applies the final LayerNorm to the last stage (the
        only one that has a norm). Returns ``(forward_features(x), [features])`` unless
        ``intermediates_only``."""
        n = len(self.stages)
        take, last = intermediates_plan(n, indices, output_fmt, stop_early, intermediates_only)
        self._check_input(x)
        B, feats = x.shape[0], []
        for i, (tokens, hw) in enumerate(self._stages(x, last)):
            x = tokens
            if i in take:
                y = self.norm(tokens) if (norm and i == n - 1) else tokens
                y = y[:, self.stages[i].num_prefix_tokens :]  # (B, h*w, C)
                if output_fmt == "NCHW":
                    y = y.reshape(B, hw[0], hw[1], -1).permute(0, 3, 1, 2).contiguous()
                feats.append(y)
        if intermediates_only:
            return feats
        return (self.norm(x) if last == n - 1 else x), feats

    @staticmethod
    def checkpoint_filter_fn(state_dict: dict, model: PyramidVisionTransformer) -> dict:
        """Map the reference code's names (``patch_embed{i}``, ``pos_embed{i}``, ``block{i}``) to ``stages``
        and resample position embeddings trained at another size to the model's grids."""
        out = {}
        for k, v in state_dict.items():
            k = re.sub(r"^patch_embed(\d)\.", lambda m: f"stages.{int(m.group(1)) - 1}.patch_embed.", k)
            k = re.sub(r"^pos_embed(\d)$", lambda m: f"stages.{int(m.group(1)) - 1}.pos_embed", k)
            k = re.sub(r"^block(\d)\.", lambda m: f"stages.{int(m.group(1)) - 1}.blocks.", k)
            k = k.replace(".drop_path.", ".drop_path1.")
            m = re.match(r"^stages\.(\d)\.pos_embed$", k)
            if m:
                stage = model.stages[int(m.group(1))]
                if v.shape != stage.pos_embed.shape:
                    prefix = stage.num_prefix_tokens
                    v = resample_abs_pos_embed(v, stage.patch_embed.grid_size, num_prefix_tokens=prefix,
                                               interpolation="bilinear", antialias=False)
            out[k] = v
        return out


def _cfg(params: float, gmacs: float, top1: float) -> ModelConfig:
    return ModelConfig(family="pvt", paper=_PAPER, input_size=(3, 224, 224), crop_pct=0.9,
                       published_params_m=params, published_gmacs=gmacs, published_top1=top1,
                       # 64x64 still reduces in every stage (16x16 / 8 ... 2x2 / 1), one block a stage
                       smoke_kwargs={"img_size": 64, "depths": (1, 1, 1, 1)})


_build = partial(PyramidVisionTransformer, embed_dims=(64, 128, 320, 512), num_heads=(1, 2, 5, 8),
                 mlp_ratios=(8.0, 8.0, 4.0, 4.0), sr_ratios=(8, 4, 2, 1))


# Paper Table 2 (ImageNet-1k, 224x224): params (M), GFLOPs (which are multiply-adds), top-1
@register_model(config=_cfg(13.2, 1.9, 75.1))
def pvt_tiny(**kwargs) -> PyramidVisionTransformer:
    """PVT-Tiny: depths 2-2-2-2."""
    return _build(**{"depths": (2, 2, 2, 2), **kwargs})


@register_model(config=_cfg(24.5, 3.8, 79.8))
def pvt_small(**kwargs) -> PyramidVisionTransformer:
    """PVT-Small: depths 3-4-6-3."""
    return _build(**{"depths": (3, 4, 6, 3), **kwargs})


@register_model(config=_cfg(44.2, 6.7, 81.2))
def pvt_medium(**kwargs) -> PyramidVisionTransformer:
    """PVT-Medium: depths 3-4-18-3."""
    return _build(**{"depths": (3, 4, 18, 3), **kwargs})


@register_model(config=_cfg(61.4, 9.8, 81.7))
def pvt_large(**kwargs) -> PyramidVisionTransformer:
    """PVT-Large: depths 3-8-27-3."""
    return _build(**{"depths": (3, 8, 27, 3), **kwargs})


__all__ = ["PyramidVisionTransformer", "SpatialReductionAttention", "PVTStage"]
