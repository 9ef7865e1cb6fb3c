"""MobileViT (Mehta & Rastegari, 2022, "MobileViT: Light-weight, General-purpose, and Mobile-friendly Vision
Transformer", ICLR 2022).

A CNN backbone whose later stages interleave MobileNetV2 inverted residuals (Sandler et al., 2018) with
*MobileViT blocks*, which model global context with a transformer while keeping the spatial layout:

1. local representation: 3x3 conv-BN-SiLU (C -> C), then a 1x1 conv (C -> d, the transformer width);
2. unfold the (B, d, H, W) map into ``P = h*w`` pixel positions of non-overlapping h x w patches (2x2 here):
   for each pixel position p inside a patch, the N = HW/P patches form one sequence, so a transformer
   block on (B*P, N, d) lets every pixel attend to the same position in every other patch (global receptive
   field, because the 3x3 conv already mixed the patch's neighbourhood);
3. L pre-norm transformer blocks (4 heads, MLP ratio 2, SiLU) and a LayerNorm;
4. fold back to (B, d, H, W), 1x1 conv-BN-SiLU to C, concatenate with the block input (2C) and fuse with a
   3x3 conv-BN-SiLU to C.

Network (paper Table 4 / Appendix A): 3x3 stride-2 stem; MV2 (stride 1); 3 MV2 (first stride 2); then three
stages of [MV2 stride 2 + MobileViT block with L = 2, 4, 3] at strides 8, 16, 32; a 1x1 conv to 4x the last
width (``num_features``); global average pool; linear classifier. MV2 expansion is 4 (2 for XXS).

Module names follow timm's ``mobilevit_*`` (``stem``, ``stages.i.j``, ``final_conv``, ``head.fc``), so a
timm state dict loads as it is. The unfold needs every MobileViT block's map divisible by the patch: with the
default patches that is H and W multiples of 64 (stride 32 x patch 2); other sizes raise a ``ValueError``
unless ``interpolate_patches=True``, which resizes the map bilinearly to the next multiple and back as the
reference code (ml-cvnets) and timm do.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from vitlab.attention import Block
from vitlab.layers import (
    DropPath,
    check_image,
    check_pool,
    checkpoint_seq,
    create_classifier,
    drop_path_schedule,
    get_act_layer,
    get_norm_layer,
    init_linears_trunc_normal_,
    intermediates_plan,
    make_divisible,
    to_2tuple,
)
from vitlab.models._base import TimmApiMixin
from vitlab.registry import ModelConfig, register_model

_PAPER = ("Mehta & Rastegari, MobileViT: Light-weight, General-purpose, and Mobile-friendly Vision "
          "Transformer, ICLR 2022")
_POOL_TYPES = ("avg", "max")


class ConvNormAct(nn.Sequential):
    """Conv (no bias) -> BatchNorm -> activation (or none). Keys ``conv.*``, ``bn.*`` as timm's."""

    def __init__(self, in_chs: int, out_chs: int, kernel_size: int = 1, stride: int = 1, groups: int = 1,
                 act_layer: str | Callable | None = "silu"):
        super().__init__()
        self.conv = nn.Conv2d(in_chs, out_chs, kernel_size, stride=stride, padding=kernel_size // 2,
                              groups=groups, bias=False)
        self.bn = nn.BatchNorm2d(out_chs)
        self.act = get_act_layer(act_layer)() if act_layer else nn.Identity()


class InvertedResidual(nn.Module):
    """MobileNetV2 block: 1x1 expand (x ``expand_ratio``) -> 3x3 depthwise (stride) -> 1x1 linear projection,
    with an identity shortcut only when the shape is kept (stride 1, same width)."""

    def __init__(self, in_chs: int, out_chs: int, stride: int = 1, expand_ratio: float = 4.0,
                 act_layer: str | Callable = "silu", drop_path: float = 0.0):
        super().__init__()
        mid = make_divisible(in_chs * expand_ratio, 8)
        self.has_shortcut = stride == 1 and in_chs == out_chs
        self.conv1_1x1 = ConvNormAct(in_chs, mid, 1, act_layer=act_layer)
        self.conv2_kxk = ConvNormAct(mid, mid, 3, stride=stride, groups=mid, act_layer=act_layer)
        self.conv3_1x1 = ConvNormAct(mid, out_chs, 1, act_layer=None)  # linear bottleneck: no activation
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv3_1x1(self.conv2_kxk(self.conv1_1x1(x)))
        return x + self.drop_path(y) if self.has_shortcut else y


