"""``ClassificationTask`` (``--task classify``): supervised image classification with the DeiT recipe, and DeiT
distillation from a frozen teacher -- ``hard`` / ``soft`` through the distillation token, or ``feature``
(student features projected to the teacher's width, MSE; the projectors train with the model and are
checkpointed beside it).

Also the model-description helpers eval / predict use to rebuild a trained model from its checkpoint alone.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import vitlab
from vitlab.convert import CheckpointError, load_state_dict
from vitlab.data import build, check_num_classes
from vitlab.train import checkpoint as ck
from vitlab.train.recipe import FeatureProjector, deit_loss, layer_decay_groups, param_groups
from vitlab.train.task import model_transform, register_task


def autocast(device: torch.device, amp: str):
    if amp == "none":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16 if amp == "bf16" else torch.float16)


def model_in_chans(cfg, model_cfg) -> int:
    return int(cfg.model_kwargs.get("in_chans", model_cfg.input_size[0]))


def build_data(cfg, model_cfg):
    """The data bundle, normalised with the model's mean/std; an unset ``img_size`` takes the model's input size
    (``fake`` data: ``fake_img_size``)."""
    data_cfg = cfg.data
    if data_cfg.img_size is None and data_cfg.name == "fake":
        pass  # fake images are made at fake_img_size
    elif data_cfg.img_size is None and "img_size" not in cfg.model_kwargs:
        data_cfg = replace(data_cfg, img_size=int(model_cfg.input_size[-1]))
    elif data_cfg.img_size is None:
        data_cfg = replace(data_cfg, img_size=int(cfg.model_kwargs["img_size"]))
    return build(data_cfg, mean=model_cfg.mean, std=model_cfg.std, in_chans=model_in_chans(cfg, model_cfg))


def model_description(cfg, bundle, model_cfg, num_params: int) -> dict:
    """What eval/predict need to rebuild the model and its input pipeline (stored with every checkpoint)."""
    kwargs = {k: v for k, v in cfg.model_kwargs.items() if k not in ("num_classes", "img_size", "in_chans")}
    return {"model": cfg.model, "model_kwargs": kwargs, "num_classes": bundle.num_classes,
            "class_names": bundle.class_names, "in_chans": bundle.in_chans, "img_size": bundle.img_size,
            "mean": list(model_cfg.mean), "std": list(model_cfg.std), "crop_pct": bundle.config.crop_pct,
            "data": bundle.config.to_dict(), "params": num_params}


def prepare_model(model: nn.Module, cfg, device: torch.device) -> nn.Module:
    """``model`` on ``device`` as the config asks: activation checkpointing, channels-last memory format."""
    if cfg.grad_checkpointing:
        model.set_grad_checkpointing(True)
    model.to(device)
    if cfg.channels_last:
        model.to(memory_format=torch.channels_last)
    return model


def create_from_description(meta: dict, **overrides) -> nn.Module:
    model = vitlab.create_model(meta["model"], num_classes=meta["num_classes"], img_size=meta["img_size"],
                                in_chans=meta["in_chans"], **{**meta.get("model_kwargs", {}), **overrides})
    reduce_tokens(model, meta.get("token_reduction") or {}, training=False)
    return model


def reduce_tokens(model: nn.Module, spec: dict, training: bool,
                  prune_shrink: tuple[float, float] = (0.0, 0.0)) -> nn.Module:
    """Token merging / pruning of a run (``{"tome_r": r, "prune": "evit:0.7"}``) applied to ``model`` through
    the registered model transforms; returns the module to train (the model, or a wrapper that adds a loss or
    moves a keep-rate warm-up, ``prune_shrink`` = (start, epochs), after each step)."""
    module = model
    if spec.get("tome_r"):
        module = model_transform("tome")(model, spec["tome_r"], training)
    if spec.get("prune"):
        module = model_transform("prune")(model, spec["prune"], training, shrink=prune_shrink)
    return module


# ---------------------------------------------------------------- evaluation


def _logits(out) -> torch.Tensor:
    return (out[0] if isinstance(out, tuple) else out).float()


def classification_sums(out, y: torch.Tensor, num_classes: int) -> dict[str, torch.Tensor]:
    """Summed cross-entropy, top-5 hits and the confusion matrix (rows: true class) of one batch."""
    out = _logits(out)
    k = min(5, num_classes)
    top = out.topk(k, dim=-1).indices
    conf = torch.bincount((y * num_classes + top[:, 0]).cpu(), minlength=num_classes ** 2)
    return {"loss": F.cross_entropy(out, y, reduction="sum").detach().double().cpu(),
            "top5": (top == y[:, None]).any(dim=1).sum().cpu(),
            "confusion": conf.view(num_classes, num_classes)}


def classification_metrics(sums: dict[str, torch.Tensor]) -> dict:
    conf = sums["confusion"]
    n = max(int(conf.sum()), 1)
    return {"top1": 100.0 * conf.diag().sum().item() / n, "top5": 100.0 * sums["top5"].item() / n,
            "loss": sums["loss"].item() / n}


def add_sums(acc: dict | None, new: dict) -> dict:
    return dict(new) if acc is None else {k: acc[k] + new[k] for k in acc}


@torch.no_grad()
def evaluate_model(model: nn.Module, loader, device: torch.device, num_classes: int, amp: str = "none",
                   channels_last: bool = False) -> dict:
    """top-1 / top-5 (%), mean cross-entropy and the confusion matrix (rows: true class) of ``model``."""
    was_training = model.training
    model.eval()
    sums = None
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        with autocast(device, amp):
            out = model(x)
        sums = add_sums(sums, classification_sums(out, y, num_classes))
    model.train(was_training)
    if sums is None:
        sums = {"loss": torch.zeros((), dtype=torch.float64), "top5": torch.zeros((), dtype=torch.long),
                "confusion": torch.zeros(num_classes, num_classes, dtype=torch.long)}
    return {**classification_metrics(sums), "confusion": sums["confusion"]}


# ---------------------------------------------------------------- teacher


def build_teacher(d, bundle, device: torch.device) -> nn.Module:
    """The frozen teacher of DistillConfig ``d``: a checkpoint (run dir / dir / .safetensors), 'timm:NAME', or a
    registered name."""
    spec = d.teacher
    if spec.startswith("timm:"):
        try:
            import timm
        except ImportError:
            raise ValueError("a timm teacher needs timm installed (pip install timm)") from None
        name = spec[5:]
        try:
            kw = {"num_classes": bundle.num_classes, "in_chans": bundle.in_chans, **d.teacher_kwargs}
            teacher = timm.create_model(name, pretrained=d.teacher_checkpoint is None, **kw)
        except Exception as e:
            raise CheckpointError(f"cannot build timm teacher {name!r}: {type(e).__name__}: "
                                  f"{str(e).splitlines()[0] if str(e) else ''}") from None
        if d.teacher_checkpoint:
            teacher.load_state_dict(ck.read_state_dict(d.teacher_checkpoint))
    elif Path(spec).exists():
        sd, meta = ck.load_weights(spec)
        # built for this data's image size; convert.load_state_dict resamples the position embedding
        teacher = create_from_description({**meta, "img_size": bundle.img_size}, **d.teacher_kwargs)
        load_state_dict(teacher, sd, source=spec)
    elif vitlab.is_model(spec):
        kw = {"num_classes": bundle.num_classes, "img_size": bundle.img_size, "in_chans": bundle.in_chans,
              **d.teacher_kwargs}
        teacher = vitlab.create_model(spec, checkpoint_path=d.teacher_checkpoint, **kw)
    else:
        raise ValueError(f"teacher {spec!r} is neither a checkpoint path, 'timm:NAME', nor a registered model")
    n_out = getattr(teacher, "num_classes", bundle.num_classes)
    check_num_classes(bundle, n_out, what=f"the teacher {spec}")
    teacher.eval().requires_grad_(False)
    if hasattr(teacher, "distilled_training"):
        teacher.distilled_training = False
    return teacher.to(device)


class FeatureDistillStudent(nn.Module):
    """The student and its projectors as one trained module, so DDP averages the projectors' gradients and FSDP
    shards them with the root: ``forward(x)`` is the model's; ``forward(x, teacher_feats)`` returns (logits,
    feature loss)."""

    def __init__(self, model: nn.Module, projector: FeatureProjector, layers: list[int]):
        super().__init__()
        self.model, self.projector, self.layers = model, projector, list(layers)

    def shard_units(self) -> list[nn.Module]:
        from vitlab.train.strategy import shard_units

        return shard_units(self.model)

    def forward(self, x: torch.Tensor, teacher_feats: list[torch.Tensor] | None = None):
        if teacher_feats is None:
            return self.model(x)
        final, feats = self.model.forward_intermediates(x, indices=self.layers)
        return self.model.forward_head(final), self.projector(feats, teacher_feats)


# ---------------------------------------------------------------- the task


@register_task("classify")
class ClassificationTask:
    """Supervised classification (label-smoothed cross-entropy, MixUp/CutMix soft targets) with optional DeiT
    hard / soft distillation or feature distillation. Reports top-1 / top-5 / loss; ``top1`` picks the best."""

    monitor = "top1"

    def build(self, cfg, device: torch.device) -> None:
        if cfg.task_args:  # a typo'd --task or a flag meant for another task must not be silently ignored
            raise ValueError(f"task 'classify' takes no task_args (got {', '.join(sorted(cfg.task_args))}); "
                             "did you mean another --task?")
        self.cfg, self.device = cfg, device
        model_cfg = vitlab.get_model_config(cfg.model)
        self.data = build_data(cfg, model_cfg)
        bundle = self.data
        kwargs = {k: v for k, v in cfg.model_kwargs.items() if k not in ("num_classes", "img_size", "in_chans")}
        model = vitlab.create_model(cfg.model, num_classes=bundle.num_classes, img_size=bundle.img_size,
                                    in_chans=bundle.in_chans, drop_path_rate=cfg.drop_path, **kwargs)
        self.num_params = sum(p.numel() for p in model.parameters())
        self.init_method = None
        if cfg.init:  # a pre-trained backbone (vitlab pretrain): every weight but the classifier must match
            sd, meta = ck.load_weights(cfg.init, weights="raw")
            load_state_dict(model, sd, source=cfg.init)
            self.init_method = meta.get("ssl_method")
        self.model = prepare_model(model, cfg, device)
        reduction = {k: v for k, v in (("tome_r", cfg.tome_r), ("prune", cfg.prune)) if v}
        self.module = reduce_tokens(model, reduction, training=True,
                                    prune_shrink=(cfg.prune_shrink_start, cfg.prune_shrink_epochs))
        self._description = model_description(cfg, bundle, model_cfg, self.num_params)
        if reduction:
            self._description["token_reduction"] = reduction

        self.teacher = self.projector = None
        d = cfg.distill
        if d.kind != "none":
            self.teacher = build_teacher(d, bundle, device)
            if d.kind == "feature":
                if reduction:
                    raise ValueError("feature distillation reads dense maps; it does not combine with --tome_r / "
                                     "--prune")
                if not hasattr(model, "forward_intermediates") or not hasattr(self.teacher, "forward_intermediates"):
                    raise ValueError("feature distillation needs forward_intermediates on student and teacher")
                self.projector = FeatureProjector([model.num_features] * len(d.student_layers),
                                                  [self.teacher.num_features] * len(d.teacher_layers)).to(device)
                self.module = FeatureDistillStudent(model, self.projector, d.student_layers)

    def param_groups(self, weight_decay: float) -> list[dict]:
        decay = self.cfg.layer_decay
        if decay is None and self.init_method == "mae":
            decay = 0.65  # MAE's fine-tuning recipe (He et al., 2022, appendix A.1)
        if decay is not None and decay < 1.0:
            extra = param_groups(self.projector, weight_decay) if self.projector is not None else []
            return layer_decay_groups(self.model, weight_decay, decay) + extra
        return param_groups(self.model, weight_decay, extra=[self.projector] if self.projector is not None else None)

    def _batch(self, batch, train: bool):
        x, y = batch
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        if train and self.data.mixup is not None:
            x, y = self.data.mixup(x, y)
        if self.cfg.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x, y

    def training_step(self, batch, forward) -> tuple[torch.Tensor, dict]:
        x, y = self._batch(batch, train=True)
        d, smoothing = self.cfg.distill, self.cfg.label_smoothing
        if self.projector is not None:
            with torch.no_grad():
                _, t_feats = self.teacher.forward_intermediates(x, indices=list(d.teacher_layers))
            out, feat_loss = forward(x, t_feats)
            return deit_loss(out, y, smoothing) + d.feature_weight * feat_loss, {}
        t_logits = None
        if self.teacher is not None:
            with torch.no_grad():
                t_logits = self.teacher(x)
                t_logits = t_logits[0] if isinstance(t_logits, tuple) else t_logits
        if getattr(self.module, "adds_loss", False):  # token pruning's own losses (DynamicViT, adaptive)
            out, extra = forward(x, with_loss=True)
            return deit_loss(out, y, smoothing, d.kind, t_logits, d.alpha, d.tau) + extra, {}
        return deit_loss(forward(x), y, smoothing, d.kind, t_logits, d.alpha, d.tau), {}

    def after_step(self, step: int, total_steps: int, steps_per_epoch: int) -> None:
        if hasattr(self.module, "after_step"):  # a token-pruning keep-rate warm-up
            self.module.after_step(step, total_steps, steps_per_epoch)

    def validation_step(self, batch, forward) -> dict[str, torch.Tensor]:
        x, y = self._batch(batch, train=False)
        return classification_sums(forward(x), y, self.data.num_classes)

    def validation_metrics(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        return classification_metrics(sums)

    def description(self) -> dict:
        return self._description

    def summary(self) -> dict:
        b = self.data
        return {"model": self.cfg.model, "dataset": b.name, "params_m": self.num_params / 1e6,
                "img_size": b.img_size, "train_images": len(b.train), "val_images": len(b.val)}

    def test(self, run_dir, batch_size: int, checkpoint: str = "last") -> dict:
        """Top-1 / top-5 of ``checkpoint``'s preferred weights on the test split (when the data has one)."""
        run_dir = Path(run_dir)
        if self.data.test is None or not (run_dir / checkpoint).exists():
            return {"test_top1": None, "test_top5": None}
        sd, meta = ck.load_weights(run_dir / checkpoint, weights="auto")
        best_model = create_from_description(meta).to(self.device)
        best_model.load_state_dict(sd)
        r = evaluate_model(best_model, self.data.loader("test", batch_size=batch_size), self.device,
                           self.data.num_classes, self.cfg.amp)
        return {"test_top1": r["top1"], "test_top5": r["top5"]}
