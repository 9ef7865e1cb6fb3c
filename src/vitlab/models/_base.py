"""The part of timm's model API that every family implements the same way (not a family: registers nothing).

:class:`TimmApiMixin` gives ``forward``, ``get_classifier``, ``reset_classifier`` and ``set_grad_checkpointing``
over a model's ``head`` (and ``head_dist`` when it has one, DeiT-style), and declares :meth:`shard_units`, which
every family overrides. A family sets ``pool_types`` (the
``global_pool`` values ``reset_classifier`` accepts) and overrides ``_make_head`` when its head is not a plain
linear layer.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from vitlab.layers import check_pool, create_classifier


class TimmApiMixin:
    pool_types: tuple[str, ...] = ()  # the global_pool values reset_classifier accepts

    def forward(self, x: torch.Tensor):
        return self.forward_head(self.forward_features(x))

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute activations in the backward pass: the model and every stage that checkpoints its blocks."""
        self.grad_checkpointing = enable
        for m in self.modules():
            if hasattr(m, "grad_checkpointing"):
                m.grad_checkpointing = enable

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
