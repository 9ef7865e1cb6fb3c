"""LeViT (Graham et al., 2021, "LeViT: a Vision Transformer in ConvNet's Clothing for Faster Inference", ICCV
2021; its supplementary gives the ablations A1 and A6).

What it computes:

- a convolutional stem of four stride-2 3x3 convolutions (each followed by BatchNorm, Hardswish between them)
  that takes a 224x224 image to 14x14 tokens of width C1 (resolution / 16);
- three stages of residual blocks at 14x14, 7x7 and 4x4. A block is attention + MLP, each a residual branch.
  Every linear layer is followed by a BatchNorm (no LayerNorm anywhere), activations are Hardswish;
- attention has *no position embedding*: instead each head adds a learned bias ``B[h, |dy|, |dx|]`` indexed by
  the absolute offset between query and key (the "attention bias" of Eqn. 1), keys of dimension D, values of
  dimension ``attn_ratio * D`` (2D in the blocks), Hardswish on the attention output before the projection;
- between stages a *shrinking attention* block: the queries are taken from a 2x-subsampled grid, the keys and
  values from the full grid (values of dimension 4D, ``C / D`` heads), giving the next stage's resolution and
  width; it is followed by a residual MLP;
- the MLPs expand by 2 (not 4 as in DeiT);
- the head: average of the final tokens -> BatchNorm -> Linear, twice (class and distillation heads, DeiT-style
  hard distillation). In eval the model returns the mean of both; in training a tuple of both (see
  ``distilled_training``).

:meth:`Levit.fuse` folds every BatchNorm into the linear/conv layer next to it for inference (same function).

The attention biases are tied to the token grid: a model is built for one ``img_size`` and other input sizes
raise a ``ValueError``; build the model with ``img_size=...`` to use another size (a checkpoint's bias tables are
cropped / edge-extended to the new grid on load, see :meth:`Levit.checkpoint_filter_fn`).

Tokens are kept as (B, N, C) sequences and the module names follow timm's ``levit_*`` models (linear mode), so a
timm state dict loads as is.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from vitlab.attention.offset_bias import (
    LevitAttention,
    LevitAttentionDownsample,
    LinearNorm,
    batch_norm_rows,
    bn_scale_shift,
    fold_offset_biases,
)
from vitlab.layers import (
    DropPath,
    check_image,
    check_pool,
    checkpoint_seq,
    downsample_size,
    get_act_layer,
    intermediates_plan,
    to_2tuple,
)
from vitlab.models._base import TimmApiMixin
from vitlab.registry import ModelConfig, register_model

__all__ = ["Levit", "fuse_batchnorms"]


# ---- BatchNorm-carrying layers and their fusion ------------------------------------------------------------
class ConvNorm(nn.Module):
    """Conv2d (no bias) -> BatchNorm2d."""

    def __init__(self, in_chs: int, out_chs: int, kernel_size: int = 1, stride: int = 1, padding: int = 0,
                 bn_weight_init: float = 1.0):
        super().__init__()
        self.linear = nn.Conv2d(in_chs, out_chs, kernel_size, stride, padding, bias=False)
        self.bn = nn.BatchNorm2d(out_chs)
        nn.init.constant_(self.bn.weight, bn_weight_init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.linear(x))

    @torch.no_grad()
    def fuse(self) -> nn.Conv2d:
        c = self.linear
        scale, shift = bn_scale_shift(self.bn)
        m = nn.Conv2d(c.in_channels, c.out_channels, c.kernel_size, c.stride, c.padding, bias=True,
                      device=c.weight.device, dtype=c.weight.dtype)
        m.weight.copy_(c.weight * scale[:, None, None, None])
        m.bias.copy_(shift)
        return m


class NormLinear(nn.Module):
    """The classifier: BatchNorm1d -> Dropout -> Linear."""

    def __init__(self, in_features: int, out_features: int, drop: float = 0.0):
        super().__init__()
        self.bn = nn.BatchNorm1d(in_features)
        self.drop = nn.Dropout(drop)
        self.linear = nn.Linear(in_features, out_features)
        nn.init.trunc_normal_(self.linear.weight, std=0.02)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C) -> (B, classes)
        return self.linear(self.drop(batch_norm_rows(self.bn, x)))

    @torch.no_grad()
    def fuse(self) -> nn.Linear:
        lin = self.linear
        scale, shift = bn_scale_shift(self.bn)
        m = nn.Linear(lin.in_features, lin.out_features, device=lin.weight.device, dtype=lin.weight.dtype)
        m.weight.copy_(lin.weight * scale[None, :])  # W (x * s + t) + b = (W s) x + (W t + b)
        m.bias.copy_(lin.weight @ shift + lin.bias)
        return m


def fuse_batchnorms(module: nn.Module) -> nn.Module:
    """Replace, recursively and in place, every child that has a ``fuse()`` (a layer + BatchNorm pair) by the
    single fused layer it returns."""
    for name, child in module.named_children():
        if isinstance(child, (ConvNorm, LinearNorm, NormLinear)):
            setattr(module, name, child.fuse())
        else:
            fuse_batchnorms(child)
    return module


# ---- stem ---------------------------------------------------------------------------------------------------
class Stem16(nn.Sequential):
    """Four 3x3 stride-2 convolutions, C/8 -> C/4 -> C/2 -> C channels: (B, 3, H, W) -> (B, C, H/16, W/16)."""

    def __init__(self, in_chs: int, out_chs: int, act_layer: Callable[[], nn.Module]):
        super().__init__()
        self.stride = 16
        chs = [in_chs, out_chs // 8, out_chs // 4, out_chs // 2, out_chs]
        for i in range(4):
            self.add_module(f"conv{i + 1}", ConvNorm(chs[i], chs[i + 1], 3, stride=2, padding=1))
            if i < 3:
                self.add_module(f"act{i + 1}", act_layer())


class LevitMlp(nn.Module):
    """LinearNorm -> Hardswish -> Dropout -> LinearNorm (BN weight 0 at init on the residual output)."""

    def __init__(self, in_features: int, hidden_features: int, act_layer: Callable[[], nn.Module] = nn.Hardswish,
                 drop: float = 0.0):
        super().__init__()
        self.ln1 = LinearNorm(in_features, hidden_features)
        self.act = act_layer()
        self.drop = nn.Dropout(drop)
        self.ln2 = LinearNorm(hidden_features, in_features, bn_weight_init=0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln2(self.drop(self.act(self.ln1(x))))


class LevitDownsample(nn.Module):
    """Shrinking attention (no residual: the shape changes) followed by a residual MLP."""

    def __init__(self, in_dim: int, out_dim: int, key_dim: int, num_heads: int, attn_ratio: float,
                 mlp_ratio: float, resolution: tuple[int, int], act_layer, drop_path: float = 0.0):
        super().__init__()
        self.attn_downsample = LevitAttentionDownsample(in_dim, out_dim, key_dim, num_heads, attn_ratio,
                                                   resolution=resolution, act_layer=act_layer)
        self.mlp = LevitMlp(out_dim, int(out_dim * mlp_ratio), act_layer=act_layer)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attn_downsample(x)
        return x + self.drop_path(self.mlp(x))


class LevitBlock(nn.Module):
    """x + attn(x), then x + mlp(x); (B, N, C) -> (B, N, C). No norm layer: the BatchNorms sit inside."""

    def __init__(self, dim: int, key_dim: int, num_heads: int, attn_ratio: float, mlp_ratio: float,
                 resolution: tuple[int, int], act_layer, drop_path: float = 0.0):
        super().__init__()
        self.attn = LevitAttention(dim, key_dim, num_heads, attn_ratio, resolution, act_layer)
        self.drop_path1 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.mlp = LevitMlp(dim, int(dim * mlp_ratio), act_layer=act_layer)
        self.drop_path2 = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path1(self.attn(x))
        return x + self.drop_path2(self.mlp(x))


class LevitStage(nn.Module):
    """[shrinking attention + MLP] (stages 2, 3) then ``depth`` blocks at the stage's resolution."""

    def __init__(self, in_dim: int, out_dim: int, key_dim: int, depth: int, num_heads: int, attn_ratio: float,
                 mlp_ratio: float, act_layer, resolution: tuple[int, int], downsample: bool,
                 down_heads: int | None = None, down_attn_ratio: float = 4.0, down_mlp_ratio: float = 2.0,
                 drop_path: float = 0.0):
        super().__init__()
        self.grad_checkpointing = False
        if downsample:
            self.downsample = LevitDownsample(
                in_dim, out_dim, key_dim, num_heads=down_heads or in_dim // key_dim, attn_ratio=down_attn_ratio,
                mlp_ratio=down_mlp_ratio, resolution=resolution, act_layer=act_layer, drop_path=drop_path)
            resolution = tuple(downsample_size(r) for r in resolution)
        else:
            if in_dim != out_dim:
                raise ValueError(f"a stage without downsampling keeps its width: {in_dim} != {out_dim}")
            self.downsample = nn.Identity()
        self.resolution = resolution
        self.blocks = nn.Sequential(*[
            LevitBlock(out_dim, key_dim, num_heads, attn_ratio, mlp_ratio, resolution, act_layer, drop_path)
            for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint_seq((self.downsample, *self.blocks), x, enabled=self.grad_checkpointing)


def _per_stage(value, n: int, what: str) -> tuple:
    if isinstance(value, (int, float)):
        return (value,) * n
    value = tuple(value)
    if len(value) != n:
        raise ValueError(f"{what} has {len(value)} entries for {n} stages")
    return value


class Levit(TimmApiMixin, nn.Module):
    """LeViT with the class and distillation heads (timm's ``LevitDistilled``; ``distilled=False``: one head)."""

    pool_types = ("avg", "")

    def __init__(
        self,
        img_size: int | tuple[int, int] = 224,
        in_chans: int = 3,
        num_classes: int = 1000,
        embed_dim: tuple[int, ...] = (128, 256, 384),
        key_dim: int = 16,
        depth: tuple[int, ...] = (2, 3, 4),
        num_heads: int | tuple[int, ...] = (4, 6, 8),
        attn_ratio: float | tuple[float, ...] = 2.0,
        mlp_ratio: float | tuple[float, ...] = 2.0,
        down_heads: tuple[int | None, ...] | None = None,
        down_attn_ratio: float = 4.0,
        down_mlp_ratio: float = 2.0,
        act_layer: str | Callable = "hardswish",
        global_pool: str = "avg",
        distilled: bool = True,
        drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
    ):
        super().__init__()
        n = len(embed_dim)
        if len(depth) != n:
            raise ValueError(f"depth has {len(depth)} entries for {n} stages")
        num_heads = _per_stage(num_heads, n, "num_heads")
        attn_ratio = _per_stage(attn_ratio, n, "attn_ratio")
        mlp_ratio = _per_stage(mlp_ratio, n, "mlp_ratio")
        down_heads = (None,) * n if down_heads is None else (None,) + _per_stage(down_heads, n - 1, "down_heads")
        check_pool(global_pool, self.pool_types, "LeViT")
        act = get_act_layer(act_layer)
        self.img_size = to_2tuple(img_size)
        self.in_chans = in_chans
        self.num_classes = num_classes
        self.global_pool = global_pool
        self.embed_dim = tuple(embed_dim)
        self.num_features = self.head_hidden_size = embed_dim[-1]
        self.drop_rate = drop_rate
        self.distilled = distilled
        self.distilled_training = True  # in train mode return (cls_logits, dist_logits), as vitlab's DeiT
        self.grad_checkpointing = False
        self.fused = False

        self.stem = Stem16(in_chans, embed_dim[0], act)
        stride = self.stem.stride
        resolution = self.img_size
        for _ in range(4):  # the grid the stem really produces (timm's img_size // 16 for multiples of 16)
            resolution = tuple(downsample_size(r) for r in resolution)
        self.grid_size = resolution

        # official LeViT / timm: every residual branch gets the same drop-path rate (no linear schedule)
        stages, self.feature_info = [], []
        in_dim = embed_dim[0]
        for i in range(n):
            stages.append(LevitStage(
                in_dim, embed_dim[i], key_dim, depth[i], num_heads[i], attn_ratio[i], mlp_ratio[i], act,
                resolution, downsample=i > 0, down_heads=down_heads[i], down_attn_ratio=down_attn_ratio,
                down_mlp_ratio=down_mlp_ratio, drop_path=drop_path_rate))
            if i > 0:
                stride *= 2
                resolution = tuple(downsample_size(r) for r in resolution)
            self.feature_info.append(dict(num_chs=embed_dim[i], reduction=stride, module=f"stages.{i}"))
            in_dim = embed_dim[i]
        self.stages = nn.Sequential(*stages)
        self.head = self._make_head(num_classes)
        self.head_dist = self._make_head(num_classes) if distilled else None

    def _make_head(self, num_classes: int) -> nn.Module:
        if num_classes <= 0:
            return nn.Identity()
        return NormLinear(self.num_features, num_classes, drop=self.drop_rate).train(self.training)

    # ---- timm-style API -------------------------------------------------------------------------------
    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        return {k for k, _ in self.named_parameters() if "attention_biases" in k}

    @torch.jit.ignore
    def set_distilled_training(self, enable: bool = True) -> None:
        self.distilled_training = enable

    def shard_units(self) -> list[nn.Module]:
        """Each stage's shrinking-attention block (stages 2, 3) and its blocks, in forward order."""
        return [m for s in self.stages for m in (s.downsample, *s.blocks) if not isinstance(m, nn.Identity)]

    @torch.no_grad()
    def fuse(self) -> Levit:
        """Fold every BatchNorm into the linear / conv layer before it (after it, for the classifier's BatchNorm)
        and gather each attention's offset bias once, for inference; the fused model computes the same function
        in eval mode. Returns ``self`` in eval mode."""
        self.eval()
        fuse_batchnorms(self)
        fold_offset_biases(self)
        self.fused = True
        return self

    @staticmethod
    def checkpoint_filter_fn(state_dict: dict, model: Levit) -> dict:
        """A timm / vitlab LeViT state dict for ``model``: drop the derived ``attention_bias_idxs`` buffers and
        fit each bias table (heads, H*W), indexed by the offset (|dy|, |dx|), to the model's grid: offsets the
        model also has keep their bias; new, larger offsets take the bias of the largest known one."""
        own = model.state_dict()
        out = {}
        drop = set()
        for head in ("head", "head_dist"):  # a classifier of another size (e.g. fine-tuning): not loaded
            w = state_dict.get(f"{head}.linear.weight")
            if w is not None and own.get(f"{head}.linear.weight", w.new_empty(0)).shape != w.shape:
                warnings.warn(f"checkpoint classifier '{head}' has {w.shape[0]} classes, the model "
                              f"{model.num_classes}: it is not loaded", stacklevel=3)
                drop.add(head + ".")
        for k, v in state_dict.items():
            if "attention_bias_idxs" in k or any(k.startswith(d) for d in drop):
                continue
            if k.endswith("attention_biases") and k in own and v.shape != own[k].shape:
                v = _fit_bias_table(v, _module_resolution(model, k))
            out[k] = v
        return out

    # ---- forward ---------------------------------------------------------------------------------------
    def _check_input(self, x: torch.Tensor) -> None:
        check_image(x, self.in_chans)
        if tuple(x.shape[-2:]) != self.img_size:
            raise ValueError(
                f"LeViT's attention biases are tied to the token grid: this model was built for "
                f"{self.img_size[0]}x{self.img_size[1]} inputs ({self.grid_size[0]}x{self.grid_size[1]} tokens), got "
                f"{x.shape[-2]}x{x.shape[-1]}; build it with img_size={tuple(x.shape[-2:])} (a checkpoint's bias "
                f"tables are fitted to the new grid on load)")

    def _stem_tokens(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        return self.stem(x).flatten(2).transpose(1, 2)  # (B, C, H/16, W/16) -> (B, N, C)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, in_chans, H, W) -> (B, N, C) tokens of the last stage."""
        return self.stages(self._stem_tokens(x))

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False):
        if self.global_pool == "avg":
            x = x.mean(dim=1)  # (B, N, C) -> (B, C)
        if pre_logits:
            return x
        if self.head_dist is None:
            return self.head(x)
        x, x_dist = self.head(x), self.head_dist(x)
        if self.distilled_training and self.training:
            return x, x_dist  # the trainer applies the class loss to one, the distillation loss to the other
        return (x + x_dist) / 2

    def forward_intermediates(self, x: torch.Tensor, indices: int | list[int] | None = None, norm: bool = False,
                              output_fmt: str = "NCHW", intermediates_only: bool = False,
                              stop_early: bool = False):
        """The feature pyramid: the outputs of the chosen stages (an int n = the last n; None = all) at strides
        16, 32, 64, as (B, C, H, W) or (B, N, C). Returns ``(final_features, intermediates)`` unless
        ``intermediates_only``; ``final_features`` equals :meth:`forward_features`. LeViT has no final norm, so
        ``norm`` changes nothing."""
        take, last = intermediates_plan(len(self.stages), indices, output_fmt, stop_early, intermediates_only)
        x = self._stem_tokens(x)
        B = x.shape[0]
        stages = self.stages[: last + 1]
        feats = []
        for i, stage in enumerate(stages):
            x = stage(x)
            if i in take:
                if output_fmt == "NCHW":
                    h, w = stage.resolution
                    feats.append(x.transpose(1, 2).reshape(B, -1, h, w))
                else:
                    feats.append(x)
        if intermediates_only:
            return feats
        return x, feats


def _module_resolution(model: Levit, key: str) -> tuple[int, int]:
    return model.get_submodule(key.rsplit(".", 1)[0]).resolution


def _fit_bias_table(table: torch.Tensor, resolution: tuple[int, int]) -> torch.Tensor:
    """(heads, h*w) offset-bias table of a square-or-not grid -> (heads, H*W): crop, or extend by repeating the
    largest offset (an offset counts tokens, so a known offset keeps its meaning on a larger grid)."""
    H, W = resolution
    heads, n = table.shape
    side = int(round(n ** 0.5))
    if side * side != n:
        raise ValueError(f"cannot infer the grid of a {n}-entry attention-bias table; resample it yourself")
    t = table.reshape(heads, side, side)[:, :H, :W]
    t = F.pad(t[None], (0, W - t.shape[2], 0, H - t.shape[1]), mode="replicate")[0] \
        if (t.shape[1] < H or t.shape[2] < W) else t
    return t.reshape(heads, H * W).contiguous()


# ---- registered configs -----------------------------------------------------------------------------------------
_PAPER = "Graham et al., LeViT: a Vision Transformer in ConvNet's Clothing for Faster Inference, ICCV 2021"
_SMOKE = {"img_size": 64, "depth": (1, 1, 1)}

_CFGS = {
    "levit_128s": dict(embed_dim=(128, 256, 384), key_dim=16, num_heads=(4, 6, 8), depth=(2, 3, 4)),
    "levit_128": dict(embed_dim=(128, 256, 384), key_dim=16, num_heads=(4, 8, 12), depth=(4, 4, 4)),
    "levit_192": dict(embed_dim=(192, 288, 384), key_dim=32, num_heads=(3, 5, 6), depth=(4, 4, 4)),
    "levit_256": dict(embed_dim=(256, 384, 512), key_dim=32, num_heads=(4, 6, 8), depth=(4, 4, 4)),
    "levit_384": dict(embed_dim=(384, 512, 768), key_dim=32, num_heads=(6, 9, 12), depth=(4, 4, 4)),
    # LeViT supplementary, A1 (no pyramid): LeViT-128S's 2+3+4 blocks and 2 shrinking blocks become one stage of
    # 11 blocks at 14x14, D = 19, N = 3 heads, C = 2ND = 114 (values 2D per head), keeping the FLOPs of LeViT-128S
    "levit_128s_ablation_a1": dict(embed_dim=(114,), key_dim=19, num_heads=(3,), depth=(11,)),
    # LeViT supplementary, A6 (no wider blocks): LeViT-128S with DeiT-like blocks: Q, K, V all of dimension D = 30
    # (attn_ratio 1), C = ND = 120 / 180 / 240 (N = 4, 6, 8), MLP ratio 4 (in the shrinking blocks too), and the
    # shrinking attentions with N = 4C/D = 16, 24 heads of value dimension D
    "levit_128s_ablation_a6": dict(embed_dim=(120, 180, 240), key_dim=30, num_heads=(4, 6, 8), depth=(2, 3, 4),
                                   attn_ratio=1.0, mlp_ratio=4.0, down_heads=(16, 24), down_attn_ratio=1.0,
                                   down_mlp_ratio=4.0),
}


def _cfg(name: str, params: float | None, gmacs: float | None, top1: float | None, hub: bool = True,
         smoke: dict | None = None, **extra) -> ModelConfig:
    return ModelConfig(family="levit", paper=_PAPER, crop_pct=0.9, published_params_m=params,
                       published_gmacs=gmacs, published_top1=top1,
                       hf_hub_id=f"timm/{name}.fb_dist_in1k" if hub else None,
                       smoke_kwargs=dict(smoke or _SMOKE), extra=dict(fixed_input_size=True, **extra))


def _create(name: str, **kwargs) -> Levit:
    return Levit(**{**_CFGS[name], **kwargs})


@register_model(config=_cfg("levit_128s", 7.8, 0.305, 76.6))
def levit_128s(**kwargs) -> Levit:
    """LeViT-128S: C = 128/256/384, D = 16, N = 4/6/8 heads, depth 2/3/4."""
    return _create("levit_128s", **kwargs)


@register_model(config=_cfg("levit_128", 9.2, 0.406, 78.6))
def levit_128(**kwargs) -> Levit:
    """LeViT-128: C = 128/256/384, D = 16, N = 4/8/12 heads, depth 4/4/4."""
    return _create("levit_128", **kwargs)


@register_model(config=_cfg("levit_192", 11.0, 0.658, 80.0))
def levit_192(**kwargs) -> Levit:
    """LeViT-192: C = 192/288/384, D = 32, N = 3/5/6 heads, depth 4/4/4."""
    return _create("levit_192", **kwargs)


@register_model(config=_cfg("levit_256", 19.0, 1.120, 81.6))
def levit_256(**kwargs) -> Levit:
    """LeViT-256: C = 256/384/512, D = 32, N = 4/6/8 heads, depth 4/4/4."""
    return _create("levit_256", **kwargs)


@register_model(config=_cfg("levit_384", 39.0, 2.353, 82.6))
def levit_384(**kwargs) -> Levit:
    """LeViT-384: C = 384/512/768, D = 32, N = 6/9/12 heads, depth 4/4/4."""
    return _create("levit_384", **kwargs)


@register_model(config=_cfg("levit_128s_ablation_a1", None, None, None, hub=False,
                            smoke={"img_size": 64, "depth": (2,)}, ablation="A1 of LeViT-128S (LeViT supplementary)",
                            target_gmacs=0.305))
def levit_128s_ablation_a1(**kwargs) -> Levit:
    """Ablation A1 of LeViT-128S (no pyramid): one 14x14 stage of 11 blocks, D = 19, N = 3, C = 114."""
    return _create("levit_128s_ablation_a1", **kwargs)


@register_model(config=_cfg("levit_128s_ablation_a6", None, None, None, hub=False,
                            ablation="A6 of LeViT-128S (LeViT supplementary)", target_gmacs=0.305))
def levit_128s_ablation_a6(**kwargs) -> Levit:
    """Ablation A6 of LeViT-128S (no wider blocks): D = 30 for Q, K, V, C = 120/180/240, MLP ratio 4,
    shrinking attentions with 16 and 24 heads."""
    return _create("levit_128s_ablation_a6", **kwargs)
