"""Swin Transformer (Liu et al., 2021, "Swin Transformer: Hierarchical Vision Transformer using Shifted
Windows", ICCV 2021).

A hierarchical ViT. A 4x4 patch embedding gives a (H/4, W/4) token grid; four stages follow, each (except
the first) opening with *patch merging* (concatenate every 2x2 neighbourhood, LayerNorm, Linear 4C -> 2C), so
the stages run at strides 4/8/16/32 with widths C, 2C, 4C, 8C, like a CNN pyramid. Inside a stage, blocks
alternate

- **W-MSA**: self-attention restricted to non-overlapping M x M windows (M = 7), linear in the image area;
- **SW-MSA**: the same after a cyclic shift of the grid by (M/2, M/2), so windows straddle the previous
  block's borders. Tokens that the roll brings together from opposite image edges must not attend to each other; an
  additive mask (0 within a region, -inf across regions; the paper's code uses -100) keeps them apart.

Every window attention adds a learned *relative position bias* B[dy, dx] (one table of (2M-1)^2 entries per
head) to the logits: ``softmax(QK^T / sqrt(d) + B + mask) V``. The attention itself is the zoo's
``local_window`` (W-MSA) and ``shifted_window`` (SW-MSA) mechanism of :mod:`vitlab.attention`, which passes
``B + mask`` as the additive ``attn_mask`` of ``scaled_dot_product_attention`` (masked pairs get -inf rather
than the paper code's -100: the same softmax in fp32). When a stage's grid is no larger than the window (the 7x7
last stage at 224), the window shrinks to the grid and the shift is dropped, as in the paper's code.

Module names follow timm's ``SwinTransformer`` (except the classifier: ``head`` rather than ``head.fc``,
remapped by :meth:`SwinTransformer.checkpoint_filter_fn`), so timm state dicts load.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
import torch.nn as nn
from einops import rearrange

from vitlab.attention import create_attention
from vitlab.layers import (
    DropPath,
    Mlp,
    PatchEmbed,
    check_pool,
    checkpoint_seq,
    drop_path_schedule,
    get_norm_layer,
    init_linears_trunc_normal_,
    intermediates_plan,
    to_2tuple,
)
from vitlab.models._base import TimmApiMixin
from vitlab.registry import ModelConfig, register_model

_PAPER = "Liu et al., Swin Transformer: Hierarchical Vision Transformer using Shifted Windows, ICCV 2021"
_POOL_TYPES = ("avg", "max", "")


class SwinTransformerBlock(nn.Module):
    """W-MSA (``shift_size == 0``) or SW-MSA block on a (B, H, W, C) grid of fixed ``input_resolution``:
    ``x + DropPath(WindowAttn(Norm(x)))`` then ``x + DropPath(MLP(Norm(x)))``."""

    def __init__(self, dim: int, input_resolution: tuple[int, int], num_heads: int, window_size=7,
                 shift_size=0, mlp_ratio: float = 4.0, qkv_bias: bool = True, proj_drop: float = 0.0,
                 attn_drop: float = 0.0, drop_path: float = 0.0, act_layer: str | Callable = "gelu",
                 norm_layer: str | Callable = "layernorm_eps5"):
        super().__init__()
        norm = get_norm_layer(norm_layer)
        self.dim = dim
        self.input_resolution = tuple(input_resolution)
        window, shift = to_2tuple(window_size), to_2tuple(shift_size)
        # a grid no larger than the window: one window covering it, nothing to shift
        self.window_size = tuple(r if r <= w else w for r, w in zip(self.input_resolution, window))
        self.shift_size = tuple(0 if r <= w else s for r, w, s in zip(self.input_resolution, window, shift))
        for r, w in zip(self.input_resolution, self.window_size):
            if r % w:
                H, W = self.input_resolution
                raise ValueError(f"Swin: a stage grid of {H}x{W} tokens is not divisible by the window "
                                 f"{window[0]}x{window[1]}; every stage grid (img_size / patch_size / 2**stage) "
                                 f"must be a multiple of the window size or no larger than it")
        self.norm1 = norm(dim)
        kind = dict(shift_size=self.shift_size) if any(self.shift_size) else {}
        self.attn = create_attention("shifted_window" if kind else "local_window", dim, num_heads,
                                     window_size=self.window_size, qkv_bias=qkv_bias, attn_drop=attn_drop,
                                     proj_drop=proj_drop, **kind)
        self.drop_path1 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = norm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=act_layer, drop=proj_drop)
        self.drop_path2 = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def _attn(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, H, W, C) -> (B, H, W, C): (shifted) window attention over the H x W token grid."""
        B, H, W, C = x.shape
        return self.attn(x.reshape(B, H * W, C), (H, W)).view(B, H, W, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, H, W, C) -> (B, H, W, C)
        x = x + self.drop_path1(self._attn(self.norm1(x)))
        return x + self.drop_path2(self.mlp(self.norm2(x)))  # the MLP is token-wise: no reshape needed


