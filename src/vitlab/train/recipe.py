"""The DeiT recipe's pieces, each a small function of its inputs: parameter groups (no weight decay on norms,
biases, tokens and position embeddings), the scaled learning rate, AdamW, the per-iteration warm-up + cosine
schedule, the losses (label smoothing, soft targets, DeiT distillation, feature distillation) and the EMA."""

from __future__ import annotations

import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

# ---------------------------------------------------------------- optimiser


def param_groups(model: nn.Module, weight_decay: float, skip: set[str] | None = None,
                 extra: list[nn.Module] | None = None) -> list[dict]:
    """Two AdamW groups: decayed weights, and the rest (1-d tensors: norms and biases; names in ``skip`` or the
    model's ``no_weight_decay()``: class/dist/register tokens, position embeddings). ``extra`` modules (e.g.
    distillation projectors) join with the same rule."""
    if skip is None:
        skip = set(model.no_weight_decay()) if hasattr(model, "no_weight_decay") else set()
    decay, no_decay = [], []
    named = list(model.named_parameters())
    for i, m in enumerate(extra or []):
        named += [(f"extra{i}.{n}", p) for n, p in m.named_parameters()]
    for name, p in named:
        if not p.requires_grad:
            continue
        bare = name.split(".")[-1]
        if p.ndim <= 1 or name.endswith(".bias") or name in skip or bare in skip:
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def layer_id(name: str, num_blocks: int) -> int:
    """BEiT / MAE layer index of a parameter: embeddings and tokens 0, ``blocks.i`` i + 1, the rest (final norm,
    head) ``num_blocks + 1``."""
    if name.startswith(("cls_token", "dist_token", "reg_token", "pos_embed", "patch_embed", "mask_token")):
        return 0
    if name.startswith("blocks."):
        return int(name.split(".")[1]) + 1
    return num_blocks + 1


def layer_decay_groups(model: nn.Module, weight_decay: float, layer_decay: float) -> list[dict]:
    """Layer-wise lr decay (Bao et al., 2022, BEiT; MAE fine-tuning, He et al., 2022, appendix A.1): parameter
    ``p`` of layer ``i`` trains at ``lr * layer_decay ** (num_blocks + 1 - i)``, weight decay as
    :func:`param_groups`. Groups carry ``lr_scale``, which :class:`WarmupCosine` applies."""
    n = len(getattr(model, "blocks", []))
    skip = set(model.no_weight_decay()) if hasattr(model, "no_weight_decay") else set()
    groups: dict[tuple[int, bool], dict] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        no_wd = p.ndim <= 1 or name.endswith(".bias") or name in skip or name.split(".")[-1] in skip
        lid = layer_id(name, n)
        g = groups.setdefault((lid, no_wd), {"params": [], "weight_decay": 0.0 if no_wd else weight_decay,
                                             "lr_scale": layer_decay ** (n + 1 - lid)})
        g["params"].append(p)
    return [groups[k] for k in sorted(groups)]


def scaled_lr(lr: float, global_batch: int) -> float:
    """The linear scaling rule of DeiT: ``lr`` is quoted for a global batch of 512."""
    return lr * global_batch / 512.0


def build_optimizer(groups: list[dict], lr: float, betas=(0.9, 0.999), fused: bool | None = None):
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), fused=fused)


def lr_at(step: int, total_steps: int, warmup_steps: int, base_lr: float, min_lr: float = 0.0,
          warmup_lr: float = 0.0) -> float:
    """Linear warm-up from ``warmup_lr`` to ``base_lr`` over ``warmup_steps``, then cosine to ``min_lr`` at
    ``total_steps`` (the learning rate used for optimiser step ``step``, counting from 0)."""
    if warmup_steps > 0 and step < warmup_steps:
        return warmup_lr + (base_lr - warmup_lr) * step / warmup_steps
    span = max(1, total_steps - warmup_steps)
    t = min(1.0, (step - warmup_steps) / span)
    return min_lr + 0.5 * (base_lr - min_lr) * (1.0 + math.cos(math.pi * t))


class WarmupCosine:
    """Sets each group's lr from :func:`lr_at` before every optimiser step; its state is the step count."""

    def __init__(self, optimizer, total_steps: int, warmup_steps: int, base_lr: float, min_lr: float = 0.0,
                 warmup_lr: float = 0.0):
        self.optimizer = optimizer
        self.total_steps, self.warmup_steps = int(total_steps), int(warmup_steps)
        self.base_lr, self.min_lr, self.warmup_lr = base_lr, min_lr, warmup_lr
        self.step_count = 0
        self._apply()

    def lr(self, step: int | None = None) -> float:
        return lr_at(self.step_count if step is None else step, self.total_steps, self.warmup_steps,
                     self.base_lr, self.min_lr, self.warmup_lr)

    def _apply(self) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] = self.lr() * g.get("lr_scale", 1.0)  # lr_scale: layer-wise decay (layer_decay_groups)

    def step(self) -> None:
        self.step_count += 1
        self._apply()

    def state_dict(self) -> dict:
        return {"step_count": self.step_count}

    def load_state_dict(self, state: dict) -> None:
        self.step_count = int(state["step_count"])
        self._apply()


