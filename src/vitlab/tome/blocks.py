"""The pieces of a plain-ViT block that token reduction needs, for every block the patches support (vitlab's
:class:`~vitlab.attention.Block` with ``msa``, HaLViT's block, CaiT's self-attention block), read from the
modules as they are -- nothing here changes a model. Shared by :mod:`vitlab.tome` and :mod:`vitlab.prune`.

- :func:`project`: an attention's queries, keys and values (B, h, N, d), and :func:`output`, its output projection
  of the heads' result; so a patch runs the same attention with an additive mask through
  ``scaled_dot_product_attention`` (fused kernels keep running) or with its own softmax.
- :func:`attention_input`, :func:`add_attention`, :func:`add_mlp`: the block's residual branches around them.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from vitlab.attention import Block, MultiHeadSelfAttention
from vitlab.models.cait import LayerScaleBlock, TalkingHeadAttn
from vitlab.models.halvit import HaLViTAttention, HaLViTBlock

BLOCK_TYPES = (Block, HaLViTBlock, LayerScaleBlock)


def check_block(blk: nn.Module, i: int, what: str) -> None:
    """ValueError unless block ``i`` is one the token-reduction patches know, with softmax attention."""
    if not isinstance(blk, BLOCK_TYPES):
        raise ValueError(f"{what} patches ViT / DeiT / HaLViT / CaiT blocks; block {i} is a {type(blk).__name__}")
    if not isinstance(blk.attn, (MultiHeadSelfAttention, HaLViTAttention, TalkingHeadAttn)):
        raise ValueError(f"{what} needs softmax multi-head attention (msa, HaLViT's, CaiT's talking heads); "
                         f"block {i} uses {type(blk.attn).__name__}")


def attention_input(blk: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What the block feeds its attention (HaLViT's attention normalises its own input)."""
    return x if isinstance(blk, HaLViTBlock) else blk.norm1(x)


def add_attention(blk: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x`` plus the attention branch output ``y`` (LayerScale and drop path as the block does)."""
    if isinstance(blk, Block):
        return x + blk.drop_path1(blk.ls1(y))
    if isinstance(blk, HaLViTBlock):
        return x + blk.drop_path(y)
    return x + blk.drop_path(blk.gamma_1 * y)


def add_mlp(blk: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The block's second residual branch (MLP / feed-forward)."""
    if isinstance(blk, Block):
        return x + blk.drop_path2(blk.ls2(blk.mlp(blk.norm2(x))))
    if isinstance(blk, HaLViTBlock):
        return x + blk.drop_path(blk.ff(x))
    return x + blk.drop_path(blk.gamma_2 * blk.mlp(blk.norm2(x)))


def project(attn: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries, keys, values (B, h, N, d) of MSA or HaLViT attention, exactly as their forward makes them."""
    B, N, _ = x.shape
    if isinstance(attn, HaLViTAttention):
        w = torch.cat([attn.q, attn.kv, attn.kv.t()], dim=1)
        q, k, v = F.linear(attn.inpnorm(x), w.t()).split(attn.inner_dim, dim=-1)
        q, k = attn.qnorm(q), attn.knorm(k)
        return tuple(t.view(B, N, attn.heads, attn.dim_head).transpose(1, 2) for t in (q, k, v))
    qkv = attn.qkv(x).reshape(B, N, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)
    return attn.q_norm(q), attn.k_norm(k), v


def output(attn: nn.Module, o: torch.Tensor) -> torch.Tensor:
    """The heads' result (B, h, N, d) -> the attention's output (B, N, C)."""
    B, _, N, _ = o.shape
    o = o.transpose(1, 2).reshape(B, N, -1)
    if isinstance(attn, HaLViTAttention):
        return F.linear(o, attn.q, attn.bias)
    return attn.proj_drop(attn.proj(o))


def attn_scale(attn: nn.Module) -> float:
    return attn.dim_head**-0.5 if isinstance(attn, HaLViTAttention) else attn.scale


def attn_dropout(attn: nn.Module) -> float:
    """The attention-weight dropout probability in force (0 in eval)."""
    p = attn.attn_drop.p if isinstance(attn.attn_drop, nn.Dropout) else attn.attn_drop
    return p if attn.training else 0.0


def sdpa(attn: nn.Module, x: torch.Tensor, mask: torch.Tensor | None = None):
    """The attention of ``x`` with an optional additive ``mask`` (broadcast to (B, h, N, N)) through fused SDPA:
    (output (B, N, C), queries, keys), the latter (B, h, N, d)."""
    if isinstance(attn, TalkingHeadAttn):
        return talking_heads(attn, x, mask)
    q, k, v = project(attn, x)
    mask = None if mask is None else mask.to(q.dtype)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=attn_dropout(attn))
    return output(attn, o), q, k


def talking_heads(attn: TalkingHeadAttn, x: torch.Tensor, mask: torch.Tensor | None):
    """CaiT's talking-heads attention with an additive ``mask`` on the mixed logits, just before the softmax
    (where a key duplicated s times would weigh s times). Without a mask it runs as the module would (folded on
    CUDA); with one, the direct form. Returns (output, queries, keys) like :func:`sdpa`."""
    B, N, C = x.shape
    qkv = attn.qkv(x).view(B, N, 3, attn.num_heads, attn.head_dim)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # (B, h, N, d) each
    if mask is None and attn._use_folded(x):
        out = attn.forward_folded(qkv)
    else:
        logits = attn._mix_heads((q * attn.scale) @ k.transpose(-2, -1), attn.proj_l)
        if mask is not None:
            logits = logits + mask.to(logits.dtype)
        w = attn.attn_drop(attn._mix_heads(logits.softmax(dim=-1), attn.proj_w))
        out = (w @ v).transpose(1, 2).reshape(B, N, C)
    return attn.proj_drop(attn.proj(out)), q, k
