"""LITv2 (Pan, Cai, Zhuang, "Fast Vision Transformers with HiLo Attention", NeurIPS 2022; the
supplementary's Table I gives the stage specifications, Figure I the framework).

A four-stage pyramid (strides 4, 8, 16, 32; widths C, 2C, 4C, 8C) without position embeddings:

1. a 4x4 stride-4 patch embedding (conv + LayerNorm) gives (B, H/4 * W/4, C) tokens;
2. stages 1-2 are *ConvFFN blocks only*, no attention (LITv1 found the early attention heads attend locally,
   so a token mixer there buys little): ``x + DropPath(ConvFFN(LN(x)))`` with ConvFFN = fc1 (C -> 4C) -> 3x3
   depthwise conv on the (H, W) map -> GELU -> fc2 (4C -> C). The depthwise conv also supplies the positional
   information that LITv1's relative position bias gave;
3. stages 3-4 are pre-norm transformer blocks with **HiLo** attention (``vitlab.attention`` 'hilo') and the
   same ConvFFN: alpha = 0.9 of the heads are Lo-Fi (global attention to the s x s average-pooled map), the
   rest Hi-Fi (attention inside s x s windows). s = 2 in stage 3; s = 1 in stage 4 makes every head Lo-Fi
   with unpooled keys, i.e. standard MSA (Table I: alpha_4 = 1, s_4 = 1);
4. between stages, *deformable token merging* (DTM, from LITv1): a 2x2 stride-2 deformable convolution
   (``torchvision.ops.deform_conv2d``) whose sampling offsets come from a plain 2x2 stride-2 conv initialised
   to zero (so training starts from an ordinary strided patch merge), then BatchNorm and GELU. The first
   patch embedding is a plain conv, not deformable (Table I: "Patch Embedding" in stage 1, "DTM" after);
5. final LayerNorm, average pooling of the tokens, linear head.

Configs (Table I): S C=96 depths 2-2-6-2 heads 3-6-12-24; M C=96 2-2-18-2 3-6-12-24; B C=128 2-2-18-2
heads 4-8-16-32; MLP ratio 4 everywhere. The layout follows the official code (ziplab/LITv2, itself Swin's
layout): ``patch_embed``, ``layers.i.blocks.j.{norm1, attn, norm2, mlp}``, ``norm``, ``head``; HiLo's
``h_qkv / h_proj / l_q / l_kv / l_proj`` are the official names. Two differences, mapped by
:meth:`LITv2.checkpoint_filter_fn`: the merge opens stage i + 1 here (timm's Swin layout, so ``layers.i`` is
exactly pyramid level i) where the official code closes stage i with it, and two wrapper modules are flattened
(``mlp.dwconv.dwconv`` -> ``mlp.dwconv``, ``downsample.norm_layer`` -> ``downsample.norm``).

Sizes: no position embedding and no precomputed mask, so any input whose sides are multiples of 32 runs
(non-square included); other sizes raise a ValueError (a 4x4 patch embedding, then three 2x2 stride-2 merges
of even grids). HiLo itself pads its windows, so it imposes nothing more.

Cost: ``vitlab.profile_model`` counts the deformable convolution (``torchvision::deform_conv2d``) as the paper
(and the official ``flops()``) does, k*k*C_in*C_out MACs per output position, the bilinear sampling left out.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import torch
import torch.nn as nn

from vitlab.attention import create as create_attention
from vitlab.layers import (
    DropPath,
    PatchEmbed,
    check_heads,
    check_pool,
    checkpoint_seq,
    drop_path_schedule,
    get_act_layer,
    get_norm_layer,
    init_linears_trunc_normal_,
    intermediates_plan,
    to_2tuple,
)
from vitlab.models._base import TimmApiMixin
from vitlab.registry import ModelConfig, register_model

_PAPER = "Pan, Cai, Zhuang, Fast Vision Transformers with HiLo Attention, NeurIPS 2022"
_POOL_TYPES = ("avg", "max", "")


def _to_map(x: torch.Tensor, hw: tuple[int, int]) -> torch.Tensor:
    """(B, H*W, C) tokens -> (B, C, H, W) map."""
    B, _, C = x.shape
    return x.transpose(1, 2).reshape(B, C, hw[0], hw[1])


class ConvFFN(nn.Module):
    """fc1 -> 3x3 depthwise conv (on the H x W map) -> act -> drop -> fc2 -> drop (the official ``DWMlp``).

    ``forward(x, hw)``: x (B, H*W, C) -> (B, H*W, out_features)."""

    def __init__(self, in_features: int, hidden_features: int | None = None, out_features: int | None = None,
                 act_layer: str | Callable = "gelu", drop: float = 0.0):
        super().__init__()
        hidden_features = hidden_features or in_features
        out_features = out_features or in_features
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.dwconv = nn.Conv2d(hidden_features, hidden_features, 3, 1, 1, groups=hidden_features)
        self.act = get_act_layer(act_layer)()
        self.drop1 = nn.Dropout(drop)
        self.fc2 = nn.Linear(hidden_features, out_features)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x: torch.Tensor, hw: tuple[int, int]) -> torch.Tensor:
        x = self.fc1(x)  # (B, N, hidden)
        x = self.dwconv(_to_map(x, hw)).flatten(2).transpose(1, 2)  # (B, N, hidden): mixes 3x3 neighbours
        x = self.drop1(self.act(x))
        return self.drop2(self.fc2(x))


class ConvFFNBlock(nn.Module):
    """Stages 1-2: ``x + DropPath(ConvFFN(LN(x)))``, no attention. (Named ``norm2`` as the official code.)"""

    def __init__(self, dim: int, mlp_ratio: float = 4.0, proj_drop: float = 0.0, drop_path: float = 0.0,
                 act_layer: str | Callable = "gelu", norm_layer: str | Callable = "layernorm_eps5"):
        super().__init__()
        self.norm2 = get_norm_layer(norm_layer)(dim)
        self.mlp = ConvFFN(dim, int(dim * mlp_ratio), act_layer=act_layer, drop=proj_drop)
        self.drop_path2 = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: torch.Tensor, hw: tuple[int, int]) -> torch.Tensor:  # (B, N, C) -> (B, N, C)
        return x + self.drop_path2(self.mlp(self.norm2(x), hw))


class HiLoBlock(nn.Module):
    """Stages 3-4: ``x + DropPath(HiLo(LN(x)))`` then ``x + DropPath(ConvFFN(LN(x)))``."""

    def __init__(self, dim: int, num_heads: int, window_size: int = 2, alpha: float = 0.9,
                 mlp_ratio: float = 4.0, qkv_bias: bool = True, proj_drop: float = 0.0, attn_drop: float = 0.0,
                 drop_path: float = 0.0, act_layer: str | Callable = "gelu",
                 norm_layer: str | Callable = "layernorm_eps5", pooled_queries: bool = False):
        super().__init__()
        norm = get_norm_layer(norm_layer)
        self.norm1 = norm(dim)
        self.attn = create_attention("hilo", dim, num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop,
                                     proj_drop=proj_drop, window_size=window_size, alpha=alpha,
                                     pooled_queries=pooled_queries)
        self.drop_path1 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = norm(dim)
        self.mlp = ConvFFN(dim, int(dim * mlp_ratio), act_layer=act_layer, drop=proj_drop)
        self.drop_path2 = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: torch.Tensor, hw: tuple[int, int]) -> torch.Tensor:  # (B, N, C) -> (B, N, C)
        x = x + self.drop_path1(self.attn(self.norm1(x), hw))
        return x + self.drop_path2(self.mlp(self.norm2(x), hw))


class DeformConv2d(nn.Module):
    """k x k deformable convolution whose offsets are predicted from the input by ``conv_offset`` (a plain
    conv of the same kernel / stride / padding, 2*k*k output channels: one (dy, dx) per kernel tap), zero-
    initialised so that it starts as the ordinary strided conv (mmcv's ``DeformConv2dPack``, as LITv1/v2).

    ``forward(x)``: (B, C_in, H, W) -> (B, C_out, H', W'); ``return_offset=True`` also returns the offsets."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int = 2, stride: int = 2,
                 padding: int = 0):
        super().__init__()
        self.kernel_size = to_2tuple(kernel_size)
        self.stride = to_2tuple(stride)
        self.padding = to_2tuple(padding)
        kh, kw = self.kernel_size
        self.weight = nn.Parameter(torch.empty(out_channels, in_channels, kh, kw))
        self.bias = nn.Parameter(torch.empty(out_channels))
        self.conv_offset = nn.Conv2d(in_channels, 2 * kh * kw, self.kernel_size, self.stride, self.padding)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Weight and bias as nn.Conv2d's default (the official init); offsets start at exactly zero."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        bound = 1 / math.sqrt(self.weight[0].numel())
        nn.init.uniform_(self.bias, -bound, bound)
        nn.init.zeros_(self.conv_offset.weight)
        nn.init.zeros_(self.conv_offset.bias)

    def forward(self, x: torch.Tensor, return_offset: bool = False):
        # imported here: torchvision.ops takes seconds to import (it loads the compiler stack)
        from torchvision.ops import deform_conv2d

        offset = self.conv_offset(x)  # (B, 2*kh*kw, H', W'), (dy, dx) pairs per tap
        out = deform_conv2d(x, offset.to(x.dtype), self.weight, self.bias, stride=self.stride, padding=self.padding)
        return (out, offset) if return_offset else out


