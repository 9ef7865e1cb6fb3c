"""``Trainer``: runs a :class:`~vitlab.train.task.Task` under a :mod:`strategy <vitlab.train.strategy>` --
setup, resume, train an epoch, validate, save -- with :mod:`callbacks <vitlab.train.callbacks>` around the loop,
and ``fit(TrainConfig) -> summary``.

The run directory holds ``config.yaml`` (the resolved config), ``metrics.jsonl`` (a line per optimiser step: loss,
learning rate, gradient norm, images/s, tokens/s, step time, data-wait share, MFU, peak memory; and a line per
epoch: its training loss and validation metrics; see :mod:`vitlab.train.metrics_file` and :mod:`vitlab.train.mfu`),
``curves.png``, ``last`` / ``best`` checkpoints (see :mod:`vitlab.train.checkpoint`) and ``summary.json``;
``--log`` adds trackers (:mod:`vitlab.train.trackers`) that receive the same figures.
A fresh run that fails or is interrupted before its first checkpoint removes the directory it created; Ctrl-C
says where the run can resume from.

Checkpoints: at every epoch end, and mid-epoch every ``save_every_steps`` optimiser steps and / or when
``save_every_minutes`` have passed since the last save (rank 0's clock); the newest ``keep_last`` are kept.

Exact resume: the trainer state stores optimiser, scheduler, scaler, EMA, epoch, step, the optimiser steps done in
the unfinished epoch (with its loss sums) and every RNG state, and the training loader's shuffle is seeded with
(seed, epoch); a run resumed mid-epoch rebuilds that epoch's order and starts after the batches already done
(a stream restores its own position, see :func:`vitlab.train.strategy.make_loader`). So on CPU with loader workers
off a resumed run repeats the straight run's arithmetic step for step. (With workers, each worker's augmentation
stream starts afresh at the resumed position: the order of the samples is the same, their random crops differ.)
``fit(TrainConfig(resume=RUN))`` takes every field it leaves at its default from the run's own ``config.yaml``
(model, data, recipe), as ``vitlab train --resume RUN``.
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
from vitlab.data import DataConfig
from vitlab.train import checkpoint as ck
from vitlab.train.callbacks import Callback, Callbacks
from vitlab.train.common import add_sums, autocast
from vitlab.train.config import TrainConfig
from vitlab.train.metrics_file import METRICS_FILE, MetricsWriter, read_metrics
from vitlab.train.mfu import Meter, model_flops, peak_tflops
from vitlab.train.plots import curves_png
from vitlab.train.progress import Progress, say
from vitlab.train.recipe import ModelEma, build_optimizer, scaled_lr
from vitlab.train.strategy import Strategy, create_strategy, loader_state
from vitlab.train.task import Task, create_task
from vitlab.train.trackers import create_trackers

# metrics that differ between identical runs (timing, throughput, memory)
TIME_KEYS = ("epoch_time_s", "img_per_s", "wall_time_s", "tokens_per_s", "step_time_s", "data_wait", "mfu",
             "peak_rss_gb", "peak_mem_allocated_gb", "peak_mem_reserved_gb")


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
# (accum_steps: to keep the global batch when the number of processes changes)
RESUME_MAY_CHANGE = ("epochs", "stop_after", "eval_every", "quiet", "device", "threads", "test_weights", "log",
                     "mlflow_uri", "save_every_steps", "save_every_minutes", "keep_last", "accum_steps", "resume",
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
    """The engine: ``Trainer(cfg, callbacks=[...]).fit()`` (``setup`` -> per epoch ``train_epoch`` + ``validate`` +
    ``save``, step checkpoints between).

    It knows no model: the :class:`Task` named by ``cfg.task`` builds the modules and computes losses and
    metrics; the strategy places them (one device, DDP, FSDP2). ``callbacks`` (:class:`~vitlab.train.Callback`)
    run on every process, beside the trackers ``cfg.log`` names (rank 0)."""

    def __init__(self, cfg: TrainConfig, task: Task | None = None, callbacks: list[Callback] | None = None):
        cfg.validate()
        self.cfg = cfg
        self.task = task
        self.user_callbacks = list(callbacks or [])
        self.t_start = time.perf_counter()

    # ---------------------------------------------------------------- setup
    def _run_dir(self) -> Path:
        cfg = self.cfg
        if cfg.resume:
            run_dir = Path(cfg.resume)
            if not run_dir.is_dir():
                raise FileNotFoundError(f"run directory to resume not found: {run_dir}")
            ck.resume_checkpoint(run_dir)  # one line when it holds no checkpoint to resume from
        else:
            run_dir = Path(cfg.output_dir) if cfg.output_dir else default_run_dir(cfg)
            if ck.find_checkpoint(run_dir) is not None:
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
        try:
            batches = len(self._train_loader(0))
        except TypeError:  # a stream without a length
            raise ValueError("the training data is a stream without a length; give it an epoch length (samples "
                             "per epoch) so the schedule can be planned") from None
        self.steps_per_epoch = batches // cfg.accum_steps
        if self.steps_per_epoch < 1:
            raise ValueError(f"the training split ({len(task.data.train)} images) gives no optimiser step at batch "
                             f"{cfg.batch_size} x accum {cfg.accum_steps} x {st.world_size} processes")
        self.meter = self._meter()
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
        self.epoch_steps = 0        # optimiser steps already done in start_epoch (a run resumed mid-epoch)
        self.epoch_sums: dict = {}  # that epoch's loss sums so far
        self.loader_state = None    # a resumable stream's position in that epoch
        self.loader = None
        self.saved = (0, 0, False)  # the last checkpoint: (epochs done, step, mid-epoch)
        self.last_save_time = time.perf_counter()
        self.best = {"monitor": None, "epoch": None, "weights": "raw"}
        self.metrics: list[dict] = []

    def _meter(self) -> Meter:
        """The step figures' meter: the model's training FLOPs per image (3 x forward) and tokens per image,
        counted once at the run's input size, and the device's peak."""
        st, rec = self.strategy, self.task.record()
        flops = tokens = None
        if rec.img_size:
            try:
                fwd, tokens = model_flops(self.task.model, rec.in_chans, int(rec.img_size), st.device)
                flops = 3 * fwd
            except Exception as e:  # a model the counter cannot trace: the run goes on without MFU
                self.say(f"warning: cannot count the model's FLOPs ({type(e).__name__}: {e}); no MFU")
        peak, self.peak_source = peak_tflops(st.device, self.cfg.amp)
        return Meter(st.device, st.world_size, flops, tokens, peak * 1e12 if peak else None)

    def _train_loader(self, epoch: int, skip: int = 0, state: dict | None = None):
        d = self.cfg.data
        return self.strategy.train_loader(self.task.data.train, self.cfg.batch_size, epoch, d.seed, d.num_workers,
                                          skip=skip, state=state)

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
        cfg, st = self.cfg, self.strategy
        last = ck.resume_checkpoint(self.run_dir)
        state = ck.load_trainer_state(last)
        st.load(last, self.task.module, self.optimizer, state, self._load_split,
                self.ema.module if self.ema is not None else None)
        if self.ema is not None:
            self.ema.num_updates.fill_(int(state.get("ema_updates", 0)))
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.start_epoch, self.step = int(state["epoch"]), int(state["step"])
        self.epoch_steps = min(int(state.get("epoch_steps", 0)), self.steps_per_epoch - 1)
        same_world = int(state.get("world_size", st.world_size)) == st.world_size

        def mine(per_rank):  # this rank's entry of a per-rank list (the last rank's when there are fewer)
            return per_rank[min(st.rank, len(per_rank) - 1)] if isinstance(per_rank, list) else per_rank

        if self.epoch_steps:
            self.epoch_sums = dict(mine(state["epoch_sums"]))
            self.loader_state = mine(state.get("loader")) if same_world else None
        self.saved = (self.start_epoch, self.step, bool(self.epoch_steps))
        best = dict(state["best"])
        if best["epoch"] is None:
            best["monitor"] = None
        self.best = best
        if (self.run_dir / METRICS_FILE).is_file():
            self.metrics = [m for m in read_metrics(self.run_dir, "epoch") if m["epoch"] <= self.start_epoch]
        if self.start_epoch >= cfg.epochs:
            self.say(f"{self.run_dir} already finished {self.start_epoch} of {cfg.epochs} epochs", always=True)
        elif self.epoch_steps:
            self.say(f"resuming {self.run_dir} from step {self.step} (epoch {self.start_epoch + 1}/{cfg.epochs}, "
                     f"step {self.epoch_steps}/{self.steps_per_epoch} of the epoch)")
            if not same_world:
                self.say(f"note: the checkpoint was taken with {state['world_size']} processes; the epoch goes on "
                         f"from the same step with {st.world_size}, in another order of its remaining samples")
        else:
            self.say(f"resuming {self.run_dir} from epoch {self.start_epoch}/{cfg.epochs}")
        return mine(state["rng"])

    def _checkpoint(self, name: str, epochs_done: int, state: dict, metrics: dict, is_best: bool) -> None:
        ema = self.ema
        state = {"epoch": epochs_done, "step": self.step, "best": self.best, "scheduler": self.scheduler.state_dict(),
                 "scaler": self.scaler.state_dict(), "ema_updates": int(ema.num_updates) if ema is not None else 0,
                 "rng": self.strategy.gather(ck.rng_state()), "world_size": self.strategy.world_size, **state}
        meta = {**self.task.record().to_meta(), "epoch": epochs_done, "step": self.step, "metrics": metrics,
                "preferred_weights": self.best["weights"] if is_best else "raw"}
        self.strategy.save(self.run_dir, name, self.task.module, self.optimizer, state, meta, self._split,
                           ema.module if ema is not None else None,
                           links=("last", "best") if is_best else ("last",), keep_last=self.cfg.keep_last)
        self.last_save_time = time.perf_counter()

    def save(self, epoch: int, row: dict, is_best: bool) -> None:
        """The checkpoint at the end of epoch ``epoch`` (1-based)."""
        self._checkpoint(f"epoch-{epoch:04d}", epoch, {"epoch_steps": 0}, row, is_best)
        self.saved = (epoch, self.step, False)

    def save_step(self, epoch: int, epoch_steps: int, sums: dict) -> None:
        """A mid-epoch checkpoint after ``epoch_steps`` optimiser steps of epoch ``epoch`` (0-based): what resumes
        the epoch exactly -- the steps done, the epoch's loss sums and a stream's position, per rank."""
        st = self.strategy
        state = {"epoch_steps": epoch_steps, "epoch_sums": st.gather(dict(sums)),
                 "loader": st.gather(loader_state(self.loader))}
        self._checkpoint(f"step-{self.step:08d}", epoch, state, {}, False)
        self.saved = (epoch, self.step, True)

    def _save_due(self) -> bool:
        cfg = self.cfg
        if cfg.save_every_steps and self.step % cfg.save_every_steps == 0:
            return True
        if cfg.save_every_minutes:
            due = time.perf_counter() - self.last_save_time >= 60 * cfg.save_every_minutes
            return self.strategy.agree(due)
        return False

    # ---------------------------------------------------------------- epochs
    def train_epoch(self, epoch: int, progress: Progress) -> dict:
        """Train epoch ``epoch`` (0-based), from the step a mid-epoch checkpoint left it at; returns its row."""
        cfg, st, task = self.cfg, self.strategy, self.task
        self.wrapped.train()
        resumed = self.epoch_steps if epoch == self.start_epoch else 0
        first = resumed * cfg.accum_steps  # micro-batches already done
        self.loader = self._train_loader(epoch, first, self.loader_state if resumed else None)
        n_micro = self.steps_per_epoch * cfg.accum_steps
        sums = dict(self.epoch_sums) if resumed else {"loss": 0.0, "seen": 0}
        epoch_mark = self.meter.mark()
        t0 = time.perf_counter()
        t_step, wait, step_loss, step_seen = t0, 0.0, 0.0, 0
        progress.start(epoch + 1, cfg.epochs, self.steps_per_epoch)
        progress.done = resumed
        self.optimizer.zero_grad(set_to_none=True)
        batches = iter(self.loader)
        for i in range(first, n_micro):
            t_fetch = time.perf_counter()
            batch = next(batches, None)
            if batch is None:  # a stream that ran out early
                break
            wait += time.perf_counter() - t_fetch
            sync_now = (i + 1) % cfg.accum_steps == 0
            with st.no_sync(self.wrapped, not sync_now), autocast(st.device, cfg.amp):
                loss, _ = task.training_step(batch, self.forward)
            if not math.isfinite(loss.item()):
                raise FloatingPointError(f"loss is {loss.item()} at epoch {epoch + 1}, step {self.step}; lower "
                                         f"--lr or use --amp bf16 instead of fp16")
            self.scaler.scale(loss / cfg.accum_steps).backward()
            n = _batch_size(batch)
            sums["loss"] += loss.item() * n
            sums["seen"] += n
            step_loss += loss.item() * n
            step_seen += n
            if not sync_now:
                continue
            params = [p for g in self.optimizer.param_groups for p in g["params"]]
            self.scaler.unscale_(self.optimizer)  # the gradient norm in true units (fp16: before the scaler's step)
            grad_norm = st.clip_grad_norm(params, cfg.clip_grad) if cfg.clip_grad else st.grad_norm(params)
            task.before_optimizer_step()
            lr = self.optimizer.param_groups[0]["lr"]
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
            self.step += 1
            if self.ema is not None:
                self.ema.update(task.model)
            task.after_step(self.step - 1, self.steps_per_epoch * cfg.epochs, self.steps_per_epoch)
            now = time.perf_counter()
            scalars = {"loss": step_loss / max(step_seen, 1), "lr": lr, "grad_norm": grad_norm,
                       **self.meter.step(step_seen, now - t_step, wait)}
            progress.update(scalars["loss"], sums["seen"] * st.world_size / (now - t0))
            self._step_end(epoch + (i + 1) / n_micro, scalars)
            if i + 1 < n_micro and self._save_due():
                self.save_step(epoch, (i + 1) // cfg.accum_steps, sums)
            t_step, wait, step_loss, step_seen = time.perf_counter(), 0.0, 0.0, 0
        progress.stop()
        self.loader = None
        epoch_time = time.perf_counter() - t0
        figures = {k: v for k, v in self.meter.totals(since=epoch_mark).items() if k != "img_per_s"}
        return {"epoch": epoch + 1, "step": self.step, "train_loss": st.mean(sums["loss"] / max(sums["seen"], 1)),
                "lr": self.optimizer.param_groups[0]["lr"], "img_per_s": sums["seen"] * st.world_size / epoch_time,
                "epoch_time_s": epoch_time, **figures}

    def _step_end(self, epoch: float, scalars: dict) -> None:
        """The step's line of ``metrics.jsonl`` (rank 0), then the callbacks' ``on_step_end``."""
        if self.metrics_file is not None:
            self.metrics_file.write("step", {"step": self.step, "epoch": round(epoch, 6), **scalars})
        self.callbacks("on_step_end", self, self.step, scalars)

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
        # the trackers' packages and servers are checked before anything starts (no run directory yet)
        trackers = create_trackers(cfg.log, cfg)
        self.strategy: Strategy = create_strategy(cfg.strategy, cfg.device)
        self.callbacks = Callbacks(self.user_callbacks + (trackers if self.strategy.is_main else []))
        self.metrics_file: MetricsWriter | None = None  # rank 0's
        try:
            if cfg.threads and self.strategy.device.type == "cpu":
                old_threads = torch.get_num_threads()
                torch.set_num_threads(cfg.threads)
            return self._fit()
        finally:
            if self.metrics_file is not None:
                self.metrics_file.close()
            if old_threads is not None:
                torch.set_num_threads(old_threads)  # fit leaves the process as it found it
            self.strategy.close()

    def _fit(self) -> dict:
        cfg, st = self.cfg, self.strategy
        self.setup()
        rng_to_restore = self.resume() if cfg.resume else None
        run_dir = self.run_dir
        # what a fresh run creates (its directories, or its files in a directory that was there): a run that fails
        # before its first checkpoint takes them away again, rather than leave a stub run (a config and no
        # weights) that looks like a run to resume
        fresh = st.is_main and not cfg.resume
        made = [p for p in (run_dir, *run_dir.parents) if not p.exists()] if fresh else []
        there = set(run_dir.iterdir()) if fresh and not made else None
        try:
            return self._train(rng_to_restore)
        except BaseException:
            if (made or there is not None) and ck.find_checkpoint(run_dir) is None:
                for p in [made[0]] if made else sorted(set(run_dir.iterdir()) - there):
                    if p.is_dir():
                        shutil.rmtree(p, ignore_errors=True)
                    else:
                        p.unlink(missing_ok=True)
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
            # a resumed run keeps the lines up to its checkpoint: each step and each epoch is logged once
            self.metrics_file = MetricsWriter(run_dir, (self.step, self.start_epoch) if cfg.resume else None)
        summary = None
        try:
            # before the random streams are seeded or restored: a tracker's start-up may draw from them
            self.callbacks("on_fit_start", self)
            if rng_to_restore is not None:
                ck.set_rng_state(rng_to_restore)
            else:
                seed_everything(cfg.seed + st.rank)  # augmentation / drop-path streams differ per rank
            summary = self._loop()
            return summary
        finally:
            self.callbacks("on_fit_end", self, summary)

    def _loop(self) -> dict:
        cfg, st, run_dir = self.cfg, self.strategy, self.run_dir
        info = self.task.summary()
        # "samples": what a task's datasets hold -- an image, an image-caption pair or a question (several
        # questions may share one image), so no one unit is right for every task
        self.say(f"training {info.get('model', cfg.model)} ({info.get('params_m', 0):.3f}M params) on "
                 f"{info.get('dataset', cfg.data.dataset)} ({info.get('train_images', '?')} train / "
                 f"{info.get('val_images', '?')} val samples, {info.get('img_size', '?')}px) "
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
            # the interrupted epoch is the one after the last checkpoint's completed epochs
            epochs_done, step, mid = self.saved
            where = f"interrupted in epoch {min(epochs_done + 1, cfg.epochs)}/{cfg.epochs}; "
            if not step and not epochs_done:
                self.say(where + "no checkpoint yet, nothing to resume", always=True)
            else:
                at = f"step {step} (epoch {epochs_done + 1})" if mid else f"epoch {epochs_done}"
                self.say(where + f"the last checkpoint is {at}; continue with: vitlab train --resume {run_dir}",
                         always=True)
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
        if st.is_main:  # before the checkpoint: a run killed between the two resumes before this row, drops it
            self.metrics_file.write("epoch", row)
        self.save(epoch + 1, row, is_best)
        self.epoch_steps = 0
        if st.is_main:
            if f"val_{mon}" in row:
                curves = ck.atomic_write(run_dir / "curves.png",
                                         curves_png([m for m in self.metrics if f"val_{mon}" in m], mon))
                self.callbacks("on_image", self, "curves", curves, self.step)
            ema_txt = f"  ema {metric_text(mon, row[f'ema_val_{mon}'])}" if f"ema_val_{mon}" in row else ""
            val_txt = f"  val {mon} {metric_text(mon, row[f'val_{mon}'])}{ema_txt}" if f"val_{mon}" in row else ""
            mfu_txt = f"  MFU {100 * row['mfu']:.1f}%" if "mfu" in row else ""
            self.say(f"epoch {epoch + 1}/{cfg.epochs}  loss {row['train_loss']:.4f}{val_txt}  "
                     f"lr {row['lr']:.2e}  {row['img_per_s']:,.0f} img/s{mfu_txt}  {row['epoch_time_s']:.1f}s"
                     + ("  *" if is_best else ""))
        self.callbacks("on_eval_end", self, epoch + 1, row, dict(self.best))

    def _finish(self, end_epoch: int, info: dict) -> dict:
        cfg, st, task, best = self.cfg, self.strategy, self.task, self.best
        finished = end_epoch >= cfg.epochs
        test = {}
        pictures_before = {p.name: p.stat().st_mtime_ns for p in self.run_dir.glob("*.png")} if st.is_main else {}
        if finished and st.is_main:
            test = task.test(self.run_dir, max(cfg.batch_size, 256), cfg.test_weights)
        mon = task.monitor
        meter = self.meter
        figures = {"train_" + k if k in ("img_per_s", "tokens_per_s") else k: v for k, v in meter.totals().items()}
        summary = {"task": cfg.task, "model": info.get("model", cfg.model), "dataset": info.get("dataset"),
                   "epochs": cfg.epochs, "epochs_done": end_epoch, "finished": finished,
                   f"best_val_{mon}": best["monitor"],
                   "best_epoch": best["epoch"], "best_weights": best["weights"], "test_weights": cfg.test_weights,
                   **test,
                   "wall_time_s": time.perf_counter() - self.t_start, **figures,
                   "gmacs_per_image": meter.train_flops / 6e9 if meter.train_flops else None,
                   "tokens_per_image": meter.tokens,
                   "peak_tflops": meter.peak / 1e12 if meter.peak else None, "peak_source": self.peak_source,
                   **{k: v for k, v in info.items() if k not in ("model", "dataset", "train_images", "val_images")},
                   "global_batch": self.global_batch, "world_size": st.world_size, "strategy": st.name,
                   **st.summary(), "device": str(st.device), "run_dir": str(self.run_dir)}
        if st.is_main:
            ck.atomic_write(self.run_dir / "summary.json", json.dumps(summary, indent=2).encode())
            for p in sorted(self.run_dir.glob("*.png")):  # the task's pictures of the finished run
                if p.name != "curves.png" and pictures_before.get(p.name) != p.stat().st_mtime_ns:
                    self.callbacks("on_image", self, p.stem, p, self.step)
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


def fit(cfg: TrainConfig, callbacks: list[Callback] | None = None) -> dict:
    """Train ``cfg.task`` (default: classify ``cfg.model`` on ``cfg.data``) and return the summary (also written
    to ``RUN/summary.json``), with ``callbacks`` around the loop. With ``cfg.resume`` the run continues with its
    own config (see :func:`resume_config`)."""
    if cfg.resume:
        cfg = resume_config(cfg)
    return Trainer(cfg, callbacks=callbacks).fit()


__all__ = ["TIME_KEYS", "Trainer", "fit", "resume_config", "seed_everything"]
