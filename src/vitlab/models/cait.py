"""CaiT (Touvron et al., 2021, "Going deeper with Image Transformers", ICCV 2021).

Two changes make deep ViTs train, and a third separates the two jobs of the class token:

- **LayerScale**: every residual branch is multiplied by a learned per-channel vector ``gamma`` initialised
  small (1e-5 for the 24-block models), ``x + gamma * F(Norm(x))``, so each block starts near the identity.
- **Talking-heads attention** (Shazeer et al., 2020) in the self-attention blocks: the attention logits are
  mixed across heads by a learned h x h linear map before the softmax (``proj_l``) and the weights again
  after it (``proj_w``): ``A = W_w softmax(W_l (Q K^T / sqrt(d)))``, ``out = A V``. Heads are mixed on both
  sides of the softmax, so this direct form materialises the (B, h, N, N) map several times; the model runs it
  on every device. :mod:`vitlab.optimize.cait` holds the same function as one fused SDPA call over h "folded"
  heads of width C = h d, an inference transform (4x the attention MACs, but no N x N map in memory).
- **Class attention**: the patch tokens go through the self-attention blocks *without* a class token; only
  the last two blocks (``blocks_token_only``) add it, and there only the class token is updated: its query
  attends to the keys/values of ``[cls, patches]`` (a 1-query attention, run with fused SDPA), then an MLP
  on the class token alone. The patch tokens are frozen through these blocks.

The model implements the token interface of :class:`vitlab.models.TokenModel`: ``embed`` gives the patch tokens
the self-attention blocks take, ``finish_tokens`` runs the class-attention stage and the final norm.

Module and parameter names follow timm's ``Cait`` (``gamma_1``/``gamma_2`` are the LayerScale vectors), so
timm state dicts load as they are.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from vitlab.attention import create_attention, layout_kwargs
from vitlab.layers import (
    DropPath,
    Mlp,
    PatchEmbed,
    check_heads,
    check_pool,
    checkpoint_seq,
    get_norm_layer,
    init_linears_trunc_normal_,
    intermediates_plan,
    resample_abs_pos_embed,
    same_size,
)
from vitlab.models._base import TimmApiMixin, TokenModel, keep_patches, mask_patches
from vitlab.registry import ModelConfig, register_model

_PAPER = "Touvron et al., Going deeper with Image Transformers, ICCV 2021"
_POOL_TYPES = ("token", "avg", "")


class TalkingHeadAttn(nn.Module):
    """Self-attention with talking heads: learned head mixing of the logits (``proj_l``) and of the softmax
    weights (``proj_w``). ``forward(x)``: (B, N, C) -> (B, N, C), the direct form everywhere (for inference on a
    GPU, :func:`vitlab.optimize.cait.fold_talking_heads` swaps in the same function without the N x N maps).

    On request (the keywords of :mod:`vitlab.attention`): ``attn_mask``, an additive bias on the mixed logits
    just before the softmax (where a key duplicated s times would weigh s times: ToMe's proportional attention);
    ``return_attn``, the post-mix weights P (B, h, N, N) that multiply V (not distributions: row sums are
    ``sum_h W_w[g, h] + N b_w[g]``); ``return_qk``, the queries and keys (B, h, N, d) before any mixing."""

    has_attention_weights = True
    attention_kind = "talking_heads"

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = True, attn_drop: float = 0.0,
                 proj_drop: float = 0.0):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = check_heads(dim, num_heads)
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_l = nn.Linear(num_heads, num_heads)  # mixes the heads' logits (before the softmax)
        self.proj_w = nn.Linear(num_heads, num_heads)  # mixes the heads' weights (after the softmax)
        self.proj_drop = nn.Dropout(proj_drop)

    @staticmethod
    def _mix_heads(attn: torch.Tensor, lin: nn.Linear) -> torch.Tensor:
        """(B, h, N, N) -> (B, h, N, N), out[:, g] = sum_h W[g, h] attn[:, h] + b[g]: one (h x h) @ (h x N*N)
        matmul per image on the contiguous map, instead of permuting the map to heads-last and back."""
        B, h, N, M = attn.shape
        w = lin.weight.to(attn.dtype).expand(B, h, h)  # a broadcast view: no copy per image
        out = torch.baddbmm(lin.bias.to(attn.dtype)[None, :, None], w, attn.reshape(B, h, N * M))  # bias in the GEMM
        return out.view(B, h, N, M)

    def forward(self, x: torch.Tensor, hw: tuple[int, int] | None = None, attn_mask: torch.Tensor | None = None,
                return_attn: bool = False, return_qk: bool = False):
        B, N, C = x.shape
        qkv = self.qkv(x).view(B, N, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # (B, h, N, d) each
        logits = self._mix_heads((q * self.scale) @ k.transpose(-2, -1), self.proj_l)  # (B, h, N, N) mixed logits
        if attn_mask is not None:
            logits = logits + attn_mask.to(logits.dtype)
        attn = self._mix_heads(logits.softmax(dim=-1), self.proj_w)
        out = self.proj_drop(self.proj((self.attn_drop(attn) @ v).transpose(1, 2).reshape(B, N, C)))
        extras = ((attn,) if return_attn else ()) + ((q, k) if return_qk else ())
        return (out, *extras) if extras else out


class ClassAttn(nn.Module):
    """Class attention: the class token's query over the keys/values of all tokens.
    ``forward(u)``: u (B, 1 + N, C) = [cls, patches] -> (B, 1, C), the class token's update."""

    has_attention_weights = True
    attention_kind = "class_attention"

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = True, attn_drop: float = 0.0,
                 proj_drop: float = 0.0):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = check_heads(dim, num_heads)
        self.q = nn.Linear(dim, dim, bias=qkv_bias)
        self.k = nn.Linear(dim, dim, bias=qkv_bias)
        self.v = nn.Linear(dim, dim, bias=qkv_bias)
        self.attn_drop = attn_drop
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, u: torch.Tensor, attn_mask: torch.Tensor | None = None, return_attn: bool = False):
        """``attn_mask``: an additive bias (B, 1, 1, 1 + N) on the class token's logits; ``return_attn``: also
        its softmax weights (B, h, 1, 1 + N)."""
        B, N, C = u.shape
        h, d = self.num_heads, self.head_dim
        q = self.q(u[:, :1]).view(B, 1, h, d).transpose(1, 2)  # (B, h, 1, d): one query per image
        k = self.k(u).view(B, N, h, d).transpose(1, 2)  # (B, h, N, d)
        v = self.v(u).view(B, N, h, d).transpose(1, 2)
        drop = self.attn_drop if self.training else 0.0
        mask = None if attn_mask is None else attn_mask.to(q.dtype)
        attn = None
        if return_attn:
            logits = (q * d**-0.5) @ k.transpose(-2, -1)  # (B, h, 1, N)
            attn = (logits if mask is None else logits + mask).softmax(dim=-1)
            x = F.dropout(attn, drop) @ v
        else:
            x = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=drop)  # (B, h, 1, d)
        x = self.proj_drop(self.proj(x.transpose(1, 2).reshape(B, 1, C)))
        return (x, attn) if return_attn else x


