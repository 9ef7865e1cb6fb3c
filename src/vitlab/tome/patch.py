"""``apply`` / ``remove``: Token Merging patched into a model from outside (Bolya et al., ICLR 2023, Sec. 3 and
the authors' timm patch), on ViT, DeiT (distilled too), HaLViT and CaiT's self-attention stage.

``apply`` swaps the classes of the model, its blocks (and CaiT's class-attention blocks) for subclasses whose
``forward`` merges tokens -- the weights, their names and the state dict are untouched, and ``remove`` swaps the
original classes back, so the model is again exactly what it was. In each block (Sec. 3, "Token Merging"):

- the attention runs with **proportional attention** when ``prop_attn``: ``softmax(q k^T / sqrt(d) + log s)``
  with ``s`` the number of patches each key stands for (Eq. 1), handed to
  ``scaled_dot_product_attention`` as an additive (B, 1, 1, N) mask so the fused kernels keep running;
- between the attention and the MLP, bipartite soft matching on the keys (mean over heads) merges ``r`` tokens
  (:mod:`vitlab.tome.merge`), size-weighted, and the sizes add up;
- the model's average (or attention) pool weights each token by its size, as the authors pool their MAE
  models, so the pooled vector stays the mean over the patches;
- with ``trace_source`` the (B, N', N0) source map (which input patches each token holds) is kept as
  ``model._tome.source`` after every forward (the paper's visualisation, :func:`vitlab.tome.merge_png`).

``forward_intermediates`` tracks the sources itself and un-merges every returned map back to the input grid
(each patch takes the value of the token it ended in), so dense heads keep their H x W maps.

The class / distillation / register tokens are protected (never merged, kept first). RoPE models and attention
mechanisms other than softmax MSA are refused (a merged token has no single position; other mechanisms expose
no keys to match on), as are hierarchical models (Swin, LeViT, ...), where merging is not defined.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from vitlab.layers import intermediates_plan, pool_tokens
from vitlab.models.cait import Cait, LayerScaleBlockClassAttn
from vitlab.models.vision_transformer import VisionTransformer
from vitlab.tome.blocks import add_attention, add_mlp, attention_input, check_block, sdpa
from vitlab.tome.merge import (
    bipartite_soft_matching,
    check_budget,
    merge_source,
    merge_wavg,
    parse_r,
    unmerge_tokens,
)


@dataclass
class ToMeInfo:
    """The patch's settings, shared by the model and its blocks (``model._tome``)."""

    r: list[int]  # merges per block (after parse_r)
    prop_attn: bool
    trace_source: bool
    protected: int  # leading tokens never merged
    source: torch.Tensor | None = field(default=None, repr=False)  # last forward's (B, N', N0), trace_source only
    size: torch.Tensor | None = field(default=None, repr=False)  # last forward's (B, N', 1) token sizes, for pooling


def _prop_mask(size: torch.Tensor | None, info: ToMeInfo) -> torch.Tensor | None:
    """Proportional attention's additive mask (B, 1, 1, N): log of each key's size (Eq. 1)."""
    if size is None or not info.prop_attn:
        return None
    return size.log()[:, None, None, :, 0]


class ToMeBlock:
    """Mixed in before a block class: ``forward(x, size, source, r) -> (x, size, source)``."""

    prefix = "ToMe"

    def forward(self, x: torch.Tensor, size: torch.Tensor | None = None, source: torch.Tensor | None = None,
                r: int = 0):
        info = self._tome
        y, _, k = sdpa(self.attn, attention_input(self, x), _prop_mask(size, info))
        x = add_attention(self, x, y)
        m = bipartite_soft_matching(k.mean(1), r, info.protected) if r > 0 else None
        if m is not None:
            if source is not None:
                source = merge_source(m, x, source)
            x, size = merge_wavg(m, x, size)
        return add_mlp(self, x), size, source


class ToMeClassAttnBlock:
    """CaiT's class-attention block, its class token attending the merged patches with proportional attention."""

    prefix = "ToMe"

    def forward(self, x: torch.Tensor, x_cls: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if mask is None:
            return super().forward(x, x_cls)
        u = self.norm1(torch.cat((x_cls, x), dim=1))
        a = self.attn
        B, N, C = u.shape
        q = a.q(u[:, :1]).view(B, 1, a.num_heads, a.head_dim).transpose(1, 2)
        k = a.k(u).view(B, N, a.num_heads, a.head_dim).transpose(1, 2)
        v = a.v(u).view(B, N, a.num_heads, a.head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype),
                                           dropout_p=a.attn_drop if a.training else 0.0)
        y = a.proj_drop(a.proj(o.transpose(1, 2).reshape(B, 1, C)))
        x_cls = x_cls + self.drop_path(self.gamma_1 * y)
        return x_cls + self.drop_path(self.gamma_2 * self.mlp(self.norm2(x_cls)))


