"""Multi-head self-attention (Vaswani et al., 2017; ViT, Dosovitskiy et al., 2021), registered as ``msa``, and
:class:`QKVAttention`, the softmax attention every projection layout of the plain-ViT family shares.

One fused qkv projection, then ``torch.nn.functional.scaled_dot_product_attention`` (flash / memory-efficient
kernels where available). Options: qk-norm (Dehghani et al., 2023), a RoPE hook that rotates queries and keys
(Su et al., 2021), and masks for text: ``attn_mask`` (boolean, True = attend, or additive;
:func:`vitlab.layers.attention_mask`) and ``is_causal`` (a decoder's causal mask, SDPA's own flag).

What a caller may ask of the attention (the keywords every mechanism of :mod:`vitlab.attention` uses):

- ``return_attn=True``: the explicit softmax path, and the weights (B, heads, N, N) after the softmax (before
  attention dropout) beside the output;
- ``return_qk=True``: the queries and keys (B, heads, N, d) as the attention used them (after qk-norm and RoPE),
  e.g. for token merging's key similarity (Bolya et al., ICLR 2023, Sec. 3) or EViT's class attention;
- ``attn_mask``: a boolean or additive bias on the logits (an additive float mask is cast to the queries' dtype),
  e.g. ToMe's proportional attention ``log s`` (Bolya et al., Eq. 1);
- ``attn_policy`` (B, N, 1): DynamicViT's attention masking (Rao et al., NeurIPS 2021, Sec. 3.3, Eq. 6, the
  authors' ``softmax_with_policy``): the weights of keys whose policy is 0 are zeroed (each token still attends to
  itself) and the rest renormalised, differentiably in the policy (an additive ``log`` mask would have an
  infinite gradient at 0).

The output comes first; the extras follow in the order ``attn``, ``q``, ``k`` for those asked.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from vitlab.attention._registry import register_attention
from vitlab.layers.helpers import check_heads
from vitlab.layers.mask import causal_mask
from vitlab.layers.pos_embed import apply_rope


def softmax_with_policy(logits: torch.Tensor, policy: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """DynamicViT's masked softmax of (B, h, N, N) ``logits`` under a (B, N, 1) keep ``policy`` (1 keep, 0 drop):
    ``(exp(l - max) p' + eps / N) / (sum exp(l - max) p' + eps)`` with ``p'`` the policy on the keys and 1 on the
    diagonal, computed in fp32 and returned in the logits' dtype."""
    B, N, _ = policy.shape
    attn_policy = policy.reshape(B, 1, 1, N)
    eye = torch.eye(N, dtype=attn_policy.dtype, device=attn_policy.device).view(1, 1, N, N)
    attn_policy = attn_policy + (1.0 - attn_policy) * eye
    logits = logits - logits.max(dim=-1, keepdim=True)[0]
    w = logits.float().exp() * attn_policy.float()
    return ((w + eps / N) / (w.sum(dim=-1, keepdim=True) + eps)).to(logits.dtype)


class QKVAttention(nn.Module):
    """Softmax attention over (B, N, C) tokens given as a projection layout: a subclass sets ``num_heads``,
    ``head_dim``, ``scale`` and ``attn_drop`` (a probability) and implements :meth:`project_qkv` and
    :meth:`project_out`; ``forward`` is the same for all (see the module docstring for its keywords)."""

    has_attention_weights = True  # return_attn=True gives the (B, heads, N, N) softmax weights
    attention_kind = "global"  # every query attends to every key of the same tokens
    fused_attn: bool = True  # class-wide switch: False forces the explicit softmax path (e.g. for comparison)

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, N, C) tokens -> queries, keys, values (B, heads, N, d), queries and keys normalised if the layer
        does so."""
        raise NotImplementedError

    def project_out(self, o: torch.Tensor) -> torch.Tensor:
        """The heads' result (B, heads, N, d) -> the layer's output (B, N, C)."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor, hw: tuple[int, int] | None = None, rope=None, attn_mask=None,
                is_causal: bool = False, return_attn: bool = False, return_qk: bool = False,
                attn_policy: torch.Tensor | None = None):
        q, k, v = self.project_qkv(x)
        if rope is not None:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        drop = self.attn_drop if self.training else 0.0
        explicit = return_attn or attn_policy is not None or not self.fused_attn
        if is_causal and (attn_mask is not None or explicit):
            # SDPA takes a mask or the causal flag, not both; the explicit path needs the mask itself
            causal = causal_mask(x.shape[1], x.device)
            attn_mask, is_causal = (causal if attn_mask is None else attn_mask & causal), False
        if attn_mask is not None and attn_mask.dtype != torch.bool:
            attn_mask = attn_mask.to(q.dtype)
        attn = None
        if not explicit:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=drop, is_causal=is_causal)
        else:
            attn = (q * self.scale) @ k.transpose(-2, -1)  # (B, heads, N, N) logits
            if attn_mask is not None and attn_mask.dtype == torch.bool:
                attn = attn.masked_fill(~attn_mask, float("-inf"))
            elif attn_mask is not None:
                attn = attn + attn_mask
            attn = attn.softmax(dim=-1) if attn_policy is None else softmax_with_policy(attn, attn_policy)
            o = F.dropout(attn, drop) @ v
        out = self.project_out(o)
        extras = ((attn,) if return_attn else ()) + ((q, k) if return_qk else ())
        return (out, *extras) if extras else out


@register_attention("msa")
class MultiHeadSelfAttention(QKVAttention):
    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = True, qk_norm: bool = False,
                 attn_drop: float = 0.0, proj_drop: float = 0.0,
                 norm_layer: Callable[..., nn.Module] = nn.LayerNorm):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = check_heads(dim, num_heads)
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.q_norm = norm_layer(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = norm_layer(self.head_dim) if qk_norm else nn.Identity()
        self.attn_drop = attn_drop
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def extra_repr(self) -> str:  # the split into heads is no parameter's shape: shown, and compared by --init
        return f"num_heads={self.num_heads}"

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, N, _ = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # (B, heads, N, head_dim) each
        return self.q_norm(q), self.k_norm(k), v

    def project_out(self, o: torch.Tensor) -> torch.Tensor:
        B, _, N, _ = o.shape
        return self.proj_drop(self.proj(o.transpose(1, 2).reshape(B, N, -1)))


Attention = MultiHeadSelfAttention  # timm's name
