"""CaiT (Touvron et al., 2021, "Going deeper with Image Transformers", ICCV 2021).

Two changes make deep ViTs train, and a third separates the two jobs of the class token:

- **LayerScale**: every residual branch is multiplied by a learned per-channel vector ``gamma`` initialised
  small (1e-5 for the 24-block models), ``x + gamma * F(Norm(x))``, so each block starts near the identity.
- **Talking-heads attention** (Shazeer et al., 2020) in the self-attention blocks: the attention logits are
  mixed across heads by a learned h x h linear map before the softmax (``proj_l``) and the weights again
  after it (``proj_w``): ``A = W_w softmax(W_l (Q K^T / sqrt(d)))``, ``out = A V``. Heads are mixed on both
  sides of the softmax, so the direct form materialises the (B, h, N, N) map several times. On the GPU the
  same function runs as one fused SDPA call over h "folded" heads of width C = h d (see
  ``TalkingHeadAttn.forward_folded``): 4x the attention MACs, but no N x N map in memory.
- **Class attention**: the patch tokens go through the self-attention blocks *without* a class token; only
  the last two blocks (``blocks_token_only``) add it, and there only the class token is updated: its query
  attends to the keys/values of ``[cls, patches]`` (a 1-query attention, run with fused SDPA), then an MLP
  on the class token alone. The patch tokens are frozen through these blocks.

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
from vitlab.models._base import TimmApiMixin
from vitlab.registry import ModelConfig, register_model

_PAPER = "Touvron et al., Going deeper with Image Transformers, ICCV 2021"
_POOL_TYPES = ("token", "avg", "")
_FOLD_MAX_WIDTH = 256  # widest head the fused (flash) attention kernels take


class TalkingHeadAttn(nn.Module):
    """Self-attention with talking heads: learned head mixing of the logits (``proj_l``) and of the softmax
    weights (``proj_w``). ``forward(x)``: (B, N, C) -> (B, N, C).

    ``folded``: None (default) runs the folded form (``forward_folded``) on CUDA tensors when its head width
    C = h d is at most 256 (the flash kernels' limit: XXS24's 192, not XS24's 288 or S24's 384, which would
    fall back to a kernel that builds the maps anyway) and the direct form elsewhere; True / False force one.
    Attention dropout during training needs the direct form (it drops entries of the mixed map, which the
    folded form never builds)."""

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = True, attn_drop: float = 0.0,
                 proj_drop: float = 0.0, folded: bool | None = None):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = check_heads(dim, num_heads)
        self.scale = self.head_dim**-0.5
        self.folded = folded
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

    def _use_folded(self, x: torch.Tensor) -> bool:
        if self.training and self.attn_drop.p > 0:
            return False
        if self.folded is None:
            return x.is_cuda and self.num_heads * self.head_dim <= _FOLD_MAX_WIDTH
        return self.folded

    def forward(self, x: torch.Tensor, hw: tuple[int, int] | None = None) -> torch.Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).view(B, N, 3, self.num_heads, self.head_dim)
        if self._use_folded(x):
            x = self.forward_folded(qkv)
        else:
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # (B, h, N, d) each
            attn = (q * self.scale) @ k.transpose(-2, -1)  # (B, h, N, N) logits
            attn = self._mix_heads(attn, self.proj_l).softmax(dim=-1)
            attn = self.attn_drop(self._mix_heads(attn, self.proj_w))
            x = (attn @ v).transpose(1, 2).reshape(B, N, C)  # (B, N, C)
        return self.proj_drop(self.proj(x))

    def forward_folded(self, qkv: torch.Tensor) -> torch.Tensor:
        """The same attention without the N x N map: (B, N, 3, h, d) projections -> (B, N, C) head outputs.

        Pre-softmax mixing is linear in q, so logit map g is one dot product of width C = h d:
        ``sum_h W_l[g, h] s q_h k_h^T = [W_l[g, 0] s q_0, ..., W_l[g, h-1] s q_{h-1}] [k_0, ..., k_{h-1}]^T``;
        the bias ``b_l[g]`` is constant along each row, which the softmax ignores. With A_g = softmax(that),
        post-softmax mixing gives head j's output ``sum_g W_w[j, g] A_g v_j + b_w[j] sum_n v_j[n]``, and
        A_g v_j for every j is block j of ``A_g [v_0, ..., v_{h-1}]``. So one SDPA call with h query heads
        of width C against a single shared key/value head of width C yields every A_g v_j."""
        B, N, _, h, d = qkv.shape
        q, k, v = qkv.unbind(2)  # (B, N, h, d) each
        w_l = self.proj_l.weight.to(q.dtype) * self.scale  # (g, h)
        q_fold = torch.einsum("gh,bnhd->bgnhd", w_l, q).reshape(B, h, N, h * d)  # (B, g, N, C)
        kv = qkv[:, :, 1:].reshape(B, 1, N, 2, h * d)  # (B, 1, N, 2, C): keys and values, all heads side by side
        k_all = kv[..., 0, :].expand(B, h, N, h * d)  # shared by every folded head (a view)
        v_all = kv[..., 1, :].expand(B, h, N, h * d)
        o = F.scaled_dot_product_attention(q_fold, k_all, v_all, scale=1.0)  # (B, g, N, C): A_g [v_0 .. v_{h-1}]
        o = o.reshape(B, h, N, h, d)  # o[:, g, n, j] = (A_g v_j)[n]
        out = torch.einsum("jg,bgnjd->bnjd", self.proj_w.weight.to(o.dtype), o)  # (B, N, h, d)
        out = out + self.proj_w.bias.to(o.dtype)[:, None] * v.sum(1, keepdim=True)  # b_w[j] sum_n v_j[n]
        return out.reshape(B, N, h * d)


class ClassAttn(nn.Module):
    """Class attention: the class token's query over the keys/values of all tokens.
    ``forward(u)``: u (B, 1 + N, C) = [cls, patches] -> (B, 1, C), the class token's update."""

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

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        B, N, C = u.shape
        h, d = self.num_heads, self.head_dim
        q = self.q(u[:, :1]).view(B, 1, h, d).transpose(1, 2)  # (B, h, 1, d): one query per image
        k = self.k(u).view(B, N, h, d).transpose(1, 2)  # (B, h, N, d)
        v = self.v(u).view(B, N, h, d).transpose(1, 2)
        drop = self.attn_drop if self.training else 0.0
        x = F.scaled_dot_product_attention(q, k, v, dropout_p=drop)  # (B, h, 1, d)
        return self.proj_drop(self.proj(x.transpose(1, 2).reshape(B, 1, C)))


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

    def forward(self, x: torch.Tensor, hw: tuple[int, int] | None = None) -> torch.Tensor:  # (B, N, C)
        x = x + self.drop_path(self.gamma_1 * self.attn(self.norm1(x), hw))
        return x + self.drop_path(self.gamma_2 * self.mlp(self.norm2(x)))


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

    def forward(self, x: torch.Tensor, x_cls: torch.Tensor) -> torch.Tensor:
        """x (B, N, C) patch tokens, x_cls (B, 1, C) -> the updated class token (B, 1, C)."""
        u = torch.cat((x_cls, x), dim=1)  # (B, 1 + N, C)
        x_cls = x_cls + self.drop_path(self.gamma_1 * self.attn(self.norm1(u)))
        return x_cls + self.drop_path(self.gamma_2 * self.mlp(self.norm2(x_cls)))