def run_blocks(model: nn.Module, blocks, x: torch.Tensor, take: list[int] | None = None, norm=None):
    """The merging stage: ``x`` through ``blocks`` with the model's r schedule. Returns (x, sizes, maps): ``maps``
    are the outputs of the blocks in ``take`` (``norm`` applied if given), un-merged to the input's tokens."""
    info: ToMeInfo = model._tome
    check_budget(info.r, x.shape[1], info.protected)
    size, source = None, None
    if any(info.r[: len(blocks)]) and (info.trace_source or take):
        source = torch.eye(x.shape[1], device=x.device, dtype=x.dtype)[None].expand(x.shape[0], -1, -1)
    maps = []
    for i, blk in enumerate(blocks):
        if model.grad_checkpointing and torch.is_grad_enabled():
            x, size, source = checkpoint(blk, x, size, source, info.r[i], use_reentrant=False)
        else:
            x, size, source = blk(x, size, source, info.r[i])
        if take and i in take:
            y = norm(x) if norm is not None else x
            maps.append(y if source is None else unmerge_tokens(y, source))
    if info.trace_source:
        info.source = source
    info.size = size
    return x, size, maps


def sized_pool(model: nn.Module, x: torch.Tensor, size: torch.Tensor | None) -> torch.Tensor:
    """``model``'s pool of its reduced tokens ``x``, each weighted by its ``size`` (B, N, 1) from the last forward
    (the mean over the patches, as the authors pool MAE models): unweighted, a merged background token would
    count as much as one object patch."""
    if size is not None and size.shape[:2] != x.shape[:2]:
        size = None  # features of another input than the last forward's: their sizes are unknown
    return pool_tokens(x, model.global_pool, model.num_prefix_tokens, model.attn_pool, size)


class ToMeVisionTransformer:
    """ViT / DeiT / HaLViT with token merging (mixed in before the model's class)."""

    prefix = "ToMe"

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = self._pos_embed(self.patch_embed(x), self._grid(x))
        return self.norm(run_blocks(self, self.blocks, x)[0])

    def pool(self, x: torch.Tensor) -> torch.Tensor:
        return sized_pool(self, x, self._tome.size)

    def forward_intermediates(self, x: torch.Tensor, indices: int | list[int] | None = None, norm: bool = False,
                              output_fmt: str = "NCHW", intermediates_only: bool = False,
                              return_prefix_tokens: bool = False, stop_early: bool = False):
        """As the model's own, with every map un-merged to the (H, W) grid of the input."""
        take, last = intermediates_plan(len(self.blocks), indices, output_fmt, stop_early, intermediates_only)
        B, hw = x.shape[0], self._grid(x)
        x = self._pos_embed(self.patch_embed(x), hw)
        x, _, feats = run_blocks(self, self.blocks[: last + 1], x, take, self.norm if norm else None)
        p = self.num_prefix_tokens
        prefix, feats = [y[:, :p] for y in feats], [y[:, p:] for y in feats]
        if output_fmt == "NCHW":
            feats = [y.reshape(B, hw[0], hw[1], -1).permute(0, 3, 1, 2).contiguous() for y in feats]
        if return_prefix_tokens:
            feats = list(zip(feats, prefix, strict=True))
        return feats if intermediates_only else (self.norm(x), feats)


class ToMeCait:
    """CaiT with token merging in its self-attention stage; the class attention sees the merged patches."""

    prefix = "ToMe"

    def _tome_cls(self, x: torch.Tensor, size: torch.Tensor | None) -> torch.Tensor:
        mask = None
        if size is not None and self._tome.prop_attn:
            mask = _prop_mask(torch.cat([size.new_ones(size.shape[0], 1, 1), size], dim=1), self._tome)
        x_cls = self.cls_token.repeat(x.shape[0], 1, 1)
        for blk in self.blocks_token_only:
            x_cls = blk(x, x_cls, mask)
        return torch.cat((x_cls, x), dim=1)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x, _ = self._embed(x)
        x, size, _ = run_blocks(self, self.blocks, x)
        return self.norm(self._tome_cls(x, size))

    def forward_intermediates(self, x: torch.Tensor, indices: int | list[int] | None = None, norm: bool = False,
                              output_fmt: str = "NCHW", intermediates_only: bool = False,
                              stop_early: bool = False):
        """As the model's own, with every map un-merged to the (H, W) grid of the input."""
        take, last = intermediates_plan(len(self.blocks), indices, output_fmt, stop_early, intermediates_only)
        B = x.shape[0]
        x, (H, W) = self._embed(x)
        x, size, feats = run_blocks(self, self.blocks[: last + 1], x, take, self.norm if norm else None)
        if output_fmt == "NCHW":
            feats = [y.reshape(B, H, W, -1).permute(0, 3, 1, 2).contiguous() for y in feats]
        if intermediates_only:
            return feats
        if last + 1 < len(self.blocks):
            return self.norm(x), feats
        return self.norm(self._tome_cls(x, size)), feats


