"""``apply`` / ``remove``: Token Merging patched into a model from outside (Bolya et al., ICLR 2023, Sec. 3 and
the authors' timm patch), on ViT, DeiT (distilled too), HaLViT and CaiT's self-attention stage.

``apply`` mixes :class:`ToMe` into the model's class (:func:`vitlab.models.mix_in`): its ``forward_features``
runs the model's public token interface (:class:`vitlab.models.TokenModel`: ``embed``, each block's
``forward_attention`` / ``forward_mlp``, ``finish_tokens``) and merges tokens between the two residual steps --
the weights, their names and the state dict are untouched, and ``remove`` restores the model's own class, so the
model is again exactly what it was. In each block (Sec. 3, "Token Merging"):

- the attention runs with **proportional attention** when ``prop_attn``: ``softmax(q k^T / sqrt(d) + log s)``
  with ``s`` the number of patches each key stands for (Eq. 1), handed to the attention as an additive
  (B, 1, 1, N) ``attn_mask`` so the fused kernels keep running (CaiT's class attention gets it too);
- between the attention and the MLP, bipartite soft matching on the keys (mean over heads) merges ``r`` tokens
  (:mod:`vitlab.tome.merge`), size-weighted, and the sizes add up;
- the model's average (or attention) pool weights each token by its size, as the authors pool their MAE
  models, so the pooled vector stays the mean over the patches;
- with ``trace_source`` the (B, N', N0) source map (which input patches each token holds) is kept as
  ``vitlab.tome.info(model).source`` after every forward (the paper's visualisation, :func:`vitlab.tome.merge_png`).

``forward_intermediates`` tracks the sources itself and un-merges every returned map back to the input grid
(each patch takes the value of the token it ended in), so dense heads keep their H x W maps.

The class / distillation / register tokens are protected (never merged, kept first). RoPE models and attention
mechanisms that take no ``attn_mask`` or return no keys (``return_qk``) are refused (a merged token has no single
position; other mechanisms expose no keys to match on), as are hierarchical models (Swin, LeViT, ...), where
merging is not defined.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from vitlab.layers import intermediates_plan
from vitlab.models import check_token_model, mix_in, mix_out, mixin_of
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
    """The patch's settings (``info(model)``) and what the last forward left."""

    r: list[int]  # merges per block (after parse_r)
    prop_attn: bool
    trace_source: bool
    protected: int  # leading tokens never merged
    source: torch.Tensor | None = field(default=None, repr=False)  # last forward's (B, N', N0), trace_source only
    size: torch.Tensor | None = field(default=None, repr=False)  # last forward's (B, N', 1) token sizes, for pooling


def prop_mask(size: torch.Tensor | None, info: ToMeInfo) -> torch.Tensor | None:
    """Proportional attention's additive mask (B, 1, 1, N): log of each key's size (Eq. 1)."""
    if size is None or not info.prop_attn:
        return None
    return size.log()[:, None, None, :, 0]


def merge_block(blk: nn.Module, x: torch.Tensor, hw, size: torch.Tensor | None, source: torch.Tensor | None,
                info: ToMeInfo, r: int):
    """One block with merging between its attention and its MLP: (x, size, source) -> (x, size, source)."""
    x, _, k = blk.forward_attention(x, hw, attn_mask=prop_mask(size, info), return_qk=True)
    m = bipartite_soft_matching(k.mean(1), r, info.protected) if r > 0 else None
    if m is not None:
        if source is not None:
            source = merge_source(m, x, source)
        x, size = merge_wavg(m, x, size)
    return blk.forward_mlp(x), size, source


def merge_blocks(model: nn.Module, blocks, x: torch.Tensor, hw, take: list[int] | None = None, norm=None):
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
            x, size, source = checkpoint(merge_block, blk, x, hw, size, source, info, info.r[i], use_reentrant=False)
        else:
            x, size, source = merge_block(blk, x, hw, size, source, info, info.r[i])
        if take and i in take:
            y = norm(x) if norm is not None else x
            maps.append(y if source is None else unmerge_tokens(y, source))
    if info.trace_source:
        info.source = source
    info.size = size
    return x, size, maps