# ---------------------------------------------------------------- losses


def smooth_targets(target: Tensor, num_classes: int, smoothing: float) -> Tensor:
    """Hard labels (B,) or soft targets (B, K) -> soft targets with label smoothing: t * (1 - s) + s / K."""
    if target.ndim == 1:
        target = F.one_hot(target.long(), num_classes).float()
    return target * (1.0 - smoothing) + smoothing / num_classes


def soft_cross_entropy(logits: Tensor, target: Tensor) -> Tensor:
    """Cross-entropy against soft targets (B, K), averaged over the batch."""
    return torch.sum(-target * F.log_softmax(logits.float(), dim=-1), dim=-1).mean()


def classification_loss(logits: Tensor, target: Tensor, smoothing: float) -> Tensor:
    """Label-smoothed cross-entropy; ``target`` is (B,) labels or (B, K) soft targets (MixUp/CutMix)."""
    if target.ndim == 1:
        return F.cross_entropy(logits.float(), target, label_smoothing=smoothing)
    return soft_cross_entropy(logits, smooth_targets(target, logits.shape[-1], smoothing))


def distillation_loss(kind: str, student_dist_logits: Tensor, teacher_logits: Tensor, tau: float = 1.0) -> Tensor:
    """DeiT: 'hard' = CE against the teacher's argmax; 'soft' = KL(student/tau || teacher/tau) * tau^2."""
    if kind == "hard":
        return F.cross_entropy(student_dist_logits.float(), teacher_logits.argmax(dim=-1))
    if kind == "soft":
        return F.kl_div(F.log_softmax(student_dist_logits.float() / tau, dim=-1),
                        F.log_softmax(teacher_logits.float() / tau, dim=-1),
                        reduction="batchmean", log_target=True) * tau * tau
    raise ValueError(f"unknown distillation kind {kind!r}")


def deit_loss(output, target: Tensor, smoothing: float, kind: str = "none", teacher_logits: Tensor | None = None,
              alpha: float = 0.5, tau: float = 1.0) -> Tensor:
    """The class loss on the class-token head, plus (with a teacher) the distillation loss on the distillation
    head: ``(1 - alpha) * class + alpha * distill``. A model without a distillation token distils through its
    only head; a distilled model without a teacher trains both heads on the labels."""
    cls_out, dist_out = output if isinstance(output, tuple) else (output, output)
    base = classification_loss(cls_out, target, smoothing)
    if kind in ("none", "feature") or teacher_logits is None:
        if isinstance(output, tuple):
            return 0.5 * (base + classification_loss(dist_out, target, smoothing))
        return base
    return (1.0 - alpha) * base + alpha * distillation_loss(kind, dist_out, teacher_logits, tau)


class FeatureProjector(nn.Module):
    """Feature distillation for (B, C, H, W) feature maps: a 1x1 projection of each chosen student
    feature to the teacher's width, the teacher's map resized to the student's grid, and the mean MSE."""

    def __init__(self, student_dims: list[int], teacher_dims: list[int]):
        super().__init__()
        self.projectors = nn.ModuleList([nn.Conv2d(s, t, 1) for s, t in zip(student_dims, teacher_dims)])

    def forward(self, student_feats: list[Tensor], teacher_feats: list[Tensor]) -> Tensor:
        loss = 0.0
        for proj, s, t in zip(self.projectors, student_feats, teacher_feats):
            s = proj(s)
            if t.shape[-2:] != s.shape[-2:]:
                t = F.adaptive_avg_pool2d(t, s.shape[-2:]) if t.shape[-1] >= s.shape[-1] else \
                    F.interpolate(t, size=s.shape[-2:], mode="bilinear", align_corners=False)
            loss = loss + F.mse_loss(s.float(), t.float())
        return loss / len(self.projectors)


# ---------------------------------------------------------------- EMA


class ModelEma(nn.Module):
    """Exponential moving average of a model's parameters and buffers: ``ema = d * ema + (1 - d) * w``.

    With ``warmup`` the decay is ``min(decay, (1 + n) / (10 + n))`` after ``n`` updates, so an EMA of a short run
    is not dominated by the random initialisation."""

    def __init__(self, model: nn.Module, decay: float, warmup: bool = True):
        super().__init__()
        self.module = copy.deepcopy(model).eval()
        for p in self.module.parameters():
            p.requires_grad_(False)
        self.decay, self.warmup = decay, warmup
        self.register_buffer("num_updates", torch.zeros((), dtype=torch.long), persistent=True)

    def current_decay(self) -> float:
        n = int(self.num_updates)
        return min(self.decay, (1.0 + n) / (10.0 + n)) if self.warmup else self.decay

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        d = self.current_decay()
        ema_sd, sd = self.module.state_dict(), model.state_dict()
        seen: set[int] = set()
        for k, e in ema_sd.items():
            if e.numel() and e.data_ptr() in seen:  # a tied tensor (one memory, several names) moves once
                continue
            seen.add(e.data_ptr())
            w = sd[k].detach()
            if e.dtype.is_floating_point:
                e.lerp_(w.to(e.dtype), 1.0 - d)
            else:
                e.copy_(w)
        self.num_updates += 1