class DeformableTokenMerging(nn.Module):
    """DTM (LITv1): (B, C, H, W) -> 2x2 stride-2 deformable conv -> BatchNorm -> GELU -> (B, C', H/2, W/2)."""

    def __init__(self, dim: int, out_dim: int | None = None, act_layer: str | Callable = "gelu"):
        super().__init__()
        self.dim = dim
        self.out_dim = out_dim or 2 * dim
        self.dconv = DeformConv2d(dim, self.out_dim, kernel_size=2, stride=2, padding=0)
        self.norm = nn.BatchNorm2d(self.out_dim)
        self.act = get_act_layer(act_layer)()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.norm(self.dconv(x)))


class LITv2Stage(nn.Module):
    """Optional DTM (every stage but the first), then ``depth`` ConvFFN blocks (``window_size == 0``: no
    attention) or HiLo blocks. ``forward(x, hw)``: tokens (B, H*W, C_in) -> ((B, H'*W', C), (H', W'))."""

    def __init__(self, dim: int, out_dim: int, depth: int, num_heads: int, downsample: bool,
                 window_size: int = 0, alpha: float = 0.9, mlp_ratio: float = 4.0, qkv_bias: bool = True,
                 proj_drop: float = 0.0, attn_drop: float = 0.0, drop_path: list[float] | None = None,
                 act_layer: str | Callable = "gelu", norm_layer: str | Callable = "layernorm_eps5",
                 pooled_queries: bool = False):
        super().__init__()
        if not downsample and dim != out_dim:
            raise ValueError(f"a stage without token merging keeps its width ({dim} != {out_dim})")
        self.downsample = DeformableTokenMerging(dim, out_dim, act_layer=act_layer) if downsample else None
        drop_path = drop_path or [0.0] * depth
        if window_size > 0:
            check_heads(out_dim, num_heads)
            blocks = [HiLoBlock(out_dim, num_heads, window_size=window_size, alpha=alpha, mlp_ratio=mlp_ratio,
                                qkv_bias=qkv_bias, proj_drop=proj_drop, attn_drop=attn_drop, drop_path=p,
                                act_layer=act_layer, norm_layer=norm_layer, pooled_queries=pooled_queries)
                      for p in drop_path]
        else:
            blocks = [ConvFFNBlock(out_dim, mlp_ratio=mlp_ratio, proj_drop=proj_drop, drop_path=p,
                                   act_layer=act_layer, norm_layer=norm_layer) for p in drop_path]
        self.blocks = nn.ModuleList(blocks)
        self.grad_checkpointing = False

    def forward(self, x: torch.Tensor, hw: tuple[int, int]):
        if self.downsample is not None:
            x = self.downsample(_to_map(x, hw))  # (B, C', H/2, W/2)
            hw = (x.shape[2], x.shape[3])
            x = x.flatten(2).transpose(1, 2)  # (B, H/2 * W/2, C')
        return checkpoint_seq(self.blocks, x, hw, enabled=self.grad_checkpointing), hw


