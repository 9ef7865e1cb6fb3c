"""HaLViT ("Half of the Weights are Enough", supplementary material): a ViT whose layers use one matrix twice.

- Feed-forward: ONE matrix W (dim x hidden): ``h = GELU(LN(x) W + b1)``, ``y = h W^T + b2``.
- Attention: ``q`` (dim x inner) gives the queries and, transposed, the output projection; ``kv`` gives the
  keys and, transposed, the values: ``[Q | K | V] = LN(x) [W_q | W_kv | W_kv^T]``, LayerNorm on Q and K,
  softmax attention, ``out = A V W_q^T + bias``. Concatenating ``W_kv^T`` beside ``W_q`` needs
  ``dim == heads * dim_head``.
- Patch embedding Rearrange -> LayerNorm -> Linear -> LayerNorm; learned position embedding and tokens drawn
  from N(0, 1); row-mode stochastic depth with a linear schedule; cls or mean pooling; optional DeiT
  distillation token. Initialisation as in the HaLViT code: Kaiming-uniform matrices, fan-in bounded biases.

Each shared matrix is a single Parameter used twice: one tensor in the state dict, and autograd sums the
gradients of both uses into it.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

from vitlab.attention import QKVAttention
from vitlab.layers import DropPath, LinearPatchEmbed, get_act_layer, get_norm_layer
from vitlab.models.vision_transformer import VisionTransformer
from vitlab.registry import ModelConfig, register_model


def _uniform_fan_in(bias: nn.Parameter, matrix: torch.Tensor) -> None:
    fan_in, _ = nn.init._calculate_fan_in_and_fan_out(matrix)
    bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
    nn.init.uniform_(bias, -bound, bound)


class HaLViTFeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, dropout: float = 0.0, act_layer="gelu", norm_layer=nn.LayerNorm):
        super().__init__()
        self.w = nn.Parameter(torch.empty(dim, hidden_dim))
        self.b1 = nn.Parameter(torch.empty(hidden_dim))
        self.b2 = nn.Parameter(torch.empty(dim))
        self.act = get_act_layer(act_layer)()
        self.dropout = nn.Dropout(dropout)
        self.ln1 = norm_layer(dim)
        nn.init.kaiming_uniform_(self.w)
        _uniform_fan_in(self.b1, self.w)
        _uniform_fan_in(self.b2, self.w.t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.dropout(self.act(F.linear(self.ln1(x), self.w.t(), self.b1)))  # x W + b1: (B, N, hidden)
        return self.dropout(F.linear(x, self.w, self.b2))  # x W^T + b2: (B, N, dim)


class HaLViTAttention(QKVAttention):
    """HaLViT's attention as a :class:`~vitlab.attention.QKVAttention` layout: ``forward`` (masks, weights,
    queries and keys on request) is the shared one."""

    def __init__(self, dim: int, heads: int, dim_head: int = 64, dropout: float = 0.0, norm_layer=nn.LayerNorm):
        super().__init__()
        inner = heads * dim_head
        if inner != dim:
            raise ValueError(f"HaLViT needs dim == heads * dim_head (kv^T doubles as the value matrix): "
                             f"got dim {dim}, {heads} heads x {dim_head}")
        self.num_heads, self.head_dim, self.inner_dim = heads, dim_head, inner
        self.heads, self.dim_head = heads, dim_head  # the HaLViT code's names
        self.scale = dim_head**-0.5
        self.q = nn.Parameter(torch.empty(dim, inner))
        self.kv = nn.Parameter(torch.empty(dim, inner))
        self.bias = nn.Parameter(torch.empty(dim))
        self.inpnorm = norm_layer(dim)
        self.qnorm = norm_layer(inner)
        self.knorm = norm_layer(inner)
        self.attn_drop = dropout
        nn.init.kaiming_uniform_(self.q)
        nn.init.kaiming_uniform_(self.kv)
        _uniform_fan_in(self.bias, self.q.t())

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, N, _ = x.shape
        w = torch.cat([self.q, self.kv, self.kv.t()], dim=1)  # (dim, 3*inner): one matmul for Q, K, V
        q, k, v = F.linear(self.inpnorm(x), w.t()).split(self.inner_dim, dim=-1)  # (B, N, inner) each
        q, k = self.qnorm(q), self.knorm(k)
        return tuple(t.view(B, N, self.num_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))  # (B, h, N, d)

    def project_out(self, o: torch.Tensor) -> torch.Tensor:
        B, _, N, _ = o.shape
        return F.linear(o.transpose(1, 2).reshape(B, N, self.inner_dim), self.q, self.bias)  # o q^T + bias


class HaLViTBlock(nn.Module):
    """``x + SD(Attention(x))`` then ``x + SD(FF(x))``; each layer normalises its own input (as in HaLViT)."""

    def __init__(self, dim: int, num_heads: int, dim_head: int = 64, mlp_ratio: float = 4.0, proj_drop: float = 0.0,
                 attn_drop: float = 0.0, drop_path: float = 0.0, norm_layer="layernorm_eps5", act_layer="gelu"):
        super().__init__()
        norm = get_norm_layer(norm_layer)
        self.attn = HaLViTAttention(dim, num_heads, dim_head, dropout=attn_drop, norm_layer=norm)
        self.ff = HaLViTFeedForward(dim, int(dim * mlp_ratio), dropout=proj_drop, act_layer=act_layer,
                                    norm_layer=norm)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward_attention(self, x: torch.Tensor, hw=None, rope=None, **attn_kwargs):
        """``x + SD(Attention(x))``; ``attn_kwargs`` and the extras as
        :meth:`vitlab.attention.Block.forward_attention`."""
        out = self.attn(x, hw, rope, **attn_kwargs)
        y, extras = (out[0], out[1:]) if isinstance(out, tuple) else (out, ())
        x = x + self.drop_path(y)
        return (x, *extras) if extras else x

    def forward_mlp(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop_path(self.ff(x))

    def forward(self, x: torch.Tensor, hw=None) -> torch.Tensor:
        return self.forward_mlp(self.forward_attention(x, hw))


class HaLViT(VisionTransformer):
    def __init__(self, dim_head: int = 64, global_pool: str = "token", **kwargs):
        if global_pool not in ("token", "avg"):
            raise ValueError(f"HaLViT pools with the cls token ('token') or the mean ('avg'), got {global_pool!r}")
        super().__init__(
            embed_layer=partial(LinearPatchEmbed, pre_norm=True, norm_layer=nn.LayerNorm),
            block_fn=HaLViTBlock, block_kwargs=dict(dim_head=dim_head), norm_layer="layernorm_eps5",
            fc_norm=False, global_pool=global_pool, weight_init="none", **kwargs)
        for tok in (self.cls_token, self.dist_token, self.pos_embed):
            if isinstance(tok, nn.Parameter):
                nn.init.normal_(tok)  # HaLViT's torch.randn


_PAPER = "HaLViT: Half of the Weights are Enough (supplementary material)"


def _cfg(params: float | None = None) -> ModelConfig:
    return ModelConfig(family="halvit", paper=_PAPER, crop_pct=0.875, published_params_m=params,
                       extra={"patch_size": 16}, smoke_kwargs={"img_size": 32, "depth": 2})


@register_model(config=_cfg(11.1))
def halvit_tiny_patch16_224(**kwargs) -> HaLViT:
    """dim 384, 6 heads of 64, MLP 1536, depth 12: about half of DeiT-S."""
    return HaLViT(**{**dict(embed_dim=384, depth=12, num_heads=6, dim_head=64), **kwargs})


@register_model(config=_cfg(43.0))
def halvit_base_patch16_224(**kwargs) -> HaLViT:
    """dim 768, 12 heads of 64, MLP 3072, depth 12: about half of ViT-B."""
    return HaLViT(**{**dict(embed_dim=768, depth=12, num_heads=12, dim_head=64), **kwargs})


@register_model(config=_cfg())
def halvit_tiny_distilled_patch16_224(**kwargs) -> HaLViT:
    return HaLViT(**{**dict(embed_dim=384, depth=12, num_heads=6, dim_head=64, dist_token=True), **kwargs})


@register_model(config=_cfg())
def halvit_base_distilled_patch16_224(**kwargs) -> HaLViT:
    return HaLViT(**{**dict(embed_dim=768, depth=12, num_heads=12, dim_head=64, dist_token=True), **kwargs})