class LayerScaleBlock(nn.Module):
    """Self-attention block with LayerScale: ``x + gamma_1 * Attn(Norm(x))``, ``x + gamma_2 * MLP(Norm(x))``.
    ``attn_layer``: talking heads (default) or any mechanism of :mod:`vitlab.attention` (name or class), called
    as ``attn(x, hw)`` on the patch tokens of the H x W grid (no prefix token in these blocks)."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, qkv_bias: bool = True,
                 proj_drop: float = 0.0, attn_drop: float = 0.0, drop_path: float = 0.0,
                 act_layer: str | Callable = "gelu", norm_layer: str | Callable = "layernorm",
                 init_values: float = 1e-5, attn_layer: str | Callable = TalkingHeadAttn,
                 attn_kwargs: dict | None = None):
        super().__init__()
        norm = get_norm_layer(norm_layer)
        self.norm1 = norm(dim)
        self.attn = create_attention(attn_layer, dim, num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop,
                                     proj_drop=proj_drop, **(attn_kwargs or {}))
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = norm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=act_layer, drop=proj_drop)
        # LayerScale vectors as bare parameters, named as in the paper's code and timm
        self.gamma_1 = nn.Parameter(init_values * torch.ones(dim))
        self.gamma_2 = nn.Parameter(init_values * torch.ones(dim))

    def forward_attention(self, x: torch.Tensor, hw: tuple[int, int] | None = None, rope=None, **attn_kwargs):
        """``x + gamma_1 * Attn(Norm(x))``; ``attn_kwargs`` and the extras as
        :meth:`vitlab.attention.Block.forward_attention`."""
        out = self.attn(self.norm1(x), hw, **attn_kwargs)
        y, extras = (out[0], out[1:]) if isinstance(out, tuple) else (out, ())
        x = x + self.drop_path(self.gamma_1 * y)
        return (x, *extras) if extras else x

    def forward_mlp(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop_path(self.gamma_2 * self.mlp(self.norm2(x)))

    def forward(self, x: torch.Tensor, hw: tuple[int, int] | None = None) -> torch.Tensor:  # (B, N, C)
        return self.forward_mlp(self.forward_attention(x, hw))


class LayerScaleBlockClassAttn(nn.Module):
    """Class-attention block: updates only the class token, from [cls, patches]; the patches pass unchanged."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, qkv_bias: bool = True,
                 proj_drop: float = 0.0, attn_drop: float = 0.0, drop_path: float = 0.0,
                 act_layer: str | Callable = "gelu", norm_layer: str | Callable = "layernorm",
                 init_values: float = 1e-5):
        super().__init__()
        norm = get_norm_layer(norm_layer)
        self.norm1 = norm(dim)
        self.attn = ClassAttn(dim, num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop, proj_drop=proj_drop)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = norm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=act_layer, drop=proj_drop)
        self.gamma_1 = nn.Parameter(init_values * torch.ones(dim))
        self.gamma_2 = nn.Parameter(init_values * torch.ones(dim))

    def forward(self, x: torch.Tensor, x_cls: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, N, C) patch tokens, x_cls (B, 1, C) -> the updated class token (B, 1, C); ``attn_mask``: an
        additive bias on the class token's logits over [cls, patches]."""
        u = torch.cat((x_cls, x), dim=1)  # (B, 1 + N, C)
        y = self.attn(self.norm1(u)) if attn_mask is None else self.attn(self.norm1(u), attn_mask)
        x_cls = x_cls + self.drop_path(self.gamma_1 * y)
        return x_cls + self.drop_path(self.gamma_2 * self.mlp(self.norm2(x_cls)))