class LITv2(TimmApiMixin, nn.Module):
    """LITv2. ``forward_features`` returns the normed last-stage tokens (B, H/32 * W/32, 8C)."""

    pool_types = _POOL_TYPES

    def __init__(
        self,
        img_size=224,
        patch_size: int = 4,
        in_chans: int = 3,
        num_classes: int = 1000,
        global_pool: str = "avg",
        embed_dim: int = 96,
        depths: tuple[int, ...] = (2, 2, 6, 2),
        num_heads: tuple[int, ...] = (3, 6, 12, 24),
        local_ws: tuple[int, ...] = (0, 0, 2, 1),  # HiLo window s per stage; 0 = ConvFFN blocks, no attention
        alpha: float = 0.9,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        drop_rate: float = 0.0,
        proj_drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        norm_layer: str | Callable = "layernorm_eps5",
        act_layer: str | Callable = "gelu",
        dynamic_img_size: bool = True,  # always on: nothing in the model depends on the input size
        pooled_queries: bool = False,  # supplementary Table III: Lo-Fi queries from the pooled map (HiLo's option)
    ):
        super().__init__()
        check_pool(global_pool, _POOL_TYPES)
        n = len(depths)
        if not (len(num_heads) == len(local_ws) == n):
            raise ValueError(f"depths {tuple(depths)}, num_heads {tuple(num_heads)} and local_ws "
                             f"{tuple(local_ws)} need one entry a stage")
        self.num_classes = num_classes
        self.global_pool = global_pool
        self.num_layers = n
        self.embed_dim = embed_dim
        self.in_chans = in_chans
        dims = [embed_dim * 2**i for i in range(n)]
        self.num_features = dims[-1]
        self.img_size = to_2tuple(img_size)
        self.size_divisor = patch_size * 2 ** (n - 1)
        self._check_size(*self.img_size, what="img_size")
        norm = get_norm_layer(norm_layer)

        # a plain conv patch embedding (Table I: only the later merges are deformable); any size at run time
        self.patch_embed = PatchEmbed(img_size=self.img_size, patch_size=patch_size, in_chans=in_chans,
                                      embed_dim=embed_dim, norm_layer=norm, strict_img_size=False)
        dpr = drop_path_schedule(drop_path_rate, sum(depths))  # linear over all blocks of all stages
        self.layers = nn.ModuleList([
            LITv2Stage(dims[max(i - 1, 0)], dims[i], depths[i], num_heads[i], downsample=i > 0,
                       window_size=local_ws[i], alpha=alpha, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias,
                       proj_drop=proj_drop_rate, attn_drop=attn_drop_rate,
                       drop_path=dpr[sum(depths[:i]):sum(depths[: i + 1])], act_layer=act_layer,
                       norm_layer=norm_layer, pooled_queries=pooled_queries)
            for i in range(n)])
        self.feature_info = [dict(num_chs=d, reduction=patch_size * 2**i, module=f"layers.{i}")
                             for i, d in enumerate(dims)]
        self.norm = norm(self.num_features)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = self._make_head(num_classes)
        self._init_weights()

    def _init_weights(self) -> None:
        """The official init: truncated normal (std 0.02) linears with zero biases, LayerNorm (1, 0), the
        ConvFFN depthwise convs N(0, sqrt(2 / fan_out)) with fan_out = 9; the patch embedding and the
        deformable convs keep nn.Conv2d's default, the offset convs zero."""
        init_linears_trunc_normal_(self)
        for m in self.modules():
            if isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, ConvFFN):
                fan_out = m.dwconv.kernel_size[0] * m.dwconv.kernel_size[1] * m.dwconv.out_channels
                nn.init.normal_(m.dwconv.weight, 0.0, math.sqrt(2.0 / (fan_out // m.dwconv.groups)))
                nn.init.zeros_(m.dwconv.bias)

    # ---- timm-style API -------------------------------------------------------------------------------
    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        return set()  # no position embeddings or bias tables (the official set names a non-existent tensor)

    def shard_units(self) -> list[nn.Module]:
        """The blocks of every stage (ConvFFN, then HiLo blocks), in forward order; token merging stays with the
        root."""
        return [b for stage in self.layers for b in stage.blocks]

    # ---- forward ---------------------------------------------------------------------------------------
    def _check_size(self, h: int, w: int, what: str = "input") -> None:
        d = self.size_divisor
        if h % d or w % d:
            raise ValueError(f"LITv2 needs H and W divisible by {d} (a 4x4 patch embedding, then three 2x2 "
                             f"stride-2 deformable token merges of even grids), got {what} {h}x{w}")

    def _check_input(self, x: torch.Tensor) -> None:
        if x.ndim != 4:
            raise ValueError(f"expected images of shape (B, C, H, W), got shape {tuple(x.shape)}")
        _, c, h, w = x.shape
        if c != self.in_chans:
            raise ValueError(f"expected {self.in_chans} input channels, got {c} (input shape {tuple(x.shape)})")
        self._check_size(h, w)

    def _embed(self, x: torch.Tensor):
        self._check_input(x)
        hw = self.patch_embed.dynamic_feat_size(x.shape[-2:])
        return self.patch_embed(x), hw  # (B, H/4 * W/4, C)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x, hw = self._embed(x)
        for stage in self.layers:
            x, hw = stage(x, hw)
        return self.norm(x)  # (B, H/32 * W/32, 8C)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        if self.global_pool == "avg":
            x = x.mean(dim=1)  # (B, C)
        elif self.global_pool == "max":
            x = x.amax(dim=1)
        x = self.head_drop(x)
        return x if pre_logits else self.head(x)

    def forward_intermediates(self, x: torch.Tensor, indices: int | list[int] | None = None,
                              norm: bool = False, output_fmt: str = "NCHW", intermediates_only: bool = False,
                              stop_early: bool = False):
        """The feature pyramid: the output of the chosen stages (an int n = the last n stages; None = all),
        strides 4/8/16/32, as (B, C_i, H_i, W_i) or (B, H_i*W_i, C_i). ``norm`` applies the final norm to the
        last stage (the only one it is sized for). Returns ``(final_features, intermediates)`` unless
        ``intermediates_only``; ``final_features`` equals :meth:`forward_features` (unless stopped early)."""
        take, stop = intermediates_plan(self.num_layers, indices, output_fmt, stop_early, intermediates_only)
        last = self.num_layers - 1
        stages = self.layers[: stop + 1]
        x, hw = self._embed(x)
        feats = []
        for i, stage in enumerate(stages):
            x, hw = stage(x, hw)  # (B, H_i * W_i, C_i)
            if i in take:
                y = self.norm(x) if (norm and i == last) else x
                feats.append(_to_map(y, hw).contiguous() if output_fmt == "NCHW" else y)
        if intermediates_only:
            return feats
        return (self.norm(x) if len(stages) == self.num_layers else x), feats

    @staticmethod
    def checkpoint_filter_fn(state_dict: dict, model: LITv2) -> dict:
        """Official LITv2 state dict -> ours: the merge closing official stage i (``layers.i.downsample``)
        opens our stage i + 1; ``mlp.dwconv.dwconv`` -> ``mlp.dwconv``; ``downsample.norm_layer`` ->
        ``downsample.norm``. A vitlab state dict passes unchanged."""
        if "model" in state_dict and isinstance(state_dict["model"], dict):  # the official training checkpoint
            state_dict = state_dict["model"]
        original = any(re.match(r"^layers\.0\.downsample\.", k) for k in state_dict)
        out = {}
        for k, v in state_dict.items():
            if original:
                k = re.sub(r"^layers\.(\d+)\.downsample\.",
                           lambda m: f"layers.{int(m.group(1)) + 1}.downsample.", k)
            k = k.replace(".mlp.dwconv.dwconv.", ".mlp.dwconv.").replace(".downsample.norm_layer.",
                                                                         ".downsample.norm.")
            out[k] = v
        return out


def _cfg(params: float, gmacs: float, top1: float) -> ModelConfig:
    return ModelConfig(family="litv2", paper=_PAPER, input_size=(3, 224, 224), crop_pct=0.9,
                       published_params_m=params, published_gmacs=gmacs, published_top1=top1,
                       extra={"patch_size": 4, "local_ws": (0, 0, 2, 1), "alpha": 0.9},
                       # 64 px: grids 16, 8, 4, 2; one block a stage keeps ConvFFN blocks, three DTMs, HiLo with
                       # both branches (4x4 grid, s = 2) and HiLo as MSA (s = 1)
                       smoke_kwargs={"img_size": 64, "depths": (1, 1, 1, 1)})


def _create(config: dict, kwargs: dict) -> LITv2:
    """The named ``config``; ``kwargs`` override any of it (the smoke tests shrink depths and the image)."""
    args = dict(patch_size=4, local_ws=(0, 0, 2, 1), alpha=0.9, mlp_ratio=4.0, **config)
    args.update(kwargs)
    return LITv2(**args)


# The paper's ImageNet-1K table (224x224; S also in the supplementary's Table III): params (M), GFLOPs (= MACs), top-1
@register_model(config=_cfg(28.0, 3.7, 82.0))
def litv2_s(**kwargs) -> LITv2:
    """LITv2-S: C = 96, depths (2, 2, 6, 2), heads (3, 6, 12, 24)."""
    return _create(dict(embed_dim=96, depths=(2, 2, 6, 2), num_heads=(3, 6, 12, 24)), kwargs)


@register_model(config=_cfg(49.0, 7.5, 83.3))
def litv2_m(**kwargs) -> LITv2:
    """LITv2-M: C = 96, depths (2, 2, 18, 2), heads (3, 6, 12, 24)."""
    return _create(dict(embed_dim=96, depths=(2, 2, 18, 2), num_heads=(3, 6, 12, 24)), kwargs)


@register_model(config=_cfg(87.0, 13.2, 83.6))
def litv2_b(**kwargs) -> LITv2:
    """LITv2-B: C = 128, depths (2, 2, 18, 2), heads (4, 8, 16, 32)."""
    return _create(dict(embed_dim=128, depths=(2, 2, 18, 2), num_heads=(4, 8, 16, 32)), kwargs)


__all__ = ["LITv2", "LITv2Stage", "ConvFFN", "ConvFFNBlock", "HiLoBlock", "DeformConv2d",
           "DeformableTokenMerging"]