class MobileViTBlock(nn.Module):
    """Local conv -> unfold into patches -> transformer -> fold -> 1x1 conv -> concat with input -> 3x3
    fuse."""

    def __init__(self, in_chs: int, transformer_dim: int, depth: int = 2, num_heads: int = 4,
                 mlp_ratio: float = 2.0, patch_size=2, act_layer: str | Callable = "silu",
                 norm_layer: str | Callable = "layernorm_eps5", attn_drop: float = 0.0,
                 proj_drop: float = 0.0, drop_path: float | list[float] = 0.0,
                 interpolate_patches: bool = False):
        super().__init__()
        self.patch_size = to_2tuple(patch_size)
        self.interpolate_patches = interpolate_patches
        dpr = drop_path if isinstance(drop_path, (list, tuple)) else [drop_path] * depth
        self.conv_kxk = ConvNormAct(in_chs, in_chs, 3, act_layer=act_layer)
        self.conv_1x1 = nn.Conv2d(in_chs, transformer_dim, 1, bias=False)
        self.transformer = nn.Sequential(*[
            Block(transformer_dim, num_heads, mlp_ratio=mlp_ratio, qkv_bias=True, proj_drop=proj_drop,
                  attn_drop=attn_drop, drop_path=p, act_layer=act_layer, norm_layer=norm_layer)
            for p in dpr])
        self.norm = get_norm_layer(norm_layer)(transformer_dim)
        self.conv_proj = ConvNormAct(transformer_dim, in_chs, 1, act_layer=act_layer)
        self.conv_fusion = ConvNormAct(2 * in_chs, in_chs, 3, act_layer=act_layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x  # (B, C, H, W)
        x = self.conv_1x1(self.conv_kxk(x))  # (B, d, H, W)
        ph, pw = self.patch_size
        H, W = x.shape[-2:]
        Hp, Wp = -(-H // ph) * ph, -(-W // pw) * pw
        resized = (Hp, Wp) != (H, W)
        if resized:
            if not self.interpolate_patches:
                raise ValueError(f"MobileViT block got a {H}x{W} map, not divisible by its {ph}x{pw} "
                                 f"patches; use an input size that is a multiple of the model's "
                                 f"`size_divisor` or interpolate_patches=True")
            x = F.interpolate(x, size=(Hp, Wp), mode="bilinear", align_corners=False)
        # unfold: pixel position (ph, pw) of a patch -> batch, patch index (nh, nw) -> sequence
        # b d (nh ph) (nw pw) -> (b ph pw) (nh nw) d, as explicit views: einops re-derives ph from nh by division,
        # which torch.export cannot simplify for a symbolic size (a batch of 1 then fails a shape guard)
        B, d, nh, nw = x.shape[0], x.shape[1], Hp // ph, Wp // pw
        x = x.reshape(B, d, nh, ph, nw, pw).permute(0, 3, 5, 2, 4, 1).reshape(B * ph * pw, nh * nw, d)  # (B*P, N, d)
        x = self.norm(self.transformer(x))
        x = x.reshape(B, ph, pw, nh, nw, d).permute(0, 5, 3, 1, 4, 2).reshape(B, d, Hp, Wp)  # fold
        if resized:
            x = F.interpolate(x, size=(H, W), mode="bilinear", align_corners=False)
        x = self.conv_proj(x)  # (B, C, H, W)
        return self.conv_fusion(torch.cat([shortcut, x], dim=1))  # (B, 2C, H, W) -> (B, C, H, W)


class ClassifierHead(nn.Module):
    """Global pooling -> dropout -> linear (``head.fc`` as timm)."""

    def __init__(self, in_features: int, num_classes: int, pool_type: str = "avg", drop_rate: float = 0.0):
        super().__init__()
        self.pool_type = _check_pool(pool_type)
        self.drop = nn.Dropout(drop_rate)
        self.fc = create_classifier(in_features, num_classes)

    def forward(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = x.mean((2, 3)) if self.pool_type == "avg" else x.amax((2, 3))  # (B, C, H, W) -> (B, C)
        x = self.drop(x)
        return x if pre_logits else self.fc(x)


def _check_pool(pool_type: str) -> str:
    return check_pool(pool_type, _POOL_TYPES, "MobileViT")


class MobileViT(TimmApiMixin, nn.Module):
    """MobileViT v1. ``chs``: widths of the five stages; ``transformer_dims`` / ``transformer_depths``: d and
    L of the MobileViT blocks in stages 3-5; ``ir_depths``: MV2 blocks in stages 1-2."""

    def __init__(
        self,
        img_size=256,
        in_chans: int = 3,
        num_classes: int = 1000,
        global_pool: str = "avg",
        stem_chs: int = 16,
        chs: tuple[int, ...] = (32, 64, 96, 128, 160),
        ir_depths: tuple[int, int] = (1, 3),
        transformer_dims: tuple[int, ...] = (144, 192, 240),
        transformer_depths: tuple[int, ...] = (2, 4, 3),
        num_features: int = 640,
        expand_ratio: float = 4.0,
        patch_size=2,
        num_heads: int = 4,
        mlp_ratio: float = 2.0,
        act_layer: str | Callable = "silu",
        norm_layer: str | Callable = "layernorm_eps5",
        drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        proj_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        interpolate_patches: bool = False,
        dynamic_img_size: bool = True,  # accepted for API symmetry: a conv net takes any (valid) size anyway
    ):
        super().__init__()
        if len(chs) != 5 or len(ir_depths) != 2 or not len(transformer_dims) == len(transformer_depths) == 3:
            raise ValueError("MobileViT needs 5 stage widths, 2 MV2 depths and 3 MobileViT (dim, depth)")
        self.num_classes = num_classes
        self.in_chans = in_chans
        self.img_size = to_2tuple(img_size)
        self.num_features = num_features
        self.patch_size = to_2tuple(patch_size)
        self.interpolate_patches = interpolate_patches
        self.grad_checkpointing = False
        # every MobileViT map (stride 8, 16, 32) must split into patches: H % (32 * ph) == 0 suffices and,
        # with the stride-2 3x3 convs, is also necessary when H % 32 == 0
        self.size_divisor = (32 * self.patch_size[0], 32 * self.patch_size[1])
        dh, dw = self.size_divisor
        if not interpolate_patches and (self.img_size[0] % dh or self.img_size[1] % dw):
            raise ValueError(f"MobileViT needs H and W divisible by {dh}x{dw} (output stride 32 x the "
                             f"MobileViT patch), got img_size={img_size}; or pass interpolate_patches=True")

        self.stem = ConvNormAct(in_chans, stem_chs, 3, stride=2, act_layer=act_layer)  # stride 2
        # one drop-path rate per residual unit: MV2 blocks with a shortcut and transformer blocks
        n_units = sum(ir_depths) + 3 + sum(transformer_depths)
        dpr = iter(drop_path_schedule(drop_path_rate, n_units))
        stages, prev = [], stem_chs
        for i, (c, d) in enumerate(zip(chs[:2], ir_depths, strict=True)):
            blocks = []
            for j in range(d):
                stride = 2 if (i == 1 and j == 0) else 1
                blocks.append(InvertedResidual(prev, c, stride, expand_ratio, act_layer, next(dpr)))
                prev = c
            stages.append(nn.Sequential(*blocks))
        for c, dim, depth in zip(chs[2:], transformer_dims, transformer_depths, strict=True):
            ir = InvertedResidual(prev, c, 2, expand_ratio, act_layer, next(dpr))
            mvit = MobileViTBlock(c, dim, depth, num_heads, mlp_ratio, patch_size, act_layer, norm_layer,
                                  attn_drop_rate, proj_drop_rate, [next(dpr) for _ in range(depth)],
                                  interpolate_patches)
            stages.append(nn.Sequential(ir, mvit))
            prev = c
        self.stages = nn.Sequential(*stages)
        self.final_conv = ConvNormAct(prev, num_features, 1, act_layer=act_layer)
        self.head = ClassifierHead(num_features, num_classes, global_pool, drop_rate)
        self.feature_info = [dict(num_chs=c, reduction=2 ** (i + 1), module=f"stages.{i}")
                             for i, c in enumerate(chs[:4])]
        self.feature_info.append(dict(num_chs=num_features, reduction=32, module="final_conv"))
        self._init_weights()

    def _init_weights(self) -> None:
        """Kaiming-normal (fan-out) convolutions, unit BatchNorm, small normal linears (ml-cvnets' init)."""
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        init_linears_trunc_normal_(self)

    # ---- timm-style API -------------------------------------------------------------------------------
    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        return set()

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head.fc

    def shard_units(self) -> list[nn.Module]:
        """The five stages (two MobileNetV2 stages, three MV2 + MobileViT-block stages), in forward order: the
        transformer blocks are too small (and fold / unfold around them) to be worth a unit each."""
        return list(self.stages)

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        self.num_classes = num_classes
        if global_pool is not None:
            self.head.pool_type = _check_pool(global_pool)
        self.head.fc = create_classifier(self.num_features, num_classes, self.final_conv.conv.weight.device)

    # ---- forward ---------------------------------------------------------------------------------------
    def _check_input(self, x: torch.Tensor) -> None:
        h, w = check_image(x, self.in_chans)
        dh, dw = self.size_divisor
        if not self.interpolate_patches and (h % dh or w % dw):
            ph, pw = self.patch_size
            raise ValueError(f"MobileViT needs H and W divisible by {dh}x{dw} (output stride 32 x {ph}x{pw} "
                             f"patches of the last MobileViT block), got {h}x{w}; resize the input or "
                             f"create the model with interpolate_patches=True")

    def _run_stages(self, stages, x: torch.Tensor) -> torch.Tensor:
        return checkpoint_seq(stages, x, enabled=self.grad_checkpointing)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        x = self.stem(x)  # (B, stem, H/2, W/2)
        return self.final_conv(self._run_stages(self.stages, x))  # (B, num_features, H/32, W/32)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        return self.head(x, pre_logits=pre_logits)

    def forward_intermediates(self, x: torch.Tensor, indices: int | list[int] | None = None,
                              norm: bool = False, output_fmt: str = "NCHW", intermediates_only: bool = False,
                              stop_early: bool = False):
        """The feature pyramid of :attr:`feature_info`: stages 1-4 (strides 2, 4, 8, 16) and ``final_conv``
        (stride 32; the last stage's output through the 1x1 conv, as timm). An int n = the last n levels.
        ``norm`` is accepted for API symmetry (the model has no final norm). Returns
        ``(forward_features(x), [features])`` unless ``intermediates_only``."""
        take, last = intermediates_plan(len(self.feature_info), indices, output_fmt, stop_early, intermediates_only)
        self._check_input(x)
        x = self.stem(x)
        feats = []
        for i, stage in enumerate(self.stages):
            if i > last:
                break
            x = self._run_stages((stage,), x)
            if i == len(self.stages) - 1:
                x = self.final_conv(x)
            if i in take:
                feats.append(x)
        if output_fmt == "NLC":
            feats = [f.flatten(2).transpose(1, 2) for f in feats]  # (B, H*W, C)
        return feats if intermediates_only else (x, feats)

    @staticmethod
    def checkpoint_filter_fn(state_dict: dict, model: MobileViT) -> dict:
        """timm's keys are ours; drop a ``head.fc`` of another size with a warning (the loader's own check
        only knows a top-level ``head``)."""
        own = model.state_dict()
        out = dict(state_dict)
        w = out.get("head.fc.weight")
        if w is not None and ("head.fc.weight" not in own or own["head.fc.weight"].shape != w.shape):
            warnings.warn(f"checkpoint classifier has {w.shape[0]} classes, the model {model.num_classes}: "
                          f"it is not loaded", stacklevel=3)
            out.pop("head.fc.weight")
            out.pop("head.fc.bias", None)
        return out


def _cfg(params: float, gmacs: float, top1: float, tag: str) -> ModelConfig:
    return ModelConfig(
        family="mobilevit", paper=_PAPER, input_size=(3, 256, 256), mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0),
        crop_pct=0.9, published_params_m=params, published_gmacs=gmacs, published_top1=top1,
        hf_hub_id=f"timm/{tag}.cvnets_in1k",
        # 64x64 (the smallest valid size), one MV2 block per early stage, one transformer block per MobileViT
        # block: every kind of layer kept
        smoke_kwargs={"img_size": 64, "ir_depths": (1, 1), "transformer_depths": (1, 1, 1)})


# Parameters: the paper's 1.3M / 2.3M / 5.6M (two significant digits). The paper gives no MAC count we can
# cite for these exact models, so the GMACs are timm's mobilevit_* at 256x256 measured with vitlab's counter
# (the test re-measures timm's model on the meta device and checks ours equals it).
@register_model(config=_cfg(1.3, 0.407, 69.0, "mobilevit_xxs"))
def mobilevit_xxs(**kwargs) -> MobileViT:
    """MobileViT-XXS: widths 16-24-48-64-80, d = 64/80/96, MV2 expansion 2."""
    args = dict(chs=(16, 24, 48, 64, 80), transformer_dims=(64, 80, 96), num_features=320, expand_ratio=2.0)
    return MobileViT(**{**args, **kwargs})


@register_model(config=_cfg(2.3, 1.026, 74.8, "mobilevit_xs"))
def mobilevit_xs(**kwargs) -> MobileViT:
    """MobileViT-XS: widths 32-48-64-80-96, d = 96/120/144."""
    args = dict(chs=(32, 48, 64, 80, 96), transformer_dims=(96, 120, 144), num_features=384)
    return MobileViT(**{**args, **kwargs})


@register_model(config=_cfg(5.6, 2.001, 78.4, "mobilevit_s"))
def mobilevit_s(**kwargs) -> MobileViT:
    """MobileViT-S: widths 32-64-96-128-160, d = 144/192/240."""
    args = dict(chs=(32, 64, 96, 128, 160), transformer_dims=(144, 192, 240), num_features=640)
    return MobileViT(**{**args, **kwargs})


__all__ = ["MobileViT", "MobileViTBlock", "InvertedResidual"]