class Cait(TimmApiMixin, TokenModel, nn.Module):
    """CaiT: ``depth`` talking-heads self-attention blocks on the patches, then ``depth_token_only``
    class-attention blocks. ``forward_features`` returns the normed (B, 1 + N, C) tokens, class token first.

    ``attn_layer`` replaces talking heads in the self-attention blocks by any mechanism of
    :mod:`vitlab.attention` (name or class; ``attn_kwargs`` its options): those blocks see only the patch grid,
    so grid mechanisms (``hilo``, ``local_window``, ...) work too. The class-attention blocks keep class attention."""

    pool_types = _POOL_TYPES

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
        drop_rate: float = 0.0,
        pos_drop_rate: float = 0.0,
        proj_drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        init_values: float = 1e-5,
        depth_token_only: int = 2,
        mlp_ratio_token_only: float = 4.0,
        norm_layer: str | Callable = "layernorm",
        act_layer: str | Callable = "gelu",
        dynamic_img_size: bool = False,
        weight_init: str = "trunc_normal",
        attn_layer: str | Callable = TalkingHeadAttn,
        attn_kwargs: dict | None = None,
    ):
        super().__init__()
        check_pool(global_pool, _POOL_TYPES)
        check_heads(embed_dim, num_heads)
        self.num_classes = num_classes
        self.global_pool = global_pool
        self.num_features = self.embed_dim = embed_dim
        self.num_prefix_tokens = 1
        self.dynamic_img_size = dynamic_img_size
        self.grad_checkpointing = False
        norm = get_norm_layer(norm_layer)

        self.patch_embed = PatchEmbed(img_size=img_size, patch_size=patch_size, in_chans=in_chans,
                                      embed_dim=embed_dim, strict_img_size=not dynamic_img_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, self.patch_embed.num_patches, embed_dim))  # patches only
        self.pos_drop = nn.Dropout(pos_drop_rate)
        common = dict(dim=embed_dim, num_heads=num_heads, qkv_bias=qkv_bias, act_layer=act_layer,
                      norm_layer=norm_layer, init_values=init_values)
        # the paper's stochastic depth is uniform over the blocks (not the linear schedule of DeiT)
        attn_kwargs = layout_kwargs(attn_layer, num_prefix_tokens=0, grid_size=self.patch_embed.grid_size,
                                    attn_kwargs=attn_kwargs, model="CaiT")
        self.blocks = nn.Sequential(*[
            LayerScaleBlock(mlp_ratio=mlp_ratio, proj_drop=proj_drop_rate, attn_drop=attn_drop_rate,
                            drop_path=drop_path_rate, attn_layer=attn_layer, attn_kwargs=attn_kwargs, **common)
            for _ in range(depth)])
        reduction = max(self.patch_embed.patch_size)
        self.feature_info = [dict(num_chs=embed_dim, reduction=reduction, module=f"blocks.{i}")
                             for i in range(depth)]
        self.blocks_token_only = nn.ModuleList([
            LayerScaleBlockClassAttn(mlp_ratio=mlp_ratio_token_only, **common) for _ in range(depth_token_only)])
        self.norm = norm(embed_dim)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = self._make_head(num_classes)
        if weight_init == "trunc_normal":
            self._init_trunc_normal()
        elif weight_init != "none":
            raise ValueError(f"unknown weight_init {weight_init!r}; choose 'trunc_normal' or 'none'")

    def _init_trunc_normal(self) -> None:
        """The paper's init: truncated normal (std 0.02) for the position embedding, the class token and the
        linears, zero biases."""
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=0.02)
        init_linears_trunc_normal_(self)

    # ---- timm-style API -------------------------------------------------------------------------------
    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        return {"pos_embed", "cls_token"}

    def shard_units(self) -> list[nn.Module]:
        return [*self.blocks, *self.blocks_token_only]

    # ---- token interface (vitlab.models.TokenModel) -----------------------------------------------------
    num_block_prefix_tokens = 0  # the self-attention blocks see the patches only

    @property
    def final_norm(self) -> nn.Module:
        return self.norm

    def embed(self, x: torch.Tensor, mask: torch.Tensor | None = None, mask_token: torch.Tensor | None = None,
              keep: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple[int, int]]:
        """Images -> ((B, H*W, C) patch tokens with position embeddings (resampled for another grid when
        ``dynamic_img_size``), the grid (H, W)); ``mask`` / ``mask_token`` and ``keep`` as
        :meth:`vitlab.models.VisionTransformer.embed`."""
        hw = self.patch_embed.dynamic_feat_size(x.shape[-2:])
        x = mask_patches(self.patch_embed(x), mask, mask_token)
        pos = self.pos_embed
        if self.dynamic_img_size and not same_size(hw, self.patch_embed.grid_size):
            pos = resample_abs_pos_embed(pos, hw, self.patch_embed.grid_size, num_prefix_tokens=0)
        return self.pos_drop(keep_patches(x + pos, keep)), hw

    def forward_blocks(self, x: torch.Tensor, hw: tuple[int, int], blocks=None) -> torch.Tensor:
        """Patch tokens through the self-attention ``blocks`` (default: all), with gradient checkpointing."""
        return checkpoint_seq(self.blocks if blocks is None else blocks, x, hw, enabled=self.grad_checkpointing)

    def forward_cls(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, N, C) patch tokens -> (B, 1 + N, C): the class token after the class-attention blocks, first.
        ``attn_mask``: an additive bias (B, 1, 1, N) on the class token's logits of the patch keys (its own key
        gets none)."""
        if attn_mask is not None:
            attn_mask = F.pad(attn_mask, (1, 0))  # (B, 1, 1, 1 + N): keys [cls, patches]
        # a (tiny) copy, not an expand() view: under no_grad a view of a parameter would still claim
        # requires_grad without a grad_fn, which module hooks (the FLOP counter of profile_model) reject
        x_cls = self.cls_token.repeat(x.shape[0], 1, 1)  # (B, 1, C)
        for blk in self.blocks_token_only:
            x_cls = blk(x, x_cls) if attn_mask is None else blk(x, x_cls, attn_mask)
        return torch.cat((x_cls, x), dim=1)

    def finish_tokens(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The class-attention stage (``attn_mask``: a bias on the patch keys, as :meth:`forward_cls`), then the
        final norm."""
        return self.norm(self.forward_cls(x, attn_mask))

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        if self.global_pool == "token":
            x = x[:, 0]
        elif self.global_pool == "avg":
            x = x[:, self.num_prefix_tokens:].mean(dim=1)
        x = self.head_drop(x)
        return x if pre_logits else self.head(x)

    def forward_intermediates(self, x: torch.Tensor, indices: int | list[int] | None = None, norm: bool = False,
                              output_fmt: str = "NCHW", intermediates_only: bool = False,
                              stop_early: bool = False):
        """Patch tokens (stride 16) after the chosen self-attention blocks (an int n = the last n; None = all),
        as (B, C, H, W) or (B, H*W, C). Returns ``(final_features, intermediates)`` unless
        ``intermediates_only``; ``final_features`` equals :meth:`forward_features` (unless stopped early)."""
        take, last = intermediates_plan(len(self.blocks), indices, output_fmt, stop_early, intermediates_only)
        B = x.shape[0]
        x, (H, W) = self.embed(x)
        blocks = self.blocks[: last + 1]
        feats = []
        for i, blk in enumerate(blocks):
            x = self.forward_blocks(x, (H, W), (blk,))
            if i in take:
                feats.append(self.norm(x) if norm else x)
        if output_fmt == "NCHW":
            feats = [y.reshape(B, H, W, -1).permute(0, 3, 1, 2).contiguous() for y in feats]
        if intermediates_only:
            return feats
        if len(blocks) < len(self.blocks):
            return self.norm(x), feats
        return self.finish_tokens(x), feats

    @staticmethod
    def checkpoint_filter_fn(state_dict: dict, model: Cait) -> dict:
        """timm / original CaiT state dict -> ours: resample the position embedding to the model's grid."""
        out = {}
        for k, v in state_dict.items():
            if k == "pos_embed" and v.shape != model.pos_embed.shape:
                v = resample_abs_pos_embed(v, model.patch_embed.grid_size, num_prefix_tokens=0)
            out[k] = v
        return out


