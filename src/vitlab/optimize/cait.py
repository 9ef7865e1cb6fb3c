"""CaiT's talking-heads attention without its N x N maps: an inference transform applied from outside the model
(Touvron et al., "Going deeper with Image Transformers", ICCV 2021, Sec. 2; talking heads: Shazeer et al., 2020).

The model computes the direct form, ``P = W_w softmax(W_l (s Q K^T))``, ``out = P V``, which materialises the
(B, h, N, N) map several times. :func:`fold_talking_heads` swaps each :class:`~vitlab.models.cait.TalkingHeadAttn`
for :class:`FoldedTalkingHeadAttn`, the same function as one fused ``scaled_dot_product_attention`` call over h
"folded" heads of width C = h d:

- pre-softmax mixing is linear in q, so logit map g is one dot product of width C:
  ``sum_h W_l[g, h] s q_h k_h^T = [W_l[g, 0] s q_0, ..., W_l[g, h-1] s q_{h-1}] [k_0, ..., k_{h-1}]^T``; the bias
  ``b_l[g]`` is constant along each row, which the softmax ignores;
- with A_g = softmax(that), post-softmax mixing gives head j's output
  ``sum_g W_w[j, g] A_g v_j + b_w[j] sum_n v_j[n]``, and A_g v_j for every j is block j of
  ``A_g [v_0, ..., v_{h-1}]``.

So h query heads of width C against one shared key / value head of width C yield every A_g v_j: 4x the
attention MACs, but no N x N map in memory. It pays where a fused kernel takes width C (CUDA's flash kernels take
at most 256: CaiT-XXS24's 192, not XS24's 288 or S24's 384, which would fall back to a kernel that builds the
maps anyway), so :func:`fold_talking_heads` folds only modules that narrow, and :func:`vitlab.optimize` keeps it
only where it measures faster. A call that asks for what only the direct form has (an attention mask, the
weights, the queries and keys, attention dropout in training) runs the direct form.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from vitlab.models.cait import TalkingHeadAttn

__all__ = ["FOLD_MAX_WIDTH", "FoldedTalkingHeadAttn", "fold_talking_heads", "unfold_talking_heads"]

FOLD_MAX_WIDTH = 256  # widest head CUDA's fused (flash) attention kernels take


def folded_talking_heads(attn: TalkingHeadAttn, qkv: torch.Tensor) -> torch.Tensor:
    """The talking-heads attention of ``attn`` on its (B, N, 3, h, d) projections -> (B, N, C) head outputs,
    before the output projection (see the module docstring)."""
    B, N, _, h, d = qkv.shape
    q, k, v = qkv.unbind(2)  # (B, N, h, d) each
    w_l = attn.proj_l.weight.to(q.dtype) * attn.scale  # (g, h)
    q_fold = torch.einsum("gh,bnhd->bgnhd", w_l, q).reshape(B, h, N, h * d)  # (B, g, N, C)
    kv = qkv[:, :, 1:].reshape(B, 1, N, 2, h * d)  # (B, 1, N, 2, C): keys and values, all heads side by side
    k_all = kv[..., 0, :].expand(B, h, N, h * d)  # shared by every folded head (a view)
    v_all = kv[..., 1, :].expand(B, h, N, h * d)
    o = F.scaled_dot_product_attention(q_fold, k_all, v_all, scale=1.0)  # (B, g, N, C): A_g [v_0 .. v_{h-1}]
    o = o.reshape(B, h, N, h, d)  # o[:, g, n, j] = (A_g v_j)[n]
    out = torch.einsum("jg,bgnjd->bnjd", attn.proj_w.weight.to(o.dtype), o)  # (B, N, h, d)
    out = out + attn.proj_w.bias.to(o.dtype)[:, None] * v.sum(1, keepdim=True)  # b_w[j] sum_n v_j[n]
    return out.reshape(B, N, h * d)


class FoldedTalkingHeadAttn(TalkingHeadAttn):
    """:class:`~vitlab.models.cait.TalkingHeadAttn` computed in the folded form (see the module docstring); made
    by :func:`fold_talking_heads`, never built directly."""

    def forward(self, x: torch.Tensor, hw: tuple[int, int] | None = None, attn_mask: torch.Tensor | None = None,
                return_attn: bool = False, return_qk: bool = False):
        if attn_mask is not None or return_attn or return_qk or (self.training and self.attn_drop.p > 0):
            return super().forward(x, hw, attn_mask, return_attn, return_qk)  # what only the direct form has
        B, N, C = x.shape
        qkv = self.qkv(x).view(B, N, 3, self.num_heads, self.head_dim)
        return self.proj_drop(self.proj(folded_talking_heads(self, qkv)))


def fold_talking_heads(model: nn.Module, max_width: int = FOLD_MAX_WIDTH) -> int:
    """Swap every :class:`~vitlab.models.cait.TalkingHeadAttn` of ``model`` whose head width C = h d is at most
    ``max_width`` for :class:`FoldedTalkingHeadAttn`, in place (parameters, buffers, state-dict keys and hooks
    stay); returns how many changed. Only the exact class is swapped (a user's subclass is left alone)."""
    n = 0
    for m in model.modules():
        if type(m) is TalkingHeadAttn and m.num_heads * m.head_dim <= max_width:
            m.__class__ = FoldedTalkingHeadAttn
            n += 1
    return n


def unfold_talking_heads(model: nn.Module) -> int:
    """Undo :func:`fold_talking_heads`; returns how many modules changed."""
    n = 0
    for m in model.modules():
        if type(m) is FoldedTalkingHeadAttn:
            m.__class__ = TalkingHeadAttn
            n += 1
    return n
