"""``fit(TrainConfig) -> summary``: data -> model -> (strategy) -> epochs of train + validate -> run directory.

The run directory holds ``config.yaml`` (the resolved config), ``metrics.jsonl`` (one line per epoch),
``curves.png``, ``last`` / ``best`` checkpoints (see :mod:`vitlab.train.checkpoint`) and ``summary.json``.

Exact resume: the trainer state stores optimiser, scheduler, scaler, EMA, epoch, step and every RNG state at the
end of an epoch, and the training loader's shuffle is seeded with (seed, epoch); so on CPU a resumed run
repeats the straight run's arithmetic step for step.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import time
from dataclasses import replace
from datetime import datetime
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

import vitlab
from vitlab.convert import CheckpointError, load_state_dict
from vitlab.data import DataConfig, build, check_num_classes
from vitlab.train import checkpoint as ck
from vitlab.train import distributed as dist_utils
from vitlab.train.config import TrainConfig
from vitlab.train.recipe import (
    FeatureProjector,
    ModelEma,
    WarmupCosine,
    build_optimizer,
    deit_loss,
    param_groups,
    scaled_lr,
)

TIME_KEYS = ("epoch_time_s", "img_per_s", "wall_time_s")  # metrics that differ between identical runs


# ---------------------------------------------------------------- helpers


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return dev


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def autocast(device: torch.device, amp: str):
    if amp == "none":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16 if amp == "bf16" else torch.float16)


def model_in_chans(cfg: TrainConfig, model_cfg) -> int:
    return int(cfg.model_kwargs.get("in_chans", model_cfg.input_size[0]))


def build_data(cfg: TrainConfig, model_cfg):
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


def model_description(cfg: TrainConfig, bundle, model_cfg, num_params: int) -> dict:
    """What eval/predict need to rebuild the model and its input pipeline (stored with every checkpoint)."""
    kwargs = {k: v for k, v in cfg.model_kwargs.items() if k not in ("num_classes", "img_size", "in_chans")}
    return {"model": cfg.model, "model_kwargs": kwargs, "num_classes": bundle.num_classes,
            "class_names": bundle.class_names, "in_chans": bundle.in_chans, "img_size": bundle.img_size,
            "mean": list(model_cfg.mean), "std": list(model_cfg.std), "crop_pct": bundle.config.crop_pct,
            "data": bundle.config.to_dict(), "params": num_params}


def create_from_description(meta: dict, **overrides) -> nn.Module:
    return vitlab.create_model(meta["model"], num_classes=meta["num_classes"], img_size=meta["img_size"],
                               in_chans=meta["in_chans"], **{**meta.get("model_kwargs", {}), **overrides})


@torch.no_grad()
def evaluate_model(model: nn.Module, loader, device: torch.device, num_classes: int, amp: str = "none",
                   channels_last: bool = False) -> dict:
    """top-1 / top-5 (%), mean cross-entropy and the confusion matrix (rows: true class) of ``model``."""
    was_training = model.training
    model.eval()
    confusion = torch.zeros(num_classes, num_classes, dtype=torch.long)
    correct5 = 0
    loss_sum, n = 0.0, 0
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        with autocast(device, amp):
            out = model(x)
        out = out[0] if isinstance(out, tuple) else out
        out = out.float()
        loss_sum += nn.functional.cross_entropy(out, y, reduction="sum").item()
        k = min(5, num_classes)
        top = out.topk(k, dim=-1).indices
        correct5 += (top == y[:, None]).any(dim=1).sum().item()
        pred = top[:, 0]
        confusion += torch.bincount((y * num_classes + pred).cpu(), minlength=num_classes ** 2).view(
            num_classes, num_classes)
        n += y.numel()
    model.train(was_training)
    n = max(n, 1)
    return {"top1": 100.0 * confusion.diag().sum().item() / n, "top5": 100.0 * correct5 / n,
            "loss": loss_sum / n, "confusion": confusion}


def plot_curves(metrics: list[dict], path: Path) -> None:
    """Training loss and validation top-1 (raw and EMA) per epoch, written atomically as a PNG."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ep = [m["epoch"] for m in metrics]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
    a1.plot(ep, [m["train_loss"] for m in metrics], label="train loss")
    a1.plot(ep, [m["val_loss"] for m in metrics], label="val loss")
    a1.set_xlabel("epoch")
    a1.legend()
    a2.plot(ep, [m["val_top1"] for m in metrics], label="val top-1")
    if any("ema_val_top1" in m for m in metrics):
        a2.plot(ep, [m.get("ema_val_top1", float("nan")) for m in metrics], label="EMA val top-1")
    a2.set_xlabel("epoch")
    a2.set_ylabel("%")
    a2.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    ck.atomic_write(path, buf.getvalue())


