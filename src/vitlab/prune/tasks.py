"""``vitlab train --prune METHOD:KEEP_RATE``: the ``prune`` model transform of the classification task.

EViT and top-k train with the pruning in place and the task's own loss. DynamicViT trains through
:class:`PruneStudent`, which adds its keep-ratio and distillation losses against the full model (a frozen copy
of the model as built, i.e. the pretrained weights when fine-tuning from ``--model_kwargs.checkpoint_path``);
the adaptive method adds the loss that learns its thresholds.

``shrink=(start, epochs)`` (the classification task's ``prune_shrink_start`` / ``prune_shrink_epochs``) adds
EViT's keep-rate warm-up (:mod:`vitlab.prune.warmup`): a :class:`KeepRateWarmup` child of the trained module,
moved after each optimiser step and checkpointed with the run."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from vitlab.prune.losses import adaptive_loss, dynamicvit_loss
from vitlab.prune.patch import METHODS, apply, check_keep_rate, pruned_info
from vitlab.prune.warmup import KeepRateWarmup
from vitlab.train.task import TransformedModule, register_model_transform


def parse_spec(spec: str) -> tuple[str, list[float]]:
    """``'evit:0.7'`` -> ('evit', [0.7]); ``'evit:0.7,0.5'`` -> ('evit', [0.7, 0.5])."""
    method, sep, rates = str(spec).partition(":")
    if method not in METHODS or not sep:
        raise ValueError(f"prune must be METHOD:KEEP_RATE with METHOD one of {', '.join(METHODS)}, got {spec!r}")
    try:
        keep = [float(v) for v in rates.split(",")]
    except ValueError:
        raise ValueError(f"prune {spec!r}: keep rates must be numbers in (0, 1]") from None
    return method, [check_keep_rate(k) for k in keep]


class PruneStudent(TransformedModule):
    """The pruned model as the trained module: ``forward(x)`` is the model's; for DynamicViT and adaptive
    (``adds_loss``) ``forward(x, with_loss=True)`` returns (output, the method's extra loss). The full-model teacher
    is held outside the module tree (it is neither trained, nor checkpointed, nor wrapped by the strategy); a
    keep-rate ``warmup`` is a child (its rate is checkpointed in the trainer state) moved by :meth:`after_step`."""

    def __init__(self, model: nn.Module, teacher: nn.Module | None = None, warmup: KeepRateWarmup | None = None):
        super().__init__()
        self.model = model
        self._teacher = (teacher,)
        self.adds_loss = pruned_info(model).method in ("dynamicvit", "adaptive")
        if warmup is not None:
            self.warmup = warmup

    def after_step(self, step: int, total_steps: int, steps_per_epoch: int) -> None:
        if "warmup" in self._modules:
            self.warmup.after_step(step, total_steps, steps_per_epoch)

    def shard_units(self) -> list[nn.Module]:
        from vitlab.train.strategy import shard_units

        return shard_units(self.model)

    def forward(self, x: torch.Tensor, with_loss: bool = False):
        if not with_loss:
            return self.model(x)
        m, info = self.model, pruned_info(self.model)
        feats = m.forward_features(x)
        out = m.forward_head(feats)
        if info.method == "adaptive":
            return out, adaptive_loss(info)
        teacher = self._teacher[0]
        with torch.no_grad():
            t_feats = teacher.forward_features(x)
            t_logits = teacher.forward_head(t_feats)
        p = info.protected
        logits = out[0] if isinstance(out, tuple) else out
        return out, dynamicvit_loss(info, logits, feats[:, p:], t_logits, t_feats[:, p:])


@register_model_transform("prune")
def prune_transform(model: nn.Module, spec: str, training: bool,
                    shrink: tuple[float, float] = (0.0, 0.0)) -> nn.Module:
    method, keep = parse_spec(spec)
    if len(keep) != 1:
        raise ValueError(f"prune {spec!r}: training takes one keep rate")
    teacher = None
    if training and method == "dynamicvit":
        teacher = copy.deepcopy(model).eval().requires_grad_(False)
        if hasattr(teacher, "distilled_training"):
            teacher.distilled_training = False
    apply(model, method, keep[0])
    warmup = KeepRateWarmup(model, *shrink) if training and any(shrink) else None
    if training and (warmup is not None or method in ("dynamicvit", "adaptive")):
        return PruneStudent(model, teacher, warmup)
    return model
