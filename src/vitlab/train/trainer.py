"""``Trainer``: runs a :class:`~vitlab.train.task.Task` under a :mod:`strategy <vitlab.train.strategy>` --
setup, resume, train an epoch, validate, save -- and ``fit(TrainConfig) -> summary``.

The run directory holds ``config.yaml`` (the resolved config), ``metrics.jsonl`` (one line per epoch),
``curves.png``, ``last`` / ``best`` checkpoints (see :mod:`vitlab.train.checkpoint`) and ``summary.json``. A
fresh run that fails or is interrupted before its first checkpoint removes the directory it created; Ctrl-C
says which epoch the run can resume from.

Exact resume: the trainer state stores optimiser, scheduler, scaler, EMA, epoch, step and every RNG state at the
end of an epoch, and the training loader's shuffle is seeded with (seed, epoch); so on CPU a resumed run
repeats the straight run's arithmetic step for step. ``fit(TrainConfig(resume=RUN))`` takes every field it
leaves at its default from the run's own ``config.yaml`` (model, data, recipe), as ``vitlab train --resume RUN``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import shutil
import time
from dataclasses import replace
from datetime import datetime
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from vitlab._console import metric_text
from vitlab.convert import CheckpointError
from vitlab.data import DataConfig
from vitlab.train import checkpoint as ck
from vitlab.train.common import add_sums, autocast
from vitlab.train.config import TrainConfig
from vitlab.train.plots import curves_png
from vitlab.train.progress import Progress, say
from vitlab.train.recipe import ModelEma, build_optimizer, scaled_lr
from vitlab.train.strategy import Strategy, create_strategy
from vitlab.train.task import Task, create_task

TIME_KEYS = ("epoch_time_s", "img_per_s", "wall_time_s")  # metrics that differ between identical runs


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def default_run_dir(cfg: TrainConfig) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    base = Path("runs") / f"{cfg.task}-{cfg.model}-{cfg.data.name}-{stamp}"
    path, i = base, 1
    while path.exists():
        i += 1
        path = base.with_name(f"{base.name}-{i}")
    return path


# what may change when a run is resumed: its length, how it is watched and where it runs; everything else would
# make the checkpoint's weights or optimiser state meaningless (another model, data, task or recipe)
RESUME_MAY_CHANGE = ("epochs", "stop_after", "eval_every", "quiet", "device", "threads", "test_weights", "resume",
                     "output_dir")


def resume_config(cfg: TrainConfig) -> TrainConfig:
    """The config a resumed run continues with: the run's own ``config.yaml``, with the fields of
    ``RESUME_MAY_CHANGE`` that ``cfg`` sets to something other than their default on top. Another value of any
    other field (the model, the data, the task, the recipe) is refused in one line."""
    run = Path(cfg.resume)
    if not (run / "config.yaml").is_file():
        raise FileNotFoundError(f"no run to resume at {run} (expected {run / 'config.yaml'})")
    saved = TrainConfig.load(run / "config.yaml")
    default = TrainConfig.for_task(cfg.task)
    changed = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(TrainConfig)
               if getattr(cfg, f.name) != getattr(default, f.name)}
    if cfg.task == default.task and cfg.task != saved.task:  # the task left at its default: the run's
        changed.pop("task", None)
        changed.pop("task_args", None)
    refused = [k for k, v in changed.items()
               if k not in RESUME_MAY_CHANGE and _differs(v, getattr(saved, k), getattr(default, k))]
    if refused:
        k = refused[0]
        raise ValueError(f"{run} was trained with {k}={_show(getattr(saved, k))}; a resumed run cannot change "
                         f"{', '.join(refused)} (it may change {', '.join(RESUME_MAY_CHANGE[:-2])})")
    changed = {k: v for k, v in changed.items() if k in RESUME_MAY_CHANGE}
    changed.update(resume=str(run), output_dir=str(run))
    return replace(saved, **changed)


def _differs(given, saved, default) -> bool:
    """Whether ``given`` asks for something other than ``saved``: for a nested config, one of the fields it sets
    (to other than its default) differs (the data's worker count may change)."""
    if dataclasses.is_dataclass(given) and type(given) is type(saved) is type(default):
        return any(_differs(getattr(given, f.name), getattr(saved, f.name), getattr(default, f.name))
                   for f in dataclasses.fields(given) if f.name != "num_workers"
                   and getattr(given, f.name) != getattr(default, f.name))
    return given != saved


def _show(value) -> str:
    from vitlab.train.config import to_plain

    return json.dumps(to_plain(value)) if not isinstance(value, str) else value


def _batch_size(batch) -> int:
    first = batch
    while isinstance(first, (tuple, list)):  # (images, labels), or ([view1, view2, ...], labels)
        first = first[0]
    return int(first.shape[0])


class Trainer:
    """The engine: ``Trainer(cfg).fit()`` (``setup`` -> per epoch ``train_epoch`` + ``validate`` + ``save``).

    It knows no model: the :class:`Task` named by ``cfg.task`` builds the modules and computes losses and
    metrics; the strategy places them (one device, DDP, FSDP2)."""

    def __init__(self, cfg: TrainConfig, task: Task | None = None):
        cfg.validate()
        self.cfg = cfg
        self.task = task
        self.t_start = time.perf_counter()

    # ---------------------------------------------------------------- setup
    def _run_dir(self) -> Path:
        cfg = self.cfg
        if cfg.resume:
            run_dir = Path(cfg.resume)
            if not run_dir.is_dir():
                raise FileNotFoundError(f"run directory to resume not found: {run_dir}")
            if not (run_dir / "last").exists():
                raise CheckpointError(f"{run_dir} has no 'last' checkpoint to resume from")
        else:
            run_dir = Path(cfg.output_dir) if cfg.output_dir else default_run_dir(cfg)
            if (run_dir / "last").exists():
                raise ValueError(f"{run_dir} already holds a run; pass --resume {run_dir} to continue it, or choose "
                                 f"another --output-dir")
        return self.strategy.broadcast_path(run_dir)

    def setup(self) -> None:
        cfg, st = self.cfg, self.strategy
        self.run_dir = self._run_dir()
        # data and modules: identical initialisation on every rank, then per-rank augmentation streams
        seed_everything(cfg.seed)
        if self.task is None:
            self.task = create_task(cfg.task)
        task = self.task
        task.build(cfg, st.device)
        self.ema = ModelEma(task.model, cfg.ema_decay, cfg.ema_warmup) if cfg.ema_decay > 0 else None

        self.global_batch = cfg.batch_size * cfg.accum_steps * st.world_size
        self.steps_per_epoch = len(self._train_loader(0)) // cfg.accum_steps
        if self.steps_per_epoch < 1:
            raise ValueError(f"the training split ({len(task.data.train)} images) gives no optimiser step at batch "
                             f"{cfg.batch_size} x accum {cfg.accum_steps} x {st.world_size} processes")
        self.wrapped = st.wrap(task.module, cfg.amp)
        if self.ema is not None:
            st.prepare_ema(self.ema.module, cfg.amp)
        self.base_lr = scaled_lr(cfg.lr, self.global_batch)
        self.optimizer = build_optimizer(task.param_groups(cfg.weight_decay), self.base_lr, cfg.betas)
        self.scheduler = task.scheduler(self.optimizer, total_steps=self.steps_per_epoch * cfg.epochs,
                                        warmup_steps=round(self.steps_per_epoch * cfg.warmup_epochs),
                                        base_lr=self.base_lr, min_lr=scaled_lr(cfg.min_lr, self.global_batch),
                                        warmup_lr=scaled_lr(cfg.warmup_lr, self.global_batch))
        self.scaler = torch.amp.GradScaler(st.device.type, enabled=cfg.amp == "fp16")
        self.forward = torch.compile(self.wrapped) if cfg.compile else self.wrapped
        self.start_epoch, self.step = 0, 0
        self.saved_epoch = 0  # the epoch of the last checkpoint (0: none yet)
        self.best = {"monitor": None, "epoch": None, "weights": "raw"}
        self.metrics: list[dict] = []

    def _train_loader(self, epoch: int):
        d = self.cfg.data
        return self.strategy.train_loader(self.task.data.train, self.cfg.batch_size, epoch, d.seed, d.num_workers)

    # ---------------------------------------------------------------- checkpoints
    def _split(self, sd: dict) -> tuple[dict, dict]:
        """A full state dict of the task's module -> (model weights, {extra module name: its state})."""
        if self.task.module is self.task.model:
            return sd, {}
        model_sd, extras = {}, {}
        for k, v in sd.items():
            head, _, rest = k.partition(".")
            if head == "model":
                model_sd[rest] = v
            else:
                extras.setdefault(head, {})[rest] = v
        return model_sd, extras

    def _load_split(self, module: nn.Module, model_sd: dict, state: dict) -> None:
        self.task.model.load_state_dict(model_sd)
        if module is not self.task.model:
            for name, child in module.named_children():
                if name != "model" and name in state:
                    child.load_state_dict(state[name])

    def resume(self) -> dict | None:
        """Restore everything from the run's ``last`` checkpoint; returns this rank's RNG state to restore."""
        cfg = self.cfg
        last = ck.resolve_checkpoint_dir(self.run_dir, prefer="last")
        state = ck.load_trainer_state(last)
        self.strategy.load(last, self.task.module, self.optimizer, state, self._load_split,
                           self.ema.module if self.ema is not None else None)
        if self.ema is not None:
            self.ema.num_updates.fill_(int(state.get("ema_updates", 0)))
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.start_epoch, self.step = int(state["epoch"]), int(state["step"])
        self.saved_epoch = self.start_epoch
        best = dict(state["best"])
        if best["epoch"] is None:
            best["monitor"] = None
        self.best = best
        metrics_file = self.run_dir / "metrics.jsonl"
        if metrics_file.is_file():
            rows = [json.loads(line) for line in metrics_file.read_text().splitlines() if line]
            self.metrics = [m for m in rows if m["epoch"] <= self.start_epoch]
        if self.start_epoch >= cfg.epochs:
            self.say(f"{self.run_dir} already finished {self.start_epoch} of {cfg.epochs} epochs", always=True)
        else:
            self.say(f"resuming {self.run_dir} from epoch {self.start_epoch}/{cfg.epochs}")
        rng = state["rng"]
        return rng[min(self.strategy.rank, len(rng) - 1)] if isinstance(rng, list) else rng

    def save(self, epoch: int, row: dict, is_best: bool) -> None:
        ema = self.ema
        state = {"epoch": epoch, "step": self.step, "best": self.best, "scheduler": self.scheduler.state_dict(),
                 "scaler": self.scaler.state_dict(), "ema_updates": int(ema.num_updates) if ema is not None else 0,
                 "rng": self.strategy.gather_rng(ck.rng_state())}
        meta = {**self.task.record().to_meta(), "epoch": epoch, "step": self.step, "metrics": row,
                "preferred_weights": self.best["weights"] if is_best else "raw"}
        self.strategy.save(self.run_dir, f"epoch-{epoch:04d}", self.task.module, self.optimizer, state, meta,
                           self._split, ema.module if ema is not None else None,
                           links=("last", "best") if is_best else ("last",))
        self.saved_epoch = epoch

    # ---------------------------------------------------------------- epochs
    def train_epoch(self, epoch: int, progress: Progress) -> dict:
        cfg, st, task = self.cfg, self.strategy, self.task
        self.wrapped.train()
        loader = self._train_loader(epoch)
        n_micro = self.steps_per_epoch * cfg.accum_steps
        t0 = time.perf_counter()
        loss_sum, seen = 0.0, 0
        progress.start(epoch + 1, cfg.epochs, self.steps_per_epoch)
        self.optimizer.zero_grad(set_to_none=True)
        for i, batch in enumerate(loader):
            if i >= n_micro:
                break
            sync_now = (i + 1) % cfg.accum_steps == 0
            with st.no_sync(self.wrapped, not sync_now), autocast(st.device, cfg.amp):
                loss, _ = task.training_step(batch, self.forward)
            if not math.isfinite(loss.item()):
                raise FloatingPointError(f"loss is {loss.item()} at epoch {epoch + 1}, step {self.step}; lower "
                                         f"--lr or use --amp bf16 instead of fp16")
            self.scaler.scale(loss / cfg.accum_steps).backward()
            n = _batch_size(batch)
            loss_sum += loss.item() * n
            seen += n
            if sync_now:
                if cfg.clip_grad:
                    self.scaler.unscale_(self.optimizer)
                    params = [p for g in self.optimizer.param_groups for p in g["params"]]
                    st.clip_grad_norm(params, cfg.clip_grad)
                task.before_optimizer_step()
                self.scaler.step(self.optimizer)
                self.scaler.update()
                self.optimizer.zero_grad(set_to_none=True)
                self.scheduler.step()
                self.step += 1
                if self.ema is not None:
                    self.ema.update(task.model)
                task.after_step(self.step - 1, self.steps_per_epoch * cfg.epochs, self.steps_per_epoch)
                progress.update(loss.item(), seen * st.world_size / (time.perf_counter() - t0))
        progress.stop()
        epoch_time = time.perf_counter() - t0
        return {"epoch": epoch + 1, "step": self.step, "train_loss": st.mean(loss_sum / max(seen, 1)),
                "lr": self.optimizer.param_groups[0]["lr"], "img_per_s": seen * st.world_size / epoch_time,
                "epoch_time_s": epoch_time}

    @torch.no_grad()
    def validate(self, module: nn.Module) -> dict:
        """The task's validation metrics of ``module`` on the val split (summed over every rank's slice)."""
        cfg, st, task = self.cfg, self.strategy, self.task
        was_training = module.training
        module.eval()
        sums = None
        for batch in st.eval_loader(task.data.val, max(cfg.batch_size, 256), cfg.data.num_workers):
            with autocast(st.device, cfg.amp):
                sums = add_sums(sums, task.validation_step(batch, module))
        module.train(was_training)
        return task.validation_metrics(st.sum_tensors(sums))

    # ---------------------------------------------------------------- fit
    def say(self, msg: str, always: bool = False) -> None:
        """Print on rank 0; quiet mode keeps only the lines marked ``always`` (the one-line summary)."""
        if self.strategy.is_main and (always or not self.cfg.quiet):
            say(msg)

    def fit(self) -> dict:
        """Train and return the summary (also written to ``RUN/summary.json``)."""
        cfg = self.cfg
        old_threads = None
        self.strategy: Strategy = create_strategy(cfg.strategy, cfg.device)
        try:
            if cfg.threads and self.strategy.device.type == "cpu":
                old_threads = torch.get_num_threads()
                torch.set_num_threads(cfg.threads)
            return self._fit()
        finally:
            if old_threads is not None:
                torch.set_num_threads(old_threads)  # fit leaves the process as it found it
            self.strategy.close()

    def _fit(self) -> dict:
        cfg, st = self.cfg, self.strategy
        self.setup()
        rng_to_restore = self.resume() if cfg.resume else None
        run_dir = self.run_dir
        # the directories a fresh run creates: one that fails before its first checkpoint takes them away again,
        # rather than leave a stub run (a config and no weights) that looks like a run to resume
        made = [] if cfg.resume or not st.is_main else [p for p in (run_dir, *run_dir.parents) if not p.exists()]
        try:
            return self._train(rng_to_restore)
        except BaseException:
            if made and not (run_dir / "last").exists():
                shutil.rmtree(made[0], ignore_errors=True)
                for parent in made[1:]:  # e.g. runs/, unless another run has appeared in it meanwhile
                    try:
                        parent.rmdir()
                    except OSError:
                        break
            raise

    def _train(self, rng_to_restore: dict | None) -> dict:
        cfg, st = self.cfg, self.strategy
        task, run_dir = self.task, self.run_dir
        if st.is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
            # the resolved config, reusable as --config for a new run (so without this run's directory)
            resolved = task.record().data
            cfg_out = replace(cfg, resume=None, output_dir=None, stop_after=None,
                              data=DataConfig(**resolved) if resolved else cfg.data)
            cfg_out.save(run_dir / "config.yaml")
            self._write_metrics()
        if rng_to_restore is not None:
            ck.set_rng_state(rng_to_restore)
        else:
            seed_everything(cfg.seed + st.rank)  # augmentation / drop-path streams differ per rank

        info = task.summary()
        self.say(f"training {info.get('model', cfg.model)} ({info.get('params_m', 0):.3f}M params) on "
                 f"{info.get('dataset', cfg.data.dataset)} ({info.get('train_images', '?')} train / "
                 f"{info.get('val_images', '?')} val images, {info.get('img_size', '?')}px) "
                 f"for {cfg.epochs} epochs, {self.steps_per_epoch} steps/epoch, global batch {self.global_batch}, "
                 f"lr {self.base_lr:.2e}, {st.device}{'' if st.world_size == 1 else f' x{st.world_size}'} "
                 f"-> {run_dir}")
        end_epoch = cfg.epochs if cfg.stop_after is None else min(cfg.epochs, cfg.stop_after)
        try:
            # leaving the block stops a live bar, so a failed or interrupted epoch leaves none over what follows
            with Progress(enabled=st.is_main and not cfg.quiet) as progress:
                for epoch in range(self.start_epoch, end_epoch):
                    self._epoch(epoch, end_epoch, progress)
        except KeyboardInterrupt:
            # each epoch ends with a checkpoint, so the interrupted one is the one after the last checkpoint
            saved = self.saved_epoch
            where = f"interrupted in epoch {min(saved + 1, cfg.epochs)}/{cfg.epochs}; "
            self.say(where + (f"the last checkpoint is epoch {saved}; continue with: vitlab train --resume {run_dir}"
                              if saved else "no checkpoint yet, nothing to resume"), always=True)
            raise
        return self._finish(end_epoch, info)

    def _epoch(self, epoch: int, end_epoch: int, progress: Progress) -> None:
        """Train epoch ``epoch`` (0-based), validate when due, save the checkpoint and the metrics, say the line."""
        cfg, st, task, run_dir = self.cfg, self.strategy, self.task, self.run_dir
        mon = task.monitor
        row = self.train_epoch(epoch, progress)
        is_best = False
        if (epoch + 1) % cfg.eval_every == 0 or epoch + 1 == end_epoch or epoch + 1 == cfg.epochs:
            r = self.validate(self.wrapped)
            row.update({f"val_{k}": v for k, v in r.items()})
            candidates = [("raw", r[mon])]
            if self.ema is not None:
                e = self.validate(self.ema.module)
                row.update({f"ema_val_{k}": v for k, v in e.items()})
                candidates.append(("ema", e[mon]))
            lower = task.monitor_mode == "min"
            pick = min if lower else max
            which, value = pick(candidates, key=lambda c: c[1])  # ties keep the raw weights
            old = self.best["monitor"]
            if old is None or (value < old if lower else value > old):
                is_best = True
                self.best = {"monitor": value, "epoch": epoch + 1, "weights": which}
        self.metrics.append(row)
        self.save(epoch + 1, row, is_best)
        if st.is_main:
            self._write_metrics()
            if f"val_{mon}" in row:
                ck.atomic_write(run_dir / "curves.png",
                                curves_png([m for m in self.metrics if f"val_{mon}" in m], mon))
            ema_txt = f"  ema {metric_text(mon, row[f'ema_val_{mon}'])}" if f"ema_val_{mon}" in row else ""
            val_txt = f"  val {mon} {metric_text(mon, row[f'val_{mon}'])}{ema_txt}" if f"val_{mon}" in row else ""
            self.say(f"epoch {epoch + 1}/{cfg.epochs}  loss {row['train_loss']:.4f}{val_txt}  "
                     f"lr {row['lr']:.2e}  {row['img_per_s']:,.0f} img/s  {row['epoch_time_s']:.1f}s"
                     + ("  *" if is_best else ""))

    def _write_metrics(self) -> None:
        ck.atomic_write(self.run_dir / "metrics.jsonl",
                        "".join(json.dumps(m) + "\n" for m in self.metrics).encode())

    def _finish(self, end_epoch: int, info: dict) -> dict:
        cfg, st, task, best = self.cfg, self.strategy, self.task, self.best
        finished = end_epoch >= cfg.epochs
        test = {}
        if finished and st.is_main:
            test = task.test(self.run_dir, max(cfg.batch_size, 256), cfg.test_weights)
        mon = task.monitor
        summary = {"task": cfg.task, "model": info.get("model", cfg.model), "dataset": info.get("dataset"),
                   "epochs": cfg.epochs, "epochs_done": end_epoch, "finished": finished,
                   f"best_val_{mon}": best["monitor"],
                   "best_epoch": best["epoch"], "best_weights": best["weights"], "test_weights": cfg.test_weights,
                   **test,
                   "wall_time_s": time.perf_counter() - self.t_start,
                   **{k: v for k, v in info.items() if k not in ("model", "dataset", "train_images", "val_images")},
                   "global_batch": self.global_batch, "world_size": st.world_size, "strategy": st.name,
                   **st.summary(), "device": str(st.device), "run_dir": str(self.run_dir)}
        if st.is_main:
            ck.atomic_write(self.run_dir / "summary.json", json.dumps(summary, indent=2).encode())
            if finished:
                t = test.get(f"test_{mon}")
                test_txt = f"test {mon} {metric_text(mon, t)}  " if t is not None else ""
                val_txt = (f"best val {mon} {metric_text(mon, summary[f'best_val_{mon}'])} (epoch {best['epoch']}, "
                           f"{best['weights']})" if best["epoch"] else "")
                self.say(f"done: {summary['model']} on {summary['dataset']}: {test_txt}{val_txt}  "
                         f"{summary['wall_time_s']:.0f}s  run dir {self.run_dir}", always=True)
            else:
                self.say(f"stopped after epoch {end_epoch}/{cfg.epochs}; continue with: vitlab train --resume "
                         f"{self.run_dir}", always=True)
        return summary


def fit(cfg: TrainConfig) -> dict:
    """Train ``cfg.task`` (default: classify ``cfg.model`` on ``cfg.data``) and return the summary (also written
    to ``RUN/summary.json``). With ``cfg.resume`` the run continues with its own config (see
    :func:`resume_config`)."""
    if cfg.resume:
        cfg = resume_config(cfg)
    return Trainer(cfg).fit()


__all__ = ["TIME_KEYS", "Trainer", "fit", "resume_config", "seed_everything"]
