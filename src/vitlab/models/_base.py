"""The part of timm's model API that every family implements the same way (not a family: registers nothing).

:class:`TimmApiMixin` gives ``forward``, ``get_classifier``, ``reset_classifier`` and ``set_grad_checkpointing``
over a model's ``head`` (and ``head_dist`` when it has one, DeiT-style), and declares :meth:`shard_units`, which
every family overrides. A family sets ``pool_types`` (the
``global_pool`` values ``reset_classifier`` accepts) and overrides ``_make_head`` when its head is not a plain
linear layer.

:class:`TokenModel` is the public token interface of the plain-ViT family; :func:`mix_in` / :func:`mix_out` swap a
mixin class in and out of a model from outside (token merging and pruning patch models this way).
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from vitlab.attention import accepts_keywords
from vitlab.layers import check_pool, create_classifier


def set_grad_checkpointing(module: nn.Module, enable: bool = True) -> None:
    """Switch gradient checkpointing on or off in every submodule of ``module`` that has it (its
    ``grad_checkpointing`` flag): a model built of others (CLIP's towers, a vision-language model) sets them all."""
    for m in module.modules():
        if hasattr(m, "grad_checkpointing"):
            m.grad_checkpointing = enable


class TimmApiMixin:
    pool_types: tuple[str, ...] = ()  # the global_pool values reset_classifier accepts

    def forward(self, x: torch.Tensor):
        return self.forward_head(self.forward_features(x))

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute activations in the backward pass: the model and every stage that checkpoints its blocks."""
        self.grad_checkpointing = enable
        set_grad_checkpointing(self, enable)

    def shard_units(self) -> list[nn.Module]:
        """The submodules an FSDP strategy wraps one by one, in forward order, before it wraps the root (which
        keeps what is left: embeddings, downsampling between stages, norms, the head). Disjoint submodules
        that together hold most of the parameters; every family declares its own."""
        raise NotImplementedError(f"{type(self).__name__} declares no FSDP shard units: override shard_units()")

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        head_dist = getattr(self, "head_dist", None)
        return self.head if head_dist is None else nn.ModuleList([self.head, head_dist])

    def _make_head(self, num_classes: int) -> nn.Module:
        return create_classifier(self.num_features, num_classes)

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """A new (randomly initialised) classifier for ``num_classes`` (0: none, ``forward`` returns the pooled
        features) on the model's device; optionally another ``global_pool``."""
        if global_pool is not None:
            self.global_pool = check_pool(global_pool, self.pool_types, type(self).__name__)
        self.num_classes = num_classes
        with torch.device(next(self.parameters()).device):
            self.head = self._make_head(num_classes)
            if getattr(self, "head_dist", None) is not None:
                self.head_dist = self._make_head(num_classes)


class TokenModel:
    """The token interface of the plain-ViT family (ViT, DeiT, HaLViT, CaiT, and CLIP's ViT image tower): what
    token reduction, pruning, masked image modelling, attention analysis and dense backbones build on, in the
    spirit of lightly's ``MaskedVisionTransformer``.

    ``forward_features(images) == finish_tokens(forward_blocks(*embed(images)))``, and a family implements:

    - :meth:`embed` ``(images, mask=None, mask_token=None, keep=None) -> (tokens, (H, W))``: the sequence the
      ``blocks`` take (``num_block_prefix_tokens`` prefix tokens, then the H x W patch grid in raster order);
    - ``blocks``: each callable as ``blk(x, hw)``, and in two residual steps ``blk.forward_attention(x, hw,
      **attn_kwargs)`` (``attn_mask``, ``return_attn``, ``return_qk``, ... reach the attention; its extras follow
      the tokens) and ``blk.forward_mlp(x)``;
    - :meth:`forward_blocks` ``(x, hw, blocks=None)``: tokens through ``blocks`` (default all), with the model's
      RoPE and gradient checkpointing;
    - :meth:`finish_tokens` ``(x, attn_mask=None)``: what follows the blocks (the final norm; CaiT's
      class-attention stage first, its keys biased by ``attn_mask`` when given);
    - ``final_norm``: the per-token final norm; ``num_block_prefix_tokens``; ``pool(x, size=None)`` where the
      family pools.
    """

    def embed(self, x: torch.Tensor, mask: torch.Tensor | None = None, mask_token: torch.Tensor | None = None,
              keep: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple[int, int]]:
        raise NotImplementedError

    def forward_blocks(self, x: torch.Tensor, hw: tuple[int, int], blocks=None) -> torch.Tensor:
        raise NotImplementedError

    def finish_tokens(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.finish_tokens(self.forward_blocks(*self.embed(x)))


def mask_patches(x: torch.Tensor, mask: torch.Tensor | None, mask_token: torch.Tensor | None) -> torch.Tensor:
    """(B, N, C) patch tokens with those where ``mask`` (B, N) is True replaced by ``mask_token`` (C or 1, 1, C):
    masked image modelling's input (iBOT, DINOv2, SimMIM), before the position embedding."""
    if mask is None:
        return x
    if mask_token is None:
        raise ValueError("a mask needs a mask_token to put in place of the masked patches")
    if mask.shape != x.shape[:2]:
        raise ValueError(f"mask must be (batch, patches) = {tuple(x.shape[:2])}, got {tuple(mask.shape)}")
    return torch.where(mask[..., None], mask_token.to(x.dtype), x)


def keep_patches(x: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """The patch tokens at indices ``keep`` (B, K) of (B, N, C), in that order (MAE's visible patches)."""
    if keep is None:
        return x
    if keep.ndim != 2 or keep.shape[0] != x.shape[0]:
        raise ValueError(f"keep must be (batch, kept) patch indices, got shape {tuple(keep.shape)}")
    return x.gather(1, keep[..., None].expand(-1, -1, x.shape[-1]))


@functools.cache
def _mixed_class(mixin: type, base: type) -> type:
    return type(f"{mixin.__name__}{base.__name__}", (mixin, base), {"vitlab_mixin": mixin})


def mixin_of(module: nn.Module) -> type | None:
    """The mixin :func:`mix_in` gave ``module``, or None."""
    return type(module).__dict__.get("vitlab_mixin")


def mix_in(module: nn.Module, mixin: type) -> None:
    """Give ``module`` the class ``(mixin, its class)`` in place: methods of ``mixin`` override the model's, the
    parameters, buffers and state dict stay as they are, ``isinstance`` checks of the model's class still hold.
    One class per pair; one mixin at a time (a ValueError names the one the module carries)."""
    current = mixin_of(module)
    if current is not None:
        raise ValueError(f"the model already carries the {current.__name__} patch; remove it first")
    module.__class__ = _mixed_class(mixin, type(module))


def mix_out(module: nn.Module, mixin: type) -> bool:
    """Undo :func:`mix_in`; False when ``module`` does not carry ``mixin``."""
    if mixin_of(module) is not mixin:
        return False
    module.__class__ = type(module).__bases__[1]
    return True


def check_token_model(model: nn.Module, what: str, *keywords: str) -> None:
    """One ValueError naming why ``what`` (a token reduction patched in from outside: merging, pruning) cannot run
    on ``model``: not a plain single-scale ViT with the token interface; RoPE (a reduced token has no single
    position to rotate by); a block without the two residual steps, or whose attention takes no ``keywords``."""
    if not isinstance(model, TokenModel):
        raise ValueError(f"{what} works on plain single-scale ViTs (ViT, DeiT, HaLViT, CaiT); {type(model).__name__} "
                         f"is hierarchical or otherwise not supported, where it is not defined")
    if getattr(model, "rope", None) is not None:
        raise ValueError(f"{what} is not defined with pos_embed='rope': a reduced token has no single position to "
                         f"rotate by")
    for i, blk in enumerate(model.blocks):
        if not (callable(getattr(blk, "forward_attention", None)) and callable(getattr(blk, "forward_mlp", None))):
            raise ValueError(f"{what} runs each block in its two residual steps (forward_attention, forward_mlp); "
                             f"block {i} is a {type(blk).__name__}")
        attn = getattr(blk, "attn", None)
        if attn is None or not accepts_keywords(attn, *keywords):
            raise ValueError(f"{what} needs softmax multi-head attention that takes {', '.join(keywords)} (msa, "
                             f"HaLViT's, CaiT's talking heads); block {i} uses {type(attn).__name__}")