class PatchMerging(nn.Module):
    """Downsample 2x: concatenate each 2x2 neighbourhood (B, H, W, C) -> (B, H/2, W/2, 4C), LayerNorm, then a
    bias-free Linear to ``out_dim`` (2C). Concatenation order (0,0), (1,0), (0,1), (1,1) (row, col) as the
    paper's code, so its weights apply."""

    def __init__(self, dim: int, out_dim: int | None = None, norm_layer: str | Callable = "layernorm_eps5"):
        super().__init__()
        self.dim = dim
        self.out_dim = out_dim or 2 * dim
        self.norm = get_norm_layer(norm_layer)(4 * dim)
        self.reduction = nn.Linear(4 * dim, self.out_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = rearrange(x, "b (h dh) (w dw) c -> b h w (dw dh c)", dh=2, dw=2)  # (B, H/2, W/2, 4C)
        return self.reduction(self.norm(x))


class SwinTransformerStage(nn.Module):
    """Optional patch merging, then ``depth`` blocks alternating W-MSA and SW-MSA (shift = window // 2)."""

    def __init__(self, dim: int, out_dim: int, input_resolution: tuple[int, int], depth: int,
                 downsample: bool, num_heads: int, window_size=7, mlp_ratio: float = 4.0,
                 qkv_bias: bool = True, proj_drop: float = 0.0, attn_drop: float = 0.0,
                 drop_path: list[float] | None = None,
                 act_layer: str | Callable = "gelu", norm_layer: str | Callable = "layernorm_eps5"):
        super().__init__()
        H, W = input_resolution
        if downsample and (H % 2 or W % 2):
            raise ValueError(f"Swin: patch merging needs an even token grid, got {H}x{W}; img_size / "
                             f"patch_size must be divisible by 2**(num_stages - 1)")
        self.input_resolution = (H, W)
        self.output_resolution = (H // 2, W // 2) if downsample else (H, W)
        self.grad_checkpointing = False
        window = to_2tuple(window_size)
        shift = (window[0] // 2, window[1] // 2)
        drop_path = drop_path or [0.0] * depth
        self.downsample = PatchMerging(dim, out_dim, norm_layer) if downsample else nn.Identity()
        if not downsample and dim != out_dim:
            raise ValueError(f"a stage without patch merging keeps its width ({dim} != {out_dim})")
        self.blocks = nn.Sequential(*[
            SwinTransformerBlock(out_dim, self.output_resolution, num_heads, window_size=window,
                                 shift_size=0 if i % 2 == 0 else shift, mlp_ratio=mlp_ratio,
                                 qkv_bias=qkv_bias, proj_drop=proj_drop, attn_drop=attn_drop, drop_path=drop_path[i],
                                 act_layer=act_layer, norm_layer=norm_layer)
            for i in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, H, W, C) -> (B, H', W', C')
        return checkpoint_seq(self.blocks, self.downsample(x), enabled=self.grad_checkpointing)


class SwinTransformer(TimmApiMixin, nn.Module):
    """Swin Transformer. ``forward_features`` returns the normed last-stage map in NHWC:
    (B, H/32, W/32, 8C)."""

    pool_types = _POOL_TYPES

    def __init__(
        self,
        img_size=224,
        patch_size=4,
        in_chans: int = 3,
        num_classes: int = 1000,
        global_pool: str = "avg",
        embed_dim: int = 96,
        depths: tuple[int, ...] = (2, 2, 6, 2),
        num_heads: tuple[int, ...] = (3, 6, 12, 24),
        window_size=7,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        drop_rate: float = 0.0,
        proj_drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        norm_layer: str | Callable = "layernorm_eps5",
        act_layer: str | Callable = "gelu",
        dynamic_img_size: bool = False,
        weight_init: str = "trunc_normal",
    ):
        super().__init__()
        check_pool(global_pool, _POOL_TYPES)
        if dynamic_img_size:
            raise ValueError("Swin precomputes its shifted-window masks for one input size; create the model "
                             "with img_size=(H, W) instead of dynamic_img_size=True")
        if len(depths) != len(num_heads):
            raise ValueError(f"depths {tuple(depths)} and num_heads {tuple(num_heads)} differ in length")
        self.num_classes = num_classes
        self.global_pool = global_pool
        self.num_layers = len(depths)
        self.embed_dim = embed_dim
        dims = [embed_dim * 2**i for i in range(self.num_layers)]
        self.num_features = dims[-1]
        norm = get_norm_layer(norm_layer)

        self.img_size, self.in_chans = to_2tuple(img_size), in_chans  # what the hierarchical families expose
        self.patch_embed = PatchEmbed(img_size=img_size, patch_size=patch_size, in_chans=in_chans,
                                      embed_dim=embed_dim, norm_layer=norm, flatten=False)  # -> (B, H, W, C)
        H, W = self.patch_embed.grid_size
        patch = max(self.patch_embed.patch_size)
        dpr = drop_path_schedule(drop_path_rate, sum(depths))  # linear over all blocks of all stages
        layers, self.feature_info = [], []
        for i, depth in enumerate(depths):
            stage = SwinTransformerStage(
                dims[max(i - 1, 0)], dims[i], (H, W), depth, downsample=i > 0, num_heads=num_heads[i],
                window_size=window_size, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias, proj_drop=proj_drop_rate,
                attn_drop=attn_drop_rate, drop_path=dpr[sum(depths[:i]):sum(depths[: i + 1])],
                act_layer=act_layer, norm_layer=norm_layer)
            H, W = stage.output_resolution
            layers.append(stage)
            self.feature_info.append(dict(num_chs=dims[i], reduction=patch * 2**i, module=f"layers.{i}"))
        self.layers = nn.Sequential(*layers)
        self.norm = norm(self.num_features)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = self._make_head(num_classes)
        if weight_init == "trunc_normal":
            self._init_trunc_normal()
        elif weight_init != "none":
            raise ValueError(f"unknown weight_init {weight_init!r}; choose 'trunc_normal' or 'none'")

    def _init_trunc_normal(self) -> None:
        """The paper's init: truncated normal (std 0.02) for linears and the bias tables (done by the window
        attention itself), zero biases."""
        init_linears_trunc_normal_(self)

    # ---- timm-style API -------------------------------------------------------------------------------
    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        return {n for n, _ in self.named_parameters() if "relative_position_bias_table" in n}

    def shard_units(self) -> list[nn.Module]:
        """The blocks of every stage, in forward order; patch merging stays with the root."""
        return [b for stage in self.layers for b in stage.blocks]

    # ---- forward ---------------------------------------------------------------------------------------
    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x)  # (B, H/4, W/4, C)
        x = self.layers(x)  # (B, H/32, W/32, 8C)
        return self.norm(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        if self.global_pool == "avg":
            x = x.mean(dim=(1, 2))  # (B, C)
        elif self.global_pool == "max":
            x = x.amax(dim=(1, 2))
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
        x = self.patch_embed(x)
        feats = []
        for i, stage in enumerate(stages):
            x = stage(x)  # (B, H_i, W_i, C_i)
            if i in take:
                y = self.norm(x) if (norm and i == last) else x
                feats.append(y.permute(0, 3, 1, 2).contiguous() if output_fmt == "NCHW" else y.flatten(1, 2))
        if intermediates_only:
            return feats
        return (self.norm(x) if len(stages) == self.num_layers else x), feats

    @staticmethod
    def checkpoint_filter_fn(state_dict: dict, model: SwinTransformer) -> dict:
        """timm / original Swin state dict -> ours: drop the derived buffers (relative_position_index,
        attn_mask), rename timm's ``head.fc`` to ``head``, and move the original checkpoints' downsampling
        (saved at the end of a stage) to the start of the next stage, as here and in timm."""
        original = "layers.0.downsample.reduction.weight" in state_dict
        out = {}
        for k, v in state_dict.items():
            if k.endswith(("relative_position_index", "attn_mask")):
                continue
            if original:
                k = re.sub(r"^layers\.(\d+)\.downsample",
                           lambda m: f"layers.{int(m.group(1)) + 1}.downsample", k)
            if k.startswith("head.fc."):
                k = "head." + k[len("head.fc."):]
            out[k] = v
        return out


def _cfg(name: str, params: float, gmacs: float, top1: float) -> ModelConfig:
    return ModelConfig(family="swin", paper=_PAPER, crop_pct=0.9, published_params_m=params,
                       published_gmacs=gmacs, published_top1=top1, hf_hub_id=f"timm/{name}.ms_in1k",
                       extra={"patch_size": 4, "window_size": 7},
                       # 64 px with 4x4 windows: stages of 16, 8, 4, 2 tokens; the first two keep shifted
                       # windows (masks), the last two the window-clamped-to-grid case, all keep merging
                       smoke_kwargs=dict(img_size=64, window_size=4, depths=(2, 2, 2, 2)))


def _create(config: dict, kwargs: dict) -> SwinTransformer:
    """The named ``config``; ``kwargs`` override any of it (the smoke tests shrink depths and windows)."""
    args = dict(patch_size=4, window_size=7, **config)
    args.update(kwargs)
    return SwinTransformer(**args)


@register_model(config=_cfg("swin_tiny_patch4_window7_224", 28.29, 4.51, 81.2))
def swin_tiny_patch4_window7_224(**kwargs) -> SwinTransformer:
    """Swin-T: C = 96, depths (2, 2, 6, 2), heads (3, 6, 12, 24)."""
    return _create(dict(embed_dim=96, depths=(2, 2, 6, 2), num_heads=(3, 6, 12, 24)), kwargs)


@register_model(config=_cfg("swin_small_patch4_window7_224", 49.61, 8.77, 83.2))
def swin_small_patch4_window7_224(**kwargs) -> SwinTransformer:
    """Swin-S: C = 96, depths (2, 2, 18, 2), heads (3, 6, 12, 24)."""
    return _create(dict(embed_dim=96, depths=(2, 2, 18, 2), num_heads=(3, 6, 12, 24)), kwargs)


@register_model(config=_cfg("swin_base_patch4_window7_224", 87.77, 15.47, 83.5))
def swin_base_patch4_window7_224(**kwargs) -> SwinTransformer:
    """Swin-B: C = 128, depths (2, 2, 18, 2), heads (4, 8, 16, 32)."""
    return _create(dict(embed_dim=128, depths=(2, 2, 18, 2), num_heads=(4, 8, 16, 32)), kwargs)


__all__ = ["PatchMerging", "SwinTransformer", "SwinTransformerBlock", "SwinTransformerStage"]
