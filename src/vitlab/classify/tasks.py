"""``ClassificationTask`` (``--task classify``, the default): supervised image classification with the DeiT
recipe (Touvron et al., 2021: label-smoothed cross-entropy, MixUp / CutMix soft targets, warm-up + cosine), and
distillation from a frozen teacher -- DeiT's ``hard`` / ``soft`` through the distillation token, or ``feature``
(student features projected to the teacher's width, MSE; the projectors train with the model and are
checkpointed beside it). Token merging (ToMe) and pruning (EViT, DynamicViT, top-k, adaptive) are model
transforms its :class:`ClassifyArgs` ask for.

Its run record rebuilds the model for ``vitlab eval`` (top-1 / top-5, per-class accuracy, confusion matrix as
JSON and PNG) and ``vitlab predict`` (top-k labels with probabilities).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

import vitlab
from vitlab._io import write_json
from vitlab.convert import CheckpointError, load_state_dict
from vitlab.data import DataConfig, build, check_num_classes
from vitlab.train import checkpoint as ck
from vitlab.train.common import (
    add_sums,
    autocast,
    build_image_data,
    create_image_model,
    image_record,
    model_kwargs,
    prepare_model,
)
from vitlab.train.recipe import FeatureProjector, deit_loss, layer_decay_groups, param_groups
from vitlab.train.task import (
    RunRecord,
    Task,
    TransformedModule,
    create_task,
    model_transform,
    register_task,
)

DistillKind = Literal["none", "hard", "soft", "feature"]
DISTILL_KINDS = typing.get_args(DistillKind)


@dataclass
class DistillConfig:
    """DeiT distillation through the distillation token (hard: teacher's argmax; soft: KL at ``tau``), or feature
    distillation (student features projected to the teacher's width, MSE)."""

    kind: DistillKind = "none"         # hard: teacher's argmax; soft: KL at tau; feature: projected features, MSE
    teacher: str | None = None         # a vitlab model name, 'timm:NAME', or a checkpoint (run dir / dir / file)
    teacher_checkpoint: str | None = None  # weights for a teacher given by name
    teacher_kwargs: dict = field(default_factory=dict)  # create_model kwargs of a teacher given by name
    alpha: float = 0.5                 # weight of the distillation loss (1 - alpha on the class loss)
    tau: float = 1.0                   # soft distillation temperature
    student_layers: list[int] = field(default_factory=lambda: [-1])  # feature: block indices (negatives ok)
    teacher_layers: list[int] = field(default_factory=lambda: [-1])  # feature: the teacher's block indices
    feature_weight: float = 1.0        # feature: weight of the MSE added to the class loss


@dataclass
class ClassifyArgs:
    """The classification task's options (``--task_args.NAME``; short flags: --teacher, --distill, --tome_r,
    --prune, --prune_shrink_start, --prune_shrink_epochs, --init, --layer_decay, --label_smoothing)."""

    label_smoothing: float = 0.1       # of the class loss
    distill: DistillConfig = field(default_factory=DistillConfig)
    tome_r: int = 0                    # ToMe: tokens merged per block (vitlab.tome; 0 = off)
    prune: str | None = None           # token pruning METHOD:KEEP_RATE (evit, dynamicvit, topk, adaptive): evit:0.7
    prune_shrink_start: float = 0.0    # keep-rate warm-up (EViT): epochs at keep rate 1 before it shrinks (paper: 10)
    prune_shrink_epochs: float = 0.0   # epochs of the cosine from keep rate 1 to --prune's (paper: 100; 0 = none)
    init: str | None = None            # start from this run's / checkpoint's backbone (e.g. vitlab pretrain)
    layer_decay: float | None = None   # layer-wise lr decay (None: off; 0.65 when --init is an MAE run)


def token_reduction(args: ClassifyArgs) -> dict:
    """The token merging / pruning a run asks for: ``{"tome_r": 8}``, ``{"prune": "evit:0.7"}`` or ``{}``."""
    return {k: v for k, v in (("tome_r", args.tome_r), ("prune", args.prune)) if v}


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
        kw = {"num_classes": bundle.num_classes, "in_chans": bundle.in_chans, **d.teacher_kwargs}
        in_chans = kw["in_chans"]
        try:
            teacher = timm.create_model(name, pretrained=d.teacher_checkpoint is None, **kw)
        except Exception as e:
            raise CheckpointError(f"cannot build timm teacher {name!r}: {type(e).__name__}: "
                                  f"{str(e).splitlines()[0] if str(e) else ''}") from None
        if d.teacher_checkpoint:
            teacher.load_state_dict(ck.read_state_dict(d.teacher_checkpoint))
    elif Path(spec).exists():
        sd, meta = ck.load_weights(spec)
        record = RunRecord.from_meta(meta)
        # built for this data's image size; convert.load_state_dict resamples the position embedding
        record.img_size = bundle.img_size
        record.model_kwargs = {**record.model_kwargs, **d.teacher_kwargs}
        in_chans = record.model_kwargs.get("in_chans", record.in_chans)
        teacher = create_task(record.task).load(record)
        load_state_dict(teacher, sd, source=spec)
    elif vitlab.is_model(spec):
        kw = {"num_classes": bundle.num_classes, "img_size": bundle.img_size, "in_chans": bundle.in_chans,
              **d.teacher_kwargs}
        in_chans = kw["in_chans"]
        teacher = vitlab.create_model(spec, checkpoint_path=d.teacher_checkpoint, **kw)
    else:
        raise ValueError(f"teacher {spec!r} is neither a checkpoint path, 'timm:NAME', nor a registered model")
    # checked here, not left to the teacher's first forward, whose error would not say which model is wrong
    if int(in_chans) != bundle.in_chans:
        fix = ("drop in_chans from its teacher_kwargs" if "in_chans" in d.teacher_kwargs
               else f"distil from a teacher trained on {bundle.in_chans}-channel images")
        raise ValueError(f"the teacher {spec} takes {in_chans} input channels but the data has {bundle.in_chans}; "
                         f"{fix}")
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
class ClassificationTask(Task):
    """Supervised classification (label-smoothed cross-entropy, MixUp/CutMix soft targets) with optional DeiT
    hard / soft distillation or feature distillation. Reports top-1 / top-5 / loss; ``top1`` picks the best."""

    monitor = "top1"
    Args = ClassifyArgs
    # short flags of vitlab train for the options users reach for most
    aliases: ClassVar[dict[str, str]] = {
        "teacher": "task_args.distill.teacher", "distill": "task_args.distill.kind", "tome_r": "task_args.tome_r",
        "prune": "task_args.prune", "prune_shrink_start": "task_args.prune_shrink_start",
        "prune_shrink_epochs": "task_args.prune_shrink_epochs", "init": "task_args.init",
        "layer_decay": "task_args.layer_decay", "label_smoothing": "task_args.label_smoothing"}

    @classmethod
    def check(cls, cfg) -> None:
        a: ClassifyArgs = cfg.task_args
        d = a.distill
        checks = [
            (0.0 <= a.label_smoothing < 1.0, f"label_smoothing must be in [0, 1), got {a.label_smoothing}"),
            (d.kind in DISTILL_KINDS, f"distill.kind must be one of {DISTILL_KINDS}, got {d.kind!r}"),
            (0.0 <= d.alpha <= 1.0, f"distill.alpha must be in [0, 1], got {d.alpha}"),
            (d.tau > 0, f"distill.tau must be > 0, got {d.tau}"),
            (d.kind == "none" or d.teacher,
             f"distill.kind={d.kind!r} needs a teacher (--teacher MODEL|CHECKPOINT)"),
            (a.tome_r >= 0, f"tome_r must be >= 0, got {a.tome_r}"),
            (a.prune_shrink_start >= 0 and a.prune_shrink_epochs >= 0,
             f"prune_shrink_start and prune_shrink_epochs must be >= 0 epochs, got {a.prune_shrink_start} and "
             f"{a.prune_shrink_epochs}"),
            (a.prune or not (a.prune_shrink_start or a.prune_shrink_epochs),
             "prune_shrink_start / prune_shrink_epochs warm up a pruning keep rate; they need --prune METHOD:KEEP"),
            (a.prune_shrink_start + a.prune_shrink_epochs <= cfg.epochs,
             f"the pruning keep-rate warm-up ends at epoch {a.prune_shrink_start + a.prune_shrink_epochs:g}, "
             f"after the run's {cfg.epochs} epochs (the model would never train at its keep rate)"),
            (a.layer_decay is None or 0.0 < a.layer_decay <= 1.0,
             f"layer_decay must be in (0, 1], got {a.layer_decay}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)

    def build(self, cfg, device: torch.device) -> None:
        self.cfg, self.device, self.args = cfg, device, cfg.task_args
        a = self.args
        model_cfg = vitlab.get_model_config(cfg.model)
        self.data = build_image_data(cfg, model_cfg)
        bundle = self.data
        model = vitlab.create_model(cfg.model, num_classes=bundle.num_classes, img_size=bundle.img_size,
                                    in_chans=bundle.in_chans, drop_path_rate=cfg.drop_path, **model_kwargs(cfg))
        self.num_params = sum(p.numel() for p in model.parameters())
        self.init_method = None
        if a.init:  # a pre-trained backbone (vitlab pretrain): every weight but the classifier must match
            sd, meta = ck.load_weights(a.init, weights="raw")
            load_state_dict(model, sd, source=a.init)
            self.init_method = meta.get("ssl_method")
        self.model = prepare_model(model, cfg, device)
        reduction = token_reduction(a)
        self.module = reduce_tokens(model, reduction, training=True,
                                    prune_shrink=(a.prune_shrink_start, a.prune_shrink_epochs))
        self._record = image_record(self.name, cfg, bundle, model_cfg, self.num_params)

        self.teacher = self.projector = None
        d = a.distill
        if d.kind != "none":
            self.teacher = build_teacher(d, bundle, device)
            if d.kind == "feature":
                if reduction:
                    raise ValueError("feature distillation reads dense maps; it does not combine with --tome_r / "
                                     "--prune")
                self.projector = FeatureProjector([model.num_features] * len(d.student_layers),
                                                  [self.teacher.num_features] * len(d.teacher_layers)).to(device)
                self.module = FeatureDistillStudent(model, self.projector, d.student_layers)

    def param_groups(self, weight_decay: float) -> list[dict]:
        decay = self.args.layer_decay
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
        d, smoothing = self.args.distill, self.args.label_smoothing
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
        if isinstance(self.module, TransformedModule) and self.module.adds_loss:  # DynamicViT's, adaptive's losses
            out, extra = forward(x, with_loss=True)
            return deit_loss(out, y, smoothing, d.kind, t_logits, d.alpha, d.tau) + extra, {}
        return deit_loss(forward(x), y, smoothing, d.kind, t_logits, d.alpha, d.tau), {}

    def after_step(self, step: int, total_steps: int, steps_per_epoch: int) -> None:
        if isinstance(self.module, TransformedModule):  # a token-pruning keep-rate warm-up
            self.module.after_step(step, total_steps, steps_per_epoch)

    def validation_step(self, batch, forward) -> dict[str, torch.Tensor]:
        x, y = self._batch(batch, train=False)
        return classification_sums(forward(x), y, self.data.num_classes)

    def validation_metrics(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        return classification_metrics(sums)

    def record(self) -> RunRecord:
        return self._record

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
        best_model = self.load(RunRecord.from_meta(meta)).to(self.device)
        best_model.load_state_dict(sd)
        r = evaluate_model(best_model, self.data.loader("test", batch_size=batch_size), self.device,
                           self.data.num_classes, self.cfg.amp)
        return {"test_top1": r["top1"], "test_top5": r["top5"]}

    # ---- the run record ----------------------------------------------------------------------------------
    def load(self, record: RunRecord) -> nn.Module:
        model = create_image_model(record)
        reduce_tokens(model, token_reduction(ClassifyArgs(**{k: v for k, v in record.task_args.items()
                                                               if k in ("tome_r", "prune")})), training=False)
        return model

    def evaluate(self, model: nn.Module, record: RunRecord, data: str | None, split: str, *, out_dir: Path,
                 batch_size: int = 256, device: str = "cpu", optimize: bool = True) -> dict:
        """Top-1 / top-5 / per-class accuracy (%) and the confusion matrix on ``data``'s ``split`` ('test',
        falling back to 'val' when the data has no test split): ``eval-<split>.json`` and
        ``confusion-<split>.png`` in ``out_dir``."""
        from vitlab.train.plots import confusion_png

        bundle = build(data_config(data, record), mean=record.mean, std=record.std, in_chans=record.in_chans)
        check_num_classes(bundle, record.num_classes)
        if split == "test" and bundle.test is None:
            split = "val"
        loader = bundle.loader(split, batch_size=batch_size)
        if optimize:
            n = min(batch_size, len(getattr(bundle, split)))
            model = optimized(model, torch.zeros(n, record.in_chans, record.img_size, record.img_size,
                                                 device=device))
        r = evaluate_model(model, loader, torch.device(device), bundle.num_classes)
        conf = r["confusion"]
        per_class = (100.0 * conf.diag().float() / conf.sum(1).clamp(min=1).float()).tolist()
        result = {"task": self.name, "model": record.model, "dataset": bundle.name, "split": split,
                  "num_images": int(conf.sum()), "top1": r["top1"], "top5": r["top5"], "loss": r["loss"],
                  "per_class_top1": dict(zip(bundle.class_names, per_class)), "class_names": bundle.class_names,
                  "confusion_matrix": conf.tolist()}
        write_json(out_dir / f"eval-{split}.json", result)
        ck.atomic_write(out_dir / f"confusion-{split}.png",
                        confusion_png(conf, bundle.class_names, f"{record.model} on {bundle.name} {split}: "
                                                                f"top-1 {r['top1']:.2f}%"))
        result["files"] = [str(out_dir / f"eval-{split}.json"), str(out_dir / f"confusion-{split}.png")]
        worst = sorted(result["per_class_top1"].items(), key=lambda kv: kv[1])[:3]
        result["summary"] = (f"{record.model} on {bundle.name} ({split}, {result['num_images']} images): "
                             f"top-1 {r['top1']:.2f}%  top-5 {r['top5']:.2f}%  loss {r['loss']:.4f}  (weakest: "
                             + ", ".join(f"{name} {acc:.1f}%" for name, acc in worst) + ")")
        return result

    def predict(self, model: nn.Module, record: RunRecord, inputs: list[str], out_dir: Path, *, topk: int = 5,
                device: str = "cpu", optimize: bool = True, prompt: str | None = None) -> list[dict]:
        """For each image: ``{"image": path, "top": [(label, probability), ...]}`` with ``topk`` entries."""
        from vitlab.data import load_image
        from vitlab.data.transforms import channel_stats, eval_transform

        if topk < 1:
            raise ValueError(f"topk must be >= 1, got {topk}")
        tf = eval_transform(record.img_size, crop_pct=record.crop_pct or 1.0,
                            mean=channel_stats(record.mean, record.in_chans),
                            std=channel_stats(record.std, record.in_chans))
        x = torch.stack([tf(load_image(p, record.in_chans)) for p in inputs]).to(device)
        names = record.class_names or [str(i) for i in range(record.num_classes)]
        if optimize:
            model = optimized(model, x)
        with torch.no_grad():
            out = model(x)
            probs = _logits(out).softmax(-1)
        k = min(topk, probs.shape[-1])
        top = probs.topk(k, dim=-1)
        rows = []
        for j, p in enumerate(inputs):
            pairs = [(names[i], float(v)) for v, i in zip(top.values[j].tolist(), top.indices[j].tolist())]
            rows.append({"image": str(p), "top": pairs,
                         "line": f"{p}: " + "  ".join(f"{label} {prob:.3f}" for label, prob in pairs)})
        return rows


def data_config(data: str | DataConfig | None, record: RunRecord) -> DataConfig:
    """The data to evaluate on: the record's (``None``), another dataset by name, or a DataConfig; always at the
    record's image size."""
    from dataclasses import replace

    trained = record.data or {}
    if data is None:
        if not trained:
            raise ValueError("the checkpoint does not say which data it was trained on; pass --data")
        cfg = DataConfig(**trained)
    elif isinstance(data, DataConfig):
        cfg = data
    else:
        same = trained.get("dataset") == data
        cfg = DataConfig(**trained) if same else DataConfig(dataset=data, crop_pct=record.crop_pct)
    return replace(cfg, img_size=record.img_size)


def optimized(model: nn.Module, example: torch.Tensor) -> nn.Module:
    """``model`` through :func:`vitlab.optimize.optimize` (``backend="auto"``: the fastest path measured on this
    machine for ``example``'s shape, cached; outputs equal eager within 1e-5 in fp32)."""
    from vitlab.optimize import optimize

    return optimize(model, example_inputs=(example,), backend="auto")