def default_run_dir(cfg: TrainConfig) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    base = Path("runs") / f"{cfg.model}-{cfg.data.name}-{stamp}"
    path, i = base, 1
    while path.exists():
        i += 1
        path = base.with_name(f"{base.name}-{i}")
    return path


# ---------------------------------------------------------------- teacher


def build_teacher(cfg: TrainConfig, bundle, device: torch.device) -> nn.Module:
    """The frozen teacher: a checkpoint (run dir / dir / .safetensors), 'timm:NAME', or a registered name."""
    d = cfg.distill
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


# ---------------------------------------------------------------- progress


class _Progress:
    """A rich progress bar per epoch (ETA, loss, images/s); silent in quiet mode and on ranks other than 0."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.bar = None

    def start(self, epoch: int, epochs: int, total: int) -> None:
        if not self.enabled:
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        from vitlab.train._console import console

        self.bar = Progress(TextColumn(f"epoch {epoch}/{epochs}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                            TextColumn("{task.fields[info]}"), console=console, transient=True)
        self.bar.start()
        self.task = self.bar.add_task("train", total=total, info="")

    def update(self, loss: float, img_s: float) -> None:
        if self.bar is not None:
            self.bar.update(self.task, advance=1, info=f"loss {loss:.4f}  {img_s:,.0f} img/s")

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


def _say(cfg: TrainConfig, ctx, msg: str, always: bool = False) -> None:
    """Print on rank 0; quiet mode keeps only the lines marked ``always`` (the one-line summary)."""
    if ctx.is_main and (always or not cfg.quiet):
        from vitlab.train._console import console

        console.print(msg, highlight=False, markup=False)
        console.file.flush()  # one line per epoch reaches a log file as it happens


# ---------------------------------------------------------------- fit


def fit(cfg: TrainConfig) -> dict:
    """Train ``cfg.model`` on ``cfg.data`` and return the summary (also written to ``RUN/summary.json``)."""
    t_start = time.perf_counter()
    cfg.validate()
    ctx = dist_utils.setup(cfg)
    try:
        return _fit(cfg, ctx, t_start)
    finally:
        dist_utils.teardown(ctx)


def _fit(cfg: TrainConfig, ctx, t_start: float) -> dict:
    device = ctx.device
    if cfg.threads and device.type == "cpu":
        torch.set_num_threads(cfg.threads)
    model_cfg = vitlab.get_model_config(cfg.model)

    # ---- run directory (a resumed run continues in its own directory)
    resume_dir = None
    if cfg.resume:
        resume_dir = Path(cfg.resume)
        if not resume_dir.is_dir():
            raise FileNotFoundError(f"run directory to resume not found: {resume_dir}")
        if not (resume_dir / "last").exists():
            raise CheckpointError(f"{resume_dir} has no 'last' checkpoint to resume from")
        run_dir = resume_dir
    else:
        run_dir = Path(cfg.output_dir) if cfg.output_dir else default_run_dir(cfg)
        if (run_dir / "last").exists():
            raise ValueError(f"{run_dir} already holds a run; pass --resume {run_dir} to continue it, or choose "
                             f"another --output-dir")
    run_dir = ctx.broadcast_path(run_dir)

    # ---- data and model (identical initialisation on every rank, then per-rank augmentation streams)
    seed_everything(cfg.seed)
    bundle = build_data(cfg, model_cfg)
    kwargs = {k: v for k, v in cfg.model_kwargs.items() if k not in ("num_classes", "img_size", "in_chans")}
    model = vitlab.create_model(cfg.model, num_classes=bundle.num_classes, img_size=bundle.img_size,
                                in_chans=bundle.in_chans, drop_path_rate=cfg.drop_path, **kwargs)
    num_params = sum(p.numel() for p in model.parameters())
    if cfg.grad_checkpointing:
        model.set_grad_checkpointing(True)
    model.to(device)
    if cfg.channels_last:
        model.to(memory_format=torch.channels_last)
    description = model_description(cfg, bundle, model_cfg, num_params)

    teacher = projector = None
    if cfg.distill.kind != "none":
        teacher = build_teacher(cfg, bundle, device)
        if cfg.distill.kind == "feature":
            if not hasattr(model, "forward_intermediates") or not hasattr(teacher, "forward_intermediates"):
                raise ValueError("feature distillation needs forward_intermediates on student and teacher")
            if ctx.strategy != "none":
                raise ValueError("feature distillation is not supported with --strategy ddp/fsdp yet")
            projector = FeatureProjector([model.num_features] * len(cfg.distill.student_layers),
                                         [teacher.num_features] * len(cfg.distill.teacher_layers)).to(device)

    if cfg.ema_decay > 0 and ctx.strategy == "fsdp":
        raise ValueError("EMA is not supported with --strategy fsdp (sharded parameters); pass --ema-decay 0")
    ema = ModelEma(model, cfg.ema_decay, cfg.ema_warmup) if cfg.ema_decay > 0 else None

    # ---- optimiser and schedule (per optimiser step)
    global_batch = cfg.batch_size * cfg.accum_steps * ctx.world_size
    train_loader_len = len(ctx.train_loader(bundle, cfg, epoch=0))
    steps_per_epoch = train_loader_len // cfg.accum_steps
    if steps_per_epoch < 1:
        raise ValueError(f"the training split ({len(bundle.train)} images) gives no optimiser step at batch "
                         f"{cfg.batch_size} x accum {cfg.accum_steps} x {ctx.world_size} processes")
    wrapped = ctx.wrap(model, cfg)  # DDP / FSDP (identity without a strategy)
    groups = param_groups(model, cfg.weight_decay, extra=[projector] if projector is not None else None)
    base_lr = scaled_lr(cfg.lr, global_batch)
    optimizer = build_optimizer(groups, base_lr, cfg.betas)
    scheduler = WarmupCosine(optimizer, total_steps=steps_per_epoch * cfg.epochs,
                             warmup_steps=round(steps_per_epoch * cfg.warmup_epochs), base_lr=base_lr,
                             min_lr=scaled_lr(cfg.min_lr, global_batch),
                             warmup_lr=scaled_lr(cfg.warmup_lr, global_batch))
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.amp == "fp16")

    # ---- resume
    start_epoch, step, best = 0, 0, {"val_top1": -1.0, "epoch": None, "weights": "raw"}
    metrics: list[dict] = []
    rng_to_restore = None
    if resume_dir is not None:
        last = ck.resolve_checkpoint_dir(resume_dir, prefer="last")
        state = ck.load_trainer_state(last)
        ctx.load_model(wrapped, model, last, description)
        if ema is not None:
            ema_sd, _ = ck.load_weights(last, weights="ema")
            ema.module.load_state_dict(ema_sd)
            ema.num_updates.fill_(int(state.get("ema_updates", 0)))
        ctx.load_optimizer(wrapped, optimizer, state, last)
        scheduler.load_state_dict(state["scheduler"])
        scaler.load_state_dict(state["scaler"])
        if projector is not None and "projector" in state:
            projector.load_state_dict(state["projector"])
        start_epoch, step, best = int(state["epoch"]), int(state["step"]), dict(state["best"])
        rng_to_restore = state["rng"][min(ctx.rank, len(state["rng"]) - 1)] if isinstance(state["rng"], list) \
            else state["rng"]
        if (run_dir / "metrics.jsonl").is_file():
            metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
            metrics = [m for m in metrics if m["epoch"] <= start_epoch]
        if start_epoch >= cfg.epochs:
            _say(cfg, ctx, f"{run_dir} already finished {start_epoch} of {cfg.epochs} epochs", always=True)
    if ctx.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        cfg_out = replace(cfg, data=replace(bundle.config, img_size=bundle.img_size), resume=None,
                          output_dir=str(run_dir), stop_after=None)
        cfg_out.save(run_dir / "config.yaml")
        ck.atomic_write(run_dir / "metrics.jsonl", "".join(json.dumps(m) + "\n" for m in metrics).encode())
    if rng_to_restore is not None:
        ck.set_rng_state(rng_to_restore)
    else:
        seed_everything(cfg.seed + ctx.rank)  # augmentation / drop-path streams differ per rank

    forward = torch.compile(wrapped) if cfg.compile else wrapped
    _say(cfg, ctx, f"training {cfg.model} ({num_params / 1e6:.3f}M params) on {bundle.name} "
                   f"({len(bundle.train)} train / {len(bundle.val)} val images, {bundle.img_size}px) "
                   f"for {cfg.epochs} epochs, {steps_per_epoch} steps/epoch, global batch {global_batch}, "
                   f"lr {base_lr:.2e}, {device}{'' if ctx.world_size == 1 else f' x{ctx.world_size}'} -> {run_dir}")

    from vitlab.train._console import console

    progress = _Progress(enabled=ctx.is_main and not cfg.quiet and console.is_terminal)
    end_epoch = cfg.epochs if cfg.stop_after is None else min(cfg.epochs, cfg.stop_after)
    dk = cfg.distill
    for epoch in range(start_epoch, end_epoch):
        wrapped.train()
        loader = ctx.train_loader(bundle, cfg, epoch=epoch)
        n_micro = steps_per_epoch * cfg.accum_steps
        t0 = time.perf_counter()
        loss_sum, seen = 0.0, 0
        progress.start(epoch + 1, cfg.epochs, steps_per_epoch)
        optimizer.zero_grad(set_to_none=True)
        for i, (x, y) in enumerate(loader):
            if i >= n_micro:
                break
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            if bundle.mixup is not None:
                x, y = bundle.mixup(x, y)
            if cfg.channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            sync_now = (i + 1) % cfg.accum_steps == 0
            with ctx.no_sync(wrapped, not sync_now), autocast(device, cfg.amp):
                t_logits = t_feats = None
                if teacher is not None:
                    with torch.no_grad():
                        if projector is not None:
                            _, t_feats = teacher.forward_intermediates(x, indices=list(dk.teacher_layers))
                        else:
                            t_logits = teacher(x)
                            t_logits = t_logits[0] if isinstance(t_logits, tuple) else t_logits
                if projector is not None:
                    final, s_feats = model.forward_intermediates(x, indices=list(dk.student_layers))
                    out = model.forward_head(final)
                    loss = deit_loss(out, y, cfg.label_smoothing) + dk.feature_weight * projector(s_feats, t_feats)
                else:
                    out = forward(x)
                    loss = deit_loss(out, y, cfg.label_smoothing, dk.kind, t_logits, dk.alpha, dk.tau)
            if not math.isfinite(loss.item()):
                raise FloatingPointError(f"loss is {loss.item()} at epoch {epoch + 1}, step {step}; lower --lr "
                                         f"or use --amp bf16 instead of fp16")
            scaler.scale(loss / cfg.accum_steps).backward()
            loss_sum += loss.item() * x.shape[0]
            seen += x.shape[0]
            if sync_now:
                if cfg.clip_grad:
                    scaler.unscale_(optimizer)
                    params = [p for g in optimizer.param_groups for p in g["params"]]
                    ctx.clip_grad_norm(wrapped, params, cfg.clip_grad)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
                step += 1
                if ema is not None:
                    ema.update(model)
                progress.update(loss.item(), seen * ctx.world_size / (time.perf_counter() - t0))
        progress.stop()
        epoch_time = time.perf_counter() - t0
        train_loss = ctx.mean_across_ranks(loss_sum / max(seen, 1))
        row = {"epoch": epoch + 1, "step": step, "train_loss": train_loss,
               "lr": optimizer.param_groups[0]["lr"], "img_per_s": seen * ctx.world_size / epoch_time,
               "epoch_time_s": epoch_time}
        last_epoch = epoch + 1 == end_epoch
        if (epoch + 1) % cfg.eval_every == 0 or last_epoch or epoch + 1 == cfg.epochs:
            val_loader = ctx.eval_loader(bundle, "val", cfg)
            r = ctx.evaluate(wrapped, val_loader, device, bundle.num_classes, cfg)
            row.update(val_top1=r["top1"], val_top5=r["top5"], val_loss=r["loss"])
            candidates = [("raw", r["top1"])]
            if ema is not None:
                e = ctx.evaluate(ema.module, val_loader, device, bundle.num_classes, cfg)
                row.update(ema_val_top1=e["top1"], ema_val_top5=e["top5"], ema_val_loss=e["loss"])
                candidates.append(("ema", e["top1"]))
            which, top1 = max(candidates, key=lambda c: c[1])  # ties keep the raw weights
            is_best = top1 > best["val_top1"]
            if is_best:
                best = {"val_top1": top1, "epoch": epoch + 1, "weights": which}
        else:
            is_best = False
        metrics.append(row)
        state = {"epoch": epoch + 1, "step": step, "best": best, "scheduler": scheduler.state_dict(),
                 "scaler": scaler.state_dict(), "ema_updates": int(ema.num_updates) if ema is not None else 0,
                 "rng": ctx.gather_rng(ck.rng_state())}
        if projector is not None:
            state["projector"] = projector.state_dict()
        meta = {**description, "epoch": epoch + 1, "step": step, "metrics": row,
                "preferred_weights": best["weights"] if is_best else "raw"}
        ctx.save(run_dir, f"epoch-{epoch + 1:04d}", wrapped, model, optimizer, state, meta,
                 ema.module.state_dict() if ema is not None else None,
                 links=("last", "best") if is_best else ("last",))
        if ctx.is_main:
            ck.atomic_write(run_dir / "metrics.jsonl", "".join(json.dumps(m) + "\n" for m in metrics).encode())
            if "val_top1" in row:
                plot_curves([m for m in metrics if "val_top1" in m], run_dir / "curves.png")
            ema_txt = f"  ema {row['ema_val_top1']:.2f}%" if "ema_val_top1" in row else ""
            val_txt = f"  val top-1 {row['val_top1']:.2f}%{ema_txt}" if "val_top1" in row else ""
            _say(cfg, ctx, f"epoch {epoch + 1}/{cfg.epochs}  loss {train_loss:.4f}{val_txt}  "
                           f"lr {row['lr']:.2e}  {row['img_per_s']:,.0f} img/s  {epoch_time:.1f}s"
                           + ("  *" if is_best else ""))

    # ---- test with the best checkpoint's preferred weights
    finished = end_epoch >= cfg.epochs
    test = None
    if finished and bundle.test is not None and ctx.is_main and (run_dir / "best").exists():
        sd, meta = ck.load_weights(run_dir / "best", weights="auto")
        best_model = create_from_description(meta).to(device)
        best_model.load_state_dict(sd)
        test = evaluate_model(best_model, bundle.loader("test", batch_size=max(cfg.batch_size, 256)), device,
                              bundle.num_classes, cfg.amp)
    summary = {"model": cfg.model, "dataset": bundle.name, "epochs": cfg.epochs, "epochs_done": end_epoch,
               "finished": finished, "best_val_top1": best["val_top1"] if best["epoch"] else None,
               "best_epoch": best["epoch"], "best_weights": best["weights"],
               "test_top1": test["top1"] if test else None, "test_top5": test["top5"] if test else None,
               "wall_time_s": time.perf_counter() - t_start, "params_m": num_params / 1e6,
               "img_size": bundle.img_size, "global_batch": global_batch, "world_size": ctx.world_size,
               "strategy": ctx.strategy, "device": str(device), "run_dir": str(run_dir)}
    if ctx.is_main:
        ck.atomic_write(run_dir / "summary.json", json.dumps(summary, indent=2).encode())
        if finished:
            test_txt = f"test top-1 {summary['test_top1']:.2f}%  " if test else ""
            val_txt = f"best val top-1 {summary['best_val_top1']:.2f}% (epoch {best['epoch']}, {best['weights']})"
            _say(cfg, ctx, f"done: {cfg.model} on {bundle.name}: {test_txt}{val_txt}  "
                           f"{summary['wall_time_s']:.0f}s  run dir {run_dir}", always=True)
        else:
            _say(cfg, ctx, f"stopped after epoch {end_epoch}/{cfg.epochs}; continue with: vitlab train --resume "
                           f"{run_dir}", always=True)
    return summary


__all__ = ["fit", "evaluate_model", "build_data", "create_from_description", "DataConfig", "TIME_KEYS"]
