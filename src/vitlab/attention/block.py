"""The pre-norm transformer block of ViT (Dosovitskiy et al., 2021): ``x + DropPath(LS(Attn(Norm(x))))`` then
``x + DropPath(LS(MLP(Norm(x))))``. Attention, MLP and norm are pluggable by name, so any mechanism of the
attention registry (``attn_layer='hilo'``, ...) and any MLP ('mlp', 'swiglu') drops into the same block.

``post_norm=True`` gives the original Transformer's block (Vaswani et al., 2017, Sec. 3.1:
``LayerNorm(x + Multihead(x))``): ``x = Norm(x + Attn(x))`` then ``x = Norm(x + MLP(x))``. ``attn_mask`` /
``is_causal`` reach the attention (``msa``) for text: causal and padding masks through SDPA.

The two residual steps are public (:meth:`Block.forward_attention`, :meth:`Block.forward_mlp`): token
reduction runs between them, and asks the attention for its keys or weights through ``forward_attention``."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from vitlab.attention._registry import create_attention
from vitlab.layers import DropPath, LayerScale, create_mlp, get_norm_layer


class Block(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, qkv_bias: bool = True,
                 qk_norm: bool = False, init_values: float | None = None, proj_drop: float = 0.0,
                 attn_drop: float = 0.0, drop_path: float = 0.0, act_layer: str | Callable = "gelu",
                 norm_layer: str | Callable = "layernorm", mlp_layer: str | Callable = "mlp",
                 attn_layer: str | Callable = "msa", attn_kwargs: dict | None = None, post_norm: bool = False):
        super().__init__()
        self.post_norm = post_norm
        norm = get_norm_layer(norm_layer)
        kw = dict(qkv_bias=qkv_bias, attn_drop=attn_drop, proj_drop=proj_drop)
        if qk_norm:
            kw.update(qk_norm=True, norm_layer=norm)
        kw.update(attn_kwargs or {})
        self.norm1 = norm(dim)
        self.attn = create_attention(attn_layer, dim, num_heads, **kw)
        self.ls1 = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.drop_path1 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = norm(dim)
        self.mlp = create_mlp(mlp_layer, dim, mlp_ratio, act_layer=act_layer, drop=proj_drop)
        self.ls2 = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.drop_path2 = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward_attention(self, x: torch.Tensor, hw: tuple[int, int] | None = None, rope=None, **attn_kwargs):
        """The first residual step, ``x + DropPath(LS(Attn(Norm(x))))`` (post-norm: ``Norm(x + ...)``).
        ``attn_kwargs`` go to the attention (``attn_mask``, ``return_attn``, ``return_qk``, ...); the extras it
        returns follow the new tokens: ``x`` or ``(x, *extras)``."""
        if rope is not None:
            attn_kwargs["rope"] = rope
        out = self.attn(x if self.post_norm else self.norm1(x), hw, **attn_kwargs)
        y, extras = (out[0], out[1:]) if isinstance(out, tuple) else (out, ())
        x = self.norm1(x + self.drop_path1(self.ls1(y))) if self.post_norm else x + self.drop_path1(self.ls1(y))
        return (x, *extras) if extras else x

    def forward_mlp(self, x: torch.Tensor) -> torch.Tensor:
        """The second residual step, ``x + DropPath(LS(MLP(Norm(x))))`` (post-norm: ``Norm(x + ...)``)."""
        if self.post_norm:
            return self.norm2(x + self.drop_path2(self.ls2(self.mlp(x))))
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))

    def forward(self, x: torch.Tensor, hw: tuple[int, int] | None = None, rope=None,
                attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
        # only mask-aware callers (text towers) pass masks, so every other mechanism keeps forward(x, hw)
        kw = {} if attn_mask is None and not is_causal else {"attn_mask": attn_mask, "is_causal": is_causal}
        return self.forward_mlp(self.forward_attention(x, hw, rope, **kw))
