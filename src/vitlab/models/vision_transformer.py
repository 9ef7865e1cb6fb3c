"""Vision Transformer (Dosovitskiy et al., 2021, "An Image is Worth 16x16 Words"):
patch embedding -> [CLS] (+ distillation, register tokens) + position embedding ->
pre-norm blocks -> norm -> pooling -> linear head. The giant g/14 and G/14 configs are from Zhai et al., 2022,
"Scaling Vision Transformers".

:class:`VisionTransformer` is also the trunk of DeiT (``deit.py``: distillation token) and HaLViT
(``halvit.py``: its own patch embedding and blocks). Module names follow timm, so timm state dicts load as
they are. It implements the token interface of :class:`vitlab.models.TokenModel` (``embed``, ``blocks``,
``forward_blocks``, ``finish_tokens``, ``final_norm``, ``pool``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from vitlab.attention import Block, layout_kwargs
from vitlab.layers import (
    AttentionPool,
    PatchEmbed,
    RotaryEmbedding2D,
    check_heads,
    check_pool_type,
    checkpoint_seq,
    create_classifier,
    drop_path_schedule,
    feature_take_indices,
    get_embed_layer,
    get_norm_layer,
    init_linears_trunc_normal_,
    intermediates_plan,
    pool_tokens,
    resample_abs_pos_embed,
    same_size,
    sincos_2d_pos_embed,
)
from vitlab.models._base import TimmApiMixin, TokenModel, keep_patches, mask_patches
from vitlab.registry import INCEPTION_MEAN, INCEPTION_STD, ModelConfig, register_model

POS_EMBED_TYPES = ("learn", "sincos", "rope", "none")


class VisionTransformer(TimmApiMixin, TokenModel, nn.Module):
    """ViT. ``attn_layer`` takes any mechanism of :mod:`vitlab.attention` by name or class (default ``'msa'``,
    timm's attention); ``attn_kwargs`` are its options. A grid mechanism (``hilo``, ``local_window``, ...) needs
    a model without prefix tokens (``class_token=False, global_pool='avg'``): with them it is refused with a
    ValueError when the model is built. ``embed_layer`` is a patch-embedding class or its name in
    :data:`vitlab.layers.EMBED_LAYERS` (``'patch'``, ``'linear'``, ``'conv_stem'``: Xiao et al., 2021)."""

    def __init__(
        self,
        img_size=224,
        patch_size=16,
        in_chans: int = 3,
        num_classes: int = 1000,
        global_pool: str = "token",
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        qk_norm: bool = False,
        init_values: float | None = None,
        class_token: bool = True,
        dist_token: bool = False,
        reg_tokens: int = 0,
        pos_embed: str = "learn",
        no_embed_class: bool = False,
        fc_norm: bool | None = None,
        dynamic_img_size: bool = False,
        dynamic_img_pad: bool = False,
        drop_rate: float = 0.0,
        pos_drop_rate: float = 0.0,
        proj_drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        norm_layer: str | Callable = "layernorm",
        act_layer: str | Callable = "gelu",
        mlp_layer: str | Callable = "mlp",
        attn_layer: str | Callable = "msa",
        attn_kwargs: dict | None = None,
        embed_layer: str | Callable[..., nn.Module] = PatchEmbed,
        block_fn: Callable[..., nn.Module] = Block,
        block_kwargs: dict | None = None,
        weight_init: str = "trunc_normal",
    ):
        super().__init__()
        check_heads(embed_dim, num_heads)
        if pos_embed not in POS_EMBED_TYPES:
            raise ValueError(f"unknown pos_embed {pos_embed!r}; choose from {list(POS_EMBED_TYPES)}")
        if dist_token and not class_token:
            raise ValueError("a distillation token needs a class token")
        self.global_pool = check_pool_type(global_pool, class_token)
        self.num_classes = num_classes
        self.num_features = self.embed_dim = embed_dim
        self.num_prefix_tokens = int(class_token) + int(dist_token) + reg_tokens
        self.num_reg_tokens = reg_tokens
        self.has_class_token = class_token
        self.distilled = dist_token
        self.distilled_training = True  # in train mode a distilled model returns (cls_logits, dist_logits)
        self.no_embed_class = no_embed_class
        self.dynamic_img_size = dynamic_img_size
        self.pos_embed_type = pos_embed
        self.grad_checkpointing = False
        norm = get_norm_layer(norm_layer)

        self.patch_embed = get_embed_layer(embed_layer)(
            img_size=img_size, patch_size=patch_size, in_chans=in_chans, embed_dim=embed_dim,
            strict_img_size=not dynamic_img_size, dynamic_img_pad=dynamic_img_pad)
        grid = self.patch_embed.grid_size
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if class_token else None
        self.dist_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if dist_token else None
        self.reg_token = nn.Parameter(torch.zeros(1, reg_tokens, embed_dim)) if reg_tokens else None
        embed_len = grid[0] * grid[1] + (0 if no_embed_class else self.num_prefix_tokens)
        if pos_embed == "learn":
            self.pos_embed = nn.Parameter(torch.zeros(1, embed_len, embed_dim))
        elif pos_embed == "sincos":
            table = sincos_2d_pos_embed(grid, embed_dim)[None]
            if not no_embed_class:  # prefix tokens get a zero (i.e. no) position embedding
                table = torch.cat([table.new_zeros(1, self.num_prefix_tokens, embed_dim), table], dim=1)
            self.register_buffer("pos_embed", table, persistent=False)
        else:
            self.pos_embed = None
        self.rope = RotaryEmbedding2D(embed_dim // num_heads) if pos_embed == "rope" else None
        self.pos_drop = nn.Dropout(pos_drop_rate)

        common = dict(dim=embed_dim, num_heads=num_heads, mlp_ratio=mlp_ratio, proj_drop=proj_drop_rate,
                      attn_drop=attn_drop_rate, norm_layer=norm_layer, act_layer=act_layer)
        if block_fn is Block:
            # any zoo mechanism that works on this token layout (a grid mechanism needs no prefix tokens)
            attn_kwargs = layout_kwargs(attn_layer, num_prefix_tokens=self.num_prefix_tokens, grid_size=grid,
                                        attn_kwargs=attn_kwargs, rope=pos_embed == "rope", model="this ViT")
            common.update(qkv_bias=qkv_bias, qk_norm=qk_norm, init_values=init_values, mlp_layer=mlp_layer,
                          attn_layer=attn_layer, attn_kwargs=attn_kwargs)
        common.update(block_kwargs or {})
        self.blocks = nn.ModuleList(
            [block_fn(drop_path=p, **common) for p in drop_path_schedule(drop_path_rate, depth)])

        use_fc_norm = global_pool in ("avg", "max", "attn") if fc_norm is None else fc_norm
        self.norm = norm(embed_dim) if not use_fc_norm else nn.Identity()
        self.attn_pool = AttentionPool(embed_dim) if global_pool == "attn" else None
        self.fc_norm = norm(embed_dim) if use_fc_norm else nn.Identity()
        self.head_drop = nn.Dropout(drop_rate)
        self.head = create_classifier(embed_dim, num_classes)
        self.head_dist = create_classifier(embed_dim, num_classes) if dist_token else None
        if weight_init == "trunc_normal":
            self._init_trunc_normal()
        elif weight_init != "none":
            raise ValueError(f"unknown weight_init {weight_init!r}; choose 'trunc_normal' or 'none'")

    def _init_trunc_normal(self) -> None:
        """ViT/DeiT init: truncated normal (std 0.02) for linears and learned position embeddings, zero biases,
        tiny normal for the prefix tokens (timm's ``init_weights_vit_timm``)."""
        if isinstance(self.pos_embed, nn.Parameter):
            nn.init.trunc_normal_(self.pos_embed, std=0.02)
        for tok in (self.cls_token, self.reg_token):
            if tok is not None:
                nn.init.normal_(tok, std=1e-6)
        if self.dist_token is not None:
            nn.init.trunc_normal_(self.dist_token, std=0.02)
        init_linears_trunc_normal_(self)

    # ---- timm-style API -------------------------------------------------------------------------------
    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        return {"pos_embed", "cls_token", "dist_token", "reg_token"}

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        self.num_classes = num_classes
        if global_pool is not None:
            self.global_pool = check_pool_type(global_pool, self.has_class_token)
            if global_pool == "attn" and self.attn_pool is None:
                self.attn_pool = AttentionPool(self.embed_dim)
        device = self.patch_embed.proj.weight.device
        self.head = create_classifier(self.embed_dim, num_classes, device)
        if self.head_dist is not None:
            self.head_dist = create_classifier(self.embed_dim, num_classes, device)

    def shard_units(self) -> list[nn.Module]:
        return list(self.blocks)

    # ---- token interface (vitlab.models.TokenModel) -----------------------------------------------------
    @property
    def num_block_prefix_tokens(self) -> int:
        """Tokens before the patch grid in the sequence the blocks see: class, distillation, registers."""
        return self.num_prefix_tokens

    @property
    def final_norm(self) -> nn.Module:
        """The per-token final norm (``norm``; a patch-pooling model keeps it as ``fc_norm``)."""
        return self.fc_norm if isinstance(self.norm, nn.Identity) else self.norm

    def embed(self, x: torch.Tensor, mask: torch.Tensor | None = None, mask_token: torch.Tensor | None = None,
              keep: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple[int, int]]:
        """Images (B, C, H, W) -> (tokens (B, prefix + N, C), grid (H', W')): patch embedding, the patches where
        ``mask`` (B, N) is True replaced by ``mask_token`` (before the position embedding), position embeddings,
        only the patches ``keep`` (B, K) if given (after their position embedding, MAE's visible set), the
        prefix tokens first, position dropout (CLIP's pre-norm where the tower has one)."""
        hw = self.patch_embed.dynamic_feat_size(x.shape[-2:])
        x = mask_patches(self.patch_embed(x), mask, mask_token)
        B, P = x.shape[0], self.num_prefix_tokens
        pos = self.pos_embed
        if pos is not None and self.dynamic_img_size and not same_size(hw, self.patch_embed.grid_size):
            if self.pos_embed_type == "sincos":
                pos = sincos_2d_pos_embed(hw, self.embed_dim)[None].to(x)
                if not self.no_embed_class:
                    pos = torch.cat([pos.new_zeros(1, P, self.embed_dim), pos], dim=1)
            else:
                pos = resample_abs_pos_embed(pos, hw, self.patch_embed.grid_size,
                                             num_prefix_tokens=0 if self.no_embed_class else P)
        prefix = [t for t in (self.cls_token, self.dist_token, self.reg_token) if t is not None]
        if pos is not None and keep is None and not self.no_embed_class:
            # timm's order of operations: the prefix tokens in front, then one add of the whole position table
            if prefix:
                x = torch.cat([t.expand(B, -1, -1) for t in prefix] + [x], dim=1)
            return self.pos_drop(x + pos), hw
        prefix_pos = None
        if pos is not None:
            if not self.no_embed_class:
                pos, prefix_pos = pos[:, P:], pos[:, :P]
            x = x + pos
        x = keep_patches(x, keep)
        if prefix:
            tok = torch.cat(prefix, dim=1) if len(prefix) > 1 else prefix[0]  # (1, P, C)
            if prefix_pos is not None:
                tok = tok + prefix_pos
            x = torch.cat([tok.expand(B, -1, -1), x], dim=1)
        return self.pos_drop(x), hw

    def forward_blocks(self, x: torch.Tensor, hw: tuple[int, int], blocks=None) -> torch.Tensor:
        """Tokens through ``blocks`` (default: all), with the model's RoPE and gradient checkpointing."""
        return self._run_blocks(self.blocks if blocks is None else blocks, x, hw, self._rope(x, hw))

    def finish_tokens(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The final norm. ``attn_mask`` (B, 1, 1, N), a bias on the tokens' keys wherever attention follows the
        blocks, is not used: nothing attends after a ViT's blocks."""
        return self.norm(x)

    def _run_blocks(self, blocks, x: torch.Tensor, hw, rope) -> torch.Tensor:
        args = (hw,) if rope is None else (hw, rope)
        return checkpoint_seq(blocks, x, *args, enabled=self.grad_checkpointing)

    def _rope(self, x: torch.Tensor, hw):
        return None if self.rope is None else self.rope(hw, device=x.device, dtype=x.dtype)

    def pool(self, x: torch.Tensor, size: torch.Tensor | None = None) -> torch.Tensor:
        """Pooled (B, C) of (B, N, C) tokens; ``size`` (B, N, 1): the patches each token stands for (token
        reduction), which weighs the average and attention pools."""
        if size is not None and size.shape[:2] != x.shape[:2]:
            raise ValueError(f"size {tuple(size.shape)} does not match the {tuple(x.shape[:2])} tokens")
        return pool_tokens(x, self.global_pool, self.num_prefix_tokens, self.attn_pool, size)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False):
        if self.head_dist is not None:
            x, x_dist = self.fc_norm(x[:, 0]), self.fc_norm(x[:, 1])
            if pre_logits:
                return (x + x_dist) / 2
            x, x_dist = self.head(self.head_drop(x)), self.head_dist(self.head_drop(x_dist))
            if self.distilled_training and self.training:
                return x, x_dist  # the trainer applies the class loss to one, the distillation loss to the other
            return (x + x_dist) / 2
        x = self.head_drop(self.fc_norm(self.pool(x)))
        return x if pre_logits else self.head(x)

    def forward_intermediates(self, x: torch.Tensor, indices: int | list[int] | None = None, norm: bool = False,
                              output_fmt: str = "NCHW", intermediates_only: bool = False,
                              return_prefix_tokens: bool = False, stop_early: bool = False):
        """Features after the chosen blocks (an int n = the last n blocks; None = all), as (B, C, H, W)
        or (B, N, C) patch tokens. Returns ``(final_features, intermediates)`` unless ``intermediates_only``;
        ``final_features`` equals :meth:`forward_features`."""
        take, last = intermediates_plan(len(self.blocks), indices, output_fmt, stop_early, intermediates_only)
        B = x.shape[0]
        x, hw = self.embed(x)
        rope = self._rope(x, hw)
        blocks = self.blocks[: last + 1]
        feats = []
        for i, blk in enumerate(blocks):
            x = self._run_blocks((blk,), x, hw, rope)
            if i in take:
                feats.append(self.norm(x) if norm else x)
        prefix = [y[:, : self.num_prefix_tokens] for y in feats]
        feats = [y[:, self.num_prefix_tokens :] for y in feats]
        if output_fmt == "NCHW":
            feats = [y.reshape(B, hw[0], hw[1], -1).permute(0, 3, 1, 2).contiguous() for y in feats]
        if return_prefix_tokens:
            feats = list(zip(feats, prefix, strict=True))
        if intermediates_only:
            return feats
        return self.norm(x), feats


def checkpoint_filter_fn(state_dict: dict, model: VisionTransformer) -> dict:
    """Adapt a timm / vitlab ViT state dict to ``model``: resample the position embedding to the model's grid."""
    out = {}
    for k, v in state_dict.items():
        if k == "pos_embed" and isinstance(model.pos_embed, nn.Parameter) and v.shape != model.pos_embed.shape:
            prefix = 0 if model.no_embed_class else model.num_prefix_tokens
            v = resample_abs_pos_embed(v, model.patch_embed.grid_size, num_prefix_tokens=prefix)
        out[k] = v
    return out


VisionTransformer.checkpoint_filter_fn = staticmethod(checkpoint_filter_fn)

_VIT_PAPER = "Dosovitskiy et al., An Image is Worth 16x16 Words, ICLR 2021"
_GIANT_PAPER = "Zhai et al., Scaling Vision Transformers, CVPR 2022"


def _vit_cfg(paper: str = _VIT_PAPER, patch: int = 16, smoke_depth: int | None = None, extra: dict | None = None,
             **kw) -> ModelConfig:
    smoke = {"img_size": 2 * patch, "depth": smoke_depth or 2}  # two blocks test what twelve would
    return ModelConfig(family="vit", paper=paper, mean=INCEPTION_MEAN, std=INCEPTION_STD, crop_pct=0.9,
                       extra={"patch_size": patch, **(extra or {})}, smoke_kwargs=smoke, **kw)


# (embed_dim, depth, num_heads, mlp_ratio) of the named widths
_SIZES = {
    "tiny": (192, 12, 3, 4.0),
    "small": (384, 12, 6, 4.0),
    "base": (768, 12, 12, 4.0),
    "large": (1024, 24, 16, 4.0),
    "huge": (1280, 32, 16, 4.0),
    "giant": (1408, 40, 16, 48 / 11),  # MLP 6144
    "gigantic": (1664, 48, 16, 64 / 13),  # MLP 8192
}


def build_vit(size: str, patch: int, **kwargs) -> VisionTransformer:
    """A ViT of a named width ('tiny' ... 'gigantic') and patch size; ``kwargs`` override anything."""
    dim, depth, heads, ratio = _SIZES[size]
    args = dict(patch_size=patch, embed_dim=dim, depth=depth, num_heads=heads, mlp_ratio=ratio)
    args.update(kwargs)
    return VisionTransformer(**args)


def _hub(tag: str) -> str:
    return f"timm/{tag}"


@register_model(config=_vit_cfg(published_params_m=5.72, published_gmacs=1.26,
                                hf_hub_id=_hub("vit_tiny_patch16_224.augreg_in21k_ft_in1k")))
def vit_tiny_patch16_224(**kwargs) -> VisionTransformer:
    """ViT-Ti/16 (width 192, depth 12, 3 heads)."""
    return build_vit("tiny", 16, **kwargs)


@register_model(config=_vit_cfg(published_params_m=22.05, published_gmacs=4.61,
                                hf_hub_id=_hub("vit_small_patch16_224.augreg_in21k_ft_in1k")))
def vit_small_patch16_224(**kwargs) -> VisionTransformer:
    """ViT-S/16 (width 384, depth 12, 6 heads)."""
    return build_vit("small", 16, **kwargs)


@register_model(config=_vit_cfg(patch=32, published_params_m=22.88, published_gmacs=1.15,
                                hf_hub_id=_hub("vit_small_patch32_224.augreg_in21k_ft_in1k")))
def vit_small_patch32_224(**kwargs) -> VisionTransformer:
    """ViT-S/32."""
    return build_vit("small", 32, **kwargs)


@register_model(config=_vit_cfg(published_params_m=86.57, published_gmacs=17.58,
                                hf_hub_id=_hub("vit_base_patch16_224.augreg2_in21k_ft_in1k")))
def vit_base_patch16_224(**kwargs) -> VisionTransformer:
    """ViT-B/16 (width 768, depth 12, 12 heads)."""
    return build_vit("base", 16, **kwargs)


@register_model(config=_vit_cfg(patch=32, published_params_m=88.22, published_gmacs=4.41,
                                hf_hub_id=_hub("vit_base_patch32_224.augreg2_in21k_ft_in1k")))
def vit_base_patch32_224(**kwargs) -> VisionTransformer:
    """ViT-B/32."""
    return build_vit("base", 32, **kwargs)


@register_model(config=_vit_cfg(smoke_depth=2, published_params_m=304.33, published_gmacs=61.6,
                                hf_hub_id=_hub("vit_large_patch16_224.augreg_in21k_ft_in1k")))
def vit_large_patch16_224(**kwargs) -> VisionTransformer:
    """ViT-L/16 (width 1024, depth 24, 16 heads)."""
    return build_vit("large", 16, **kwargs)


# timm's 630.76M is the head-less (in21k, num_classes=0) model
@register_model(config=_vit_cfg(patch=14, smoke_depth=2, published_params_m=630.76,
                                extra={"published_num_classes": 0}))
def vit_huge_patch14_224(**kwargs) -> VisionTransformer:
    """ViT-H/14 (width 1280, depth 32, 16 heads)."""
    return build_vit("huge", 14, **kwargs)


@register_model(config=_vit_cfg(patch=14, paper=_GIANT_PAPER, smoke_depth=2, published_params_m=1012.61))
def vit_giant_patch14_224(**kwargs) -> VisionTransformer:
    """ViT-g/14 (width 1408, depth 40, MLP 6144, 16 heads)."""
    return build_vit("giant", 14, **kwargs)


@register_model(config=_vit_cfg(patch=14, paper=_GIANT_PAPER, smoke_depth=2, published_params_m=1844.44))
def vit_gigantic_patch14_224(**kwargs) -> VisionTransformer:
    """ViT-G/14 (width 1664, depth 48, MLP 8192, 16 heads)."""
    return build_vit("gigantic", 14, **kwargs)


__all__ = ["VisionTransformer", "feature_take_indices", "checkpoint_filter_fn"]