class Cait(TimmApiMixin, nn.Module):
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

    # ---- forward ---------------------------------------------------------------------------------------
    def _embed(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        """Images -> (B, H*W, C) patch tokens with position embeddings (resampled for another grid when
        ``dynamic_img_size``), and the grid (H, W)."""
        hw = self.patch_embed.dynamic_feat_size(x.shape[-2:])
        x = self.patch_embed(x)
        pos = self.pos_embed
        if self.dynamic_img_size and not same_size(hw, self.patch_embed.grid_size):
            pos = resample_abs_pos_embed(pos, hw, self.patch_embed.grid_size, num_prefix_tokens=0)
        return self.pos_drop(x + pos), hw

    def shard_units(self) -> list[nn.Module]:
        return [*self.blocks, *self.blocks_token_only]

    def _run_blocks(self, blocks, x: torch.Tensor, hw) -> torch.Tensor:
        return checkpoint_seq(blocks, x, hw, enabled=self.grad_checkpointing)

    def forward_cls(self, x: torch.Tensor) -> torch.Tensor:
        """(B, N, C) patch tokens -> (B, 1 + N, C): the class token after the class-attention blocks, first."""
        # a (tiny) copy, not an expand() view: under no_grad a view of a parameter would still claim
        # requires_grad without a grad_fn, which module hooks (the FLOP counter of profile_model) reject
        x_cls = self.cls_token.repeat(x.shape[0], 1, 1)  # (B, 1, C)
        for blk in self.blocks_token_only:
            x_cls = blk(x, x_cls)
        return torch.cat((x_cls, x), dim=1)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x, hw = self._embed(x)
        return self.norm(self.forward_cls(self._run_blocks(self.blocks, x, hw)))

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
        x, (H, W) = self._embed(x)
        blocks = self.blocks[: last + 1]
        feats = []
        for i, blk in enumerate(blocks):
            x = self._run_blocks((blk,), x, (H, W))
            if i in take:
                feats.append(self.norm(x) if norm else x)
        if output_fmt == "NCHW":
            feats = [y.reshape(B, H, W, -1).permute(0, 3, 1, 2).contiguous() for y in feats]
        if intermediates_only:
            return feats
        if len(blocks) < len(self.blocks):
            return self.norm(x), feats
        return self.norm(self.forward_cls(x)), feats

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