class ToMe:
    """Token merging mixed into a token model's class (:func:`apply`)."""

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x, hw = self.embed(x)
        x, size, _ = merge_blocks(self, self.blocks, x, hw)
        return self.finish_tokens(x, prop_mask(size, self._tome))

    def pool(self, x: torch.Tensor, size: torch.Tensor | None = None) -> torch.Tensor:
        """The model's pool of its reduced tokens ``x``, each weighted by its size from the last forward (the
        mean over the patches, as the authors pool MAE models): unweighted, a merged background token would
        count as much as one object patch. Features of another input than the last forward's pool unweighted."""
        last = self._tome.size
        if size is None and last is not None and last.shape[:2] == x.shape[:2]:
            size = last
        return super().pool(x, size)

    def forward_intermediates(self, x: torch.Tensor, indices: int | list[int] | None = None, norm: bool = False,
                              output_fmt: str = "NCHW", intermediates_only: bool = False,
                              return_prefix_tokens: bool = False, stop_early: bool = False):
        """As the model's own, with every map un-merged to the (H, W) grid of the input."""
        take, last = intermediates_plan(len(self.blocks), indices, output_fmt, stop_early, intermediates_only)
        B = x.shape[0]
        x, hw = self.embed(x)
        x, size, feats = merge_blocks(self, self.blocks[: last + 1], x, hw, take, self.norm if norm else None)
        p = self.num_block_prefix_tokens
        prefix, feats = [y[:, :p] for y in feats], [y[:, p:] for y in feats]
        if output_fmt == "NCHW":
            feats = [y.reshape(B, hw[0], hw[1], -1).permute(0, 3, 1, 2).contiguous() for y in feats]
        if return_prefix_tokens:
            feats = list(zip(feats, prefix, strict=True))
        if intermediates_only:
            return feats
        if last + 1 < len(self.blocks):
            return self.norm(x), feats
        return self.finish_tokens(x, prop_mask(size, self._tome)), feats


def is_applied(model: nn.Module) -> bool:
    """Whether ``model`` is patched with :func:`apply`."""
    return mixin_of(model) is ToMe


def info(model: nn.Module) -> ToMeInfo:
    """The settings of a merging ``model`` (and what its last forward left: sizes, sources)."""
    if not is_applied(model):
        raise ValueError("the model is not patched with ToMe; vitlab.tome.apply(model, r) first")
    return model._tome


def apply(model: nn.Module, r: int | list[int] | tuple[int, float] = 8, prop_attn: bool = True,
          trace_source: bool = False) -> nn.Module:
    """Patch ``model`` (in place) to merge ``r`` tokens per block: an int, a list (one per block) or
    ``(r, inflect)`` (:func:`~vitlab.tome.merge.parse_r`; ``(r, -1)`` is the paper's decreasing schedule).
    Applying again changes the settings. Returns the model."""
    current = mixin_of(model)
    if current is not None and current is not ToMe:
        raise ValueError(f"the model is patched with {current.__name__} (token pruning); remove that patch first "
                         f"(vitlab.prune.remove(model))")
    check_token_model(model, "ToMe", "attn_mask", "return_qk")
    protected = model.num_block_prefix_tokens
    rs = parse_r(len(model.blocks), r)
    grid = model.patch_embed.grid_size
    check_budget(rs, grid[0] * grid[1] + protected, protected)
    if current is None:
        mix_in(model, ToMe)
    model._tome = ToMeInfo(r=rs, prop_attn=bool(prop_attn), trace_source=bool(trace_source), protected=protected)
    return model


def remove(model: nn.Module) -> nn.Module:
    """Undo :func:`apply`: the original class, no patch attributes. Returns the model."""
    info(model)
    mix_out(model, ToMe)
    del model._tome
    return model
