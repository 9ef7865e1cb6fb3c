"""EViT's keep-rate warm-up: train unpruned first, then shrink the keep rate to its target with a half cosine.

Liang et al., "Not All Patches are What You Need", ICLR 2022 (Sec. 4, training from scratch: the keep rate is
reduced gradually from 1 to the target), as the authors' ``helpers.adjust_keep_rate`` computes it per iteration
in ``engine.train_one_epoch`` (``--shrink_start_epoch 10 --shrink_epochs 100`` of 300 epochs in their recipe)::

    r(t) = 1                                                      t <  t0 = shrink_start * steps_per_epoch
    r(t) = r + (1 - r) * (1 + cos(pi * (t - t0) / (t1 - t0))) / 2   t0 <= t < t1 = t0 + shrink_epochs * steps_per_epoch
    r(t) = r                                                      t >= t1

with ``t`` the 0-based optimiser step and ``r`` the target keep rate. For whole epochs this is the authors'
function exactly (their ``epoch < shrink_start`` test is ``t < t0``); vitlab also takes fractional epochs.

:class:`KeepRateWarmup` drives it in a training run: a child of the trained module whose ``after_step`` (called by
the Trainer after each optimiser step) sets the keep rate the next step's training forwards use
(:func:`vitlab.prune.set_keep_rate` with ``train_only=True``). Inference -- validation, the EMA weights, the
checkpoint rebuilt by ``vitlab eval`` -- keeps the target rate, so every validation scores the model as it will be
deployed and the best checkpoint is picked like for like (the authors' log validates at the current rate). The
current rate is a buffer, checkpointed with the run, so a resumed run continues the warm-up where it stopped.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from vitlab.prune.patch import check_keep_rate, pruned_info, set_keep_rate


def check_warmup(shrink_start: float, shrink_epochs: float) -> tuple[float, float]:
    for name, v in (("shrink_start", shrink_start), ("shrink_epochs", shrink_epochs)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 or math.isinf(v):
            raise ValueError(f"{name} must be a finite number of epochs >= 0, got {v!r}")
    return float(shrink_start), float(shrink_epochs)


def keep_rate_at(step: int, steps_per_epoch: int, keep_rate: float, shrink_start: float = 0.0,
                 shrink_epochs: float = 0.0) -> float:
    """The keep rate of optimiser step ``step`` (0-based): 1 for ``shrink_start`` epochs, a half cosine down to
    ``keep_rate`` over ``shrink_epochs`` epochs, ``keep_rate`` after (the module docstring gives the formula)."""
    keep_rate = check_keep_rate(keep_rate)
    shrink_start, shrink_epochs = check_warmup(shrink_start, shrink_epochs)
    if steps_per_epoch < 1:
        raise ValueError(f"steps_per_epoch must be >= 1, got {steps_per_epoch}")
    t0 = shrink_start * steps_per_epoch
    t1 = t0 + shrink_epochs * steps_per_epoch
    if step < t0:
        return 1.0
    if step >= t1:  # also the whole schedule when shrink_epochs is 0: a step from 1 to the target at t0
        return keep_rate
    return keep_rate + (1.0 - keep_rate) * 0.5 * (1.0 + math.cos(math.pi * (step - t0) / (t1 - t0)))


class KeepRateWarmup(nn.Module):
    """The warm-up of a pruned ``model``'s training keep rate, from 1 to the rate it was pruned with. Hold it in the
    trained module and call :meth:`after_step` after each optimiser step (the Trainer does, through the task)."""

    def __init__(self, model: nn.Module, shrink_start: float, shrink_epochs: float):
        super().__init__()
        self.target = pruned_info(model).keep_rate
        self._model = (model,)  # a reference, not a child: the trained module holds the model itself
        self.shrink_start, self.shrink_epochs = check_warmup(shrink_start, shrink_epochs)
        # step 0 needs no steps_per_epoch: 1 whenever a warm-up is asked for, the target otherwise
        first = keep_rate_at(0, 1, self.target, self.shrink_start, self.shrink_epochs)
        device = next(model.parameters()).device
        # float64 so the checkpointed rate is the float the forwards used, bit for bit
        self.register_buffer("keep_rate", torch.tensor(first, dtype=torch.float64, device=device))
        self.register_load_state_dict_post_hook(KeepRateWarmup._loaded)
        self._set(first)

    @staticmethod
    def _loaded(module: KeepRateWarmup, incompatible_keys) -> None:
        module._set(float(module.keep_rate))  # a resumed run: the model takes the checkpointed rate

    def _set(self, rate: float) -> None:
        set_keep_rate(self._model[0], rate, train_only=True)
        self.keep_rate.fill_(rate)

    def after_step(self, step: int, total_steps: int, steps_per_epoch: int) -> None:
        """After optimiser step ``step`` (0-based): the rate of step ``step + 1``."""
        self._set(keep_rate_at(step + 1, steps_per_epoch, self.target, self.shrink_start, self.shrink_epochs))

    def extra_repr(self) -> str:
        return (f"target={self.target:g}, shrink_start={self.shrink_start:g}, shrink_epochs={self.shrink_epochs:g}, "
                f"keep_rate={float(self.keep_rate):.4f}")


__all__ = ["KeepRateWarmup", "check_warmup", "keep_rate_at"]