@functools.cache
def patched_class(mixin: type, base: type) -> type:
    """``mixin`` placed before ``base``: one class per pair (so isinstance checks of ``base`` still hold)."""
    return type(f"{mixin.prefix}{base.__name__}", (mixin, base), {})


def swap_class(module: nn.Module, mixin: type, tag: str) -> None:
    """Give ``module`` the class ``mixin + its class``, remembering the original under attribute ``tag``."""
    setattr(module, tag, type(module))
    module.__class__ = patched_class(mixin, type(module))


def install(model: nn.Module, blocks: list[nn.Module], model_mixin: type, block_mixin: type, attr: str,
            info) -> None:
    """Swap the classes of ``model`` and its ``blocks`` for the patch's (once) and share ``info`` as ``attr``."""
    if getattr(model, attr, None) is None:
        swap_class(model, model_mixin, f"{attr}_class")
        for blk in blocks:
            swap_class(blk, block_mixin, f"{attr}_class")
    for m in [model, *blocks]:
        setattr(m, attr, info)


def uninstall(model: nn.Module, attr: str, what: str) -> None:
    """Undo :func:`install` (and every other :func:`swap_class` of the patch) on every module of ``model``."""
    if getattr(model, attr, None) is None:
        raise ValueError(f"the model is not patched with {what}")
    for m in model.modules():
        if f"{attr}_class" in m.__dict__:
            m.__class__ = m.__dict__.pop(f"{attr}_class")
            m.__dict__.pop(attr, None)


def merging_stage(model: nn.Module, what: str) -> tuple[list[nn.Module], int]:
    """(the blocks whose tokens a patch may reduce, the number of protected leading tokens), or one ValueError
    naming why ``model`` cannot take the patch."""
    if isinstance(model, VisionTransformer):
        if model.rope is not None:
            raise ValueError(f"{what} is not defined with pos_embed='rope': a reduced token has no single position "
                             f"to rotate by")
        blocks, protected = list(model.blocks), model.num_prefix_tokens
    elif isinstance(model, Cait):
        blocks, protected = list(model.blocks), 0  # the self-attention stage runs on the patches only
    else:
        raise ValueError(f"{what} works on plain single-scale ViTs (ViT, DeiT, HaLViT, CaiT); "
                         f"{type(model).__name__} is hierarchical or otherwise not supported, where it is not defined")
    for i, blk in enumerate(blocks):
        check_block(blk, i, what)
    return blocks, protected


def _grid_tokens(model: nn.Module, protected: int) -> int:
    grid = model.patch_embed.grid_size
    return grid[0] * grid[1] + protected


def apply(model: nn.Module, r: int | list[int] | tuple[int, float] = 8, prop_attn: bool = True,
          trace_source: bool = False) -> nn.Module:
    """Patch ``model`` (in place) to merge ``r`` tokens per block: an int, a list (one per block) or
    ``(r, inflect)`` (:func:`~vitlab.tome.merge.parse_r`; ``(r, -1)`` is the paper's decreasing schedule).
    Applying again changes the settings. Returns the model."""
    if getattr(model, "_prune", None) is not None:
        raise ValueError("the model is patched for token pruning; vitlab.prune.remove(model) first")
    blocks, protected = merging_stage(model, "ToMe")
    rs = parse_r(len(blocks), r)
    check_budget(rs, _grid_tokens(model, protected), protected)
    info = ToMeInfo(r=rs, prop_attn=bool(prop_attn), trace_source=bool(trace_source), protected=protected)
    if getattr(model, "_tome", None) is None:
        for blk in getattr(model, "blocks_token_only", ()):
            if isinstance(blk, LayerScaleBlockClassAttn):
                swap_class(blk, ToMeClassAttnBlock, "_tome_class")
    install(model, blocks, ToMeCait if isinstance(model, Cait) else ToMeVisionTransformer, ToMeBlock, "_tome", info)
    return model


def remove(model: nn.Module) -> nn.Module:
    """Undo :func:`apply`: the original classes, no patch attributes. Returns the model."""
    uninstall(model, "_tome", "ToMe")
    return model
