"""``vitlab train --tome_r 8``: the ``tome`` model transform of the classification task (ToMe trains as it
infers: merging in every forward, gradients through the size-weighted merges; Bolya et al., Sec. 4.3)."""

from __future__ import annotations

import torch.nn as nn

from vitlab.tome.patch import apply
from vitlab.train.task import register_model_transform


@register_model_transform("tome")
def tome_transform(model: nn.Module, r: int, training: bool) -> nn.Module:
    return apply(model, r=int(r))