def _cfg(params: float, gmacs: float, top1: float | None, hub: str | None) -> ModelConfig:
    return ModelConfig(family="cait", paper=_PAPER, crop_pct=1.0, published_params_m=params,
                       published_gmacs=gmacs, published_top1=top1, hf_hub_id=hub, extra={"patch_size": 16},
                       # a 4x4 grid and two self-attention blocks; both class-attention blocks kept
                       smoke_kwargs=dict(img_size=64, depth=2))


def _create(config: dict, kwargs: dict) -> Cait:
    """The named ``config``; ``kwargs`` override any of it."""
    args = dict(patch_size=16, depth=24, init_values=1e-5, **config)
    args.update(kwargs)
    return Cait(**args)


@register_model(config=_cfg(11.96, 2.53, 77.6, "timm/cait_xxs24_224.fb_dist_in1k"))
def cait_xxs24_224(**kwargs) -> Cait:
    """CaiT-XXS24: width 192, 24 + 2 blocks, 4 heads."""
    return _create(dict(embed_dim=192, num_heads=4), kwargs)


@register_model(config=_cfg(26.67, 5.4, None, None))  # published weights are for 384 px only (cait_xs24_384)
def cait_xs24_224(**kwargs) -> Cait:
    """CaiT-XS24: width 288, 24 + 2 blocks, 6 heads."""
    return _create(dict(embed_dim=288, num_heads=6), kwargs)


@register_model(config=_cfg(46.92, 9.35, 82.7, "timm/cait_s24_224.fb_dist_in1k"))
def cait_s24_224(**kwargs) -> Cait:
    """CaiT-S24: width 384, 24 + 2 blocks, 8 heads."""
    return _create(dict(embed_dim=384, num_heads=8), kwargs)


__all__ = ["Cait", "ClassAttn", "LayerScaleBlock", "LayerScaleBlockClassAttn", "TalkingHeadAttn"]
