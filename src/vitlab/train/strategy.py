"""Strategies: how a :class:`~vitlab.train.trainer.Trainer` places one training run on processes and devices.

One class per strategy, behind one small interface (device, loaders, wrapping, gradient sync, metric reduction,
checkpoint I/O), chosen by ``TrainConfig.strategy``:

- :class:`SingleDevice` (``none``): one process, one device.
- :class:`DDP` (``ddp``): ``DistributedDataParallel`` under ``torchrun``; a ``DistributedSampler`` per epoch
  (``set_epoch``); logging and checkpoints from rank 0 (the weights are identical on every rank).
- :class:`FSDP2` (``fsdp``): ``fully_shard`` on each of the model's shard units (``model.shard_units()``, which
  every family declares; ``model.blocks`` for a model without it), then on the root. Under AMP a
  ``MixedPrecisionPolicy`` with the AMP dtype for parameters and fp32 for gradient reduction. An EMA is sharded
  the same way (its update is local to each shard). Checkpoints go through ``torch.distributed.checkpoint``
  (``dcp/`` in the checkpoint directory, loadable under another world size) plus rank 0's gathered
  ``model.safetensors`` (and ``ema.safetensors``) for evaluation.

Loaders (:func:`make_loader`): a map-style dataset is shuffled per (seed, epoch) -- under DDP / FSDP by a
``DistributedSampler`` -- and a run resumed mid-epoch skips the batches already done at the sampler; a stream
(``IterableDataset``) gets no sampler (it splits itself by rank and worker) and resumes from its own
``state_dict`` through torchdata's ``StatefulDataLoader``, or by reading and dropping the batches done.

Backend: NCCL on CUDA, gloo on CPU. Multi-node is torchrun's own rendezvous, e.g.
``torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 -m vitlab train ...``
(see ``docs/scale.md``).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import Sampler

from vitlab.train import checkpoint as ck

if TYPE_CHECKING:
    from torch.utils.data import Dataset


def resolve_device(name: str) -> torch.device:
    """``name`` as a device of this machine (``auto``: the GPU when there is one, else the CPU); ValueError,
    naming what is wrong, for a name torch does not know or a device this machine lacks (before any model is
    built or moved, rather than a driver's traceback on the first transfer)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ValueError(f"device {name!r} is not a device name (cpu, cuda, cuda:1, mps, auto ...)") from None
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not n:
            raise ValueError(f"device {name!r} requested but CUDA is not available")
        if dev.index is not None and dev.index >= n:
            raise ValueError(f"device {name!r} requested but this machine has {n} CUDA device(s): cuda:0 to "
                             f"cuda:{n - 1}")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {name!r} requested but MPS is not available")
    return dev


def shard_units(module: nn.Module) -> list[nn.Module]:
    """The submodules FSDP wraps one by one: ``module.shard_units()`` when the model declares them, else its
    ``blocks``; a module without either runs as one root unit."""
    fn = getattr(module, "shard_units", None)
    if callable(fn):
        return list(fn())
    return list(getattr(module, "blocks", None) or [])


class _From(Sampler):
    """The indices of ``sampler`` from position ``start`` on: the epoch's order, its consumed part skipped (a
    run resumed mid-epoch continues where the checkpoint was taken, without loading what it skips)."""

    def __init__(self, sampler, start: int):
        self.sampler, self.start = sampler, start

    def __iter__(self):
        return itertools.islice(iter(self.sampler), self.start, None)

    def __len__(self) -> int:
        return max(len(self.sampler) - self.start, 0)


class _SkipBatches:
    """A stream's loader with its first ``skip`` batches read and dropped: for a resumed stream that cannot
    restore its own position (no ``state_dict``), the same batches follow when the stream is deterministic."""

    def __init__(self, loader, skip: int):
        self.loader, self.skip = loader, skip

    def __iter__(self):
        return itertools.islice(iter(self.loader), self.skip, None)

    def __len__(self) -> int:
        return max(len(self.loader) - self.skip, 0)


def is_stream(dataset) -> bool:
    """Whether ``dataset`` is an ``IterableDataset`` (a stream that splits itself by rank and worker)."""
    from torch.utils.data import IterableDataset

    return isinstance(dataset, IterableDataset)


def stateful(dataset) -> bool:
    """Whether a stream can save and restore its position (``state_dict`` / ``load_state_dict``)."""
    return callable(getattr(dataset, "state_dict", None)) and callable(getattr(dataset, "load_state_dict", None))


def make_loader(dataset: Dataset, batch_size: int, *, shuffle: bool = False, sampler=None, drop_last: bool = False,
                seed: int = 0, epoch: int | None = None, num_workers: int = 0, skip: int = 0,
                state: dict | None = None):
    """The engine's loader over ``dataset``. ``epoch`` seeds the shuffle with (seed, epoch), so epoch k's order
    does not depend on how many loaders came before it (exact resume); ``skip`` starts the epoch after that many
    batches (a run resumed mid-epoch).

    A map-style dataset skips at the sampler (nothing is loaded twice). A stream (``IterableDataset``) gets no
    sampler: it splits itself by rank and worker and shuffles with its own buffer; ``set_epoch(epoch)`` is called
    when it has one. A stream with ``state_dict`` / ``load_state_dict`` runs under torchdata's
    ``StatefulDataLoader``, which gathers its position from the workers, and resumes from ``state`` (that
    loader's ``state_dict()``); any other stream skips by reading and dropping ``skip`` batches."""
    from torch.utils.data import DataLoader, RandomSampler, SequentialSampler

    g = torch.Generator()
    g.manual_seed(seed if epoch is None else seed * 1_000_003 + epoch)
    if is_stream(dataset):
        if epoch is not None and callable(getattr(dataset, "set_epoch", None)):
            dataset.set_epoch(epoch)
        if stateful(dataset):
            try:
                from torchdata.stateful_dataloader import StatefulDataLoader
            except ImportError:
                raise ValueError("resumable streams need torchdata: pip install 'vitlab[stream]'") from None
            loader = StatefulDataLoader(dataset, batch_size=batch_size, drop_last=drop_last, num_workers=num_workers,
                                        generator=g)
            if state is not None:
                loader.load_state_dict(state)
                return loader
        else:
            loader = DataLoader(dataset, batch_size=batch_size, drop_last=drop_last, num_workers=num_workers,
                                generator=g)
        return _SkipBatches(loader, skip) if skip else loader
    if sampler is None:  # what DataLoader(shuffle=...) builds, so the order is the same with or without a skip
        sampler = RandomSampler(dataset, generator=g) if shuffle else SequentialSampler(dataset)
    if skip:
        sampler = _From(sampler, skip * batch_size)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last,
                      num_workers=num_workers, generator=g, persistent_workers=False)


def loader_state(loader) -> dict | None:
    """The position of a resumable stream's loader (``StatefulDataLoader.state_dict()``), else None (a map-style
    loader's position is the number of batches done)."""
    fn = getattr(loader, "state_dict", None)
    return fn() if callable(fn) else None


def _as_float(norm) -> float:
    """A gradient norm as a float (FSDP2 returns a DTensor: its full value)."""
    full = getattr(norm, "full_tensor", None)
    return float(full() if callable(full) else norm)


class Strategy:
    """One process, no collectives: the base every strategy refines."""

    name = "none"

    def __init__(self, device: torch.device, rank: int = 0, world_size: int = 1, local_rank: int = 0,
                 owns_group: bool = False):
        self.device, self.rank, self.world_size, self.local_rank = device, rank, world_size, local_rank
        self.owns_group = owns_group

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 or self.name != "none"

    def summary(self) -> dict:
        """What the strategy adds to ``summary.json``."""
        return {}

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()

    # ---- collectives (no-ops in one process)
    def broadcast_path(self, path: Path) -> Path:
        return path

    def mean(self, value: float) -> float:
        return value

    def sum_tensors(self, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return values

    def gather(self, obj) -> list:
        """Every rank's ``obj``, in rank order (RNG states, loader positions)."""
        return [obj]

    def agree(self, flag: bool) -> bool:
        """Rank 0's ``flag`` on every rank (a decision taken on one clock, e.g. a time-based checkpoint)."""
        return flag

    def barrier(self) -> None:
        pass

    # ---- data
    def train_loader(self, dataset, batch_size: int, epoch: int, seed: int, num_workers: int, skip: int = 0,
                     state: dict | None = None):
        """This process's shuffled training batches of ``epoch`` (the order a function of (seed, epoch)), from batch
        ``skip`` on (or from a resumable stream's ``state``)."""
        drop = is_stream(dataset) or len(dataset) >= batch_size
        return make_loader(dataset, batch_size, shuffle=not is_stream(dataset), drop_last=drop, seed=seed,
                           epoch=epoch, num_workers=num_workers, skip=skip, state=state)

    def eval_loader(self, dataset, batch_size: int, num_workers: int):
        """This process's share of ``dataset``, in order."""
        return make_loader(dataset, batch_size, num_workers=num_workers)

    # ---- model
    def wrap(self, module: nn.Module, amp: str) -> nn.Module:
        """The module the training step calls (DDP wrapper, or the module sharded in place)."""
        return module

    def prepare_ema(self, ema_module: nn.Module, amp: str) -> None:
        """Lay the EMA copy out like the model (FSDP shards it the same way)."""

    def no_sync(self, wrapped: nn.Module, skip: bool):
        return contextlib.nullcontext()

    def clip_grad_norm(self, params, max_norm: float) -> float:
        """Clip the gradients of ``params`` to ``max_norm``; their total norm before clipping."""
        return _as_float(torch.nn.utils.clip_grad_norm_(params, max_norm))

    def grad_norm(self, params) -> float:
        """The total L2 norm of the gradients of ``params`` (over every rank's shard under FSDP)."""
        grads = [p.grad for p in params if p.grad is not None]
        return _as_float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0

    # ---- checkpoints
    def full_state_dict(self, module: nn.Module) -> dict:
        """The module's whole state dict (a collective under FSDP: every rank calls it)."""
        return module.state_dict()

    def save(self, run_dir: Path, name: str, module: nn.Module, optimizer, state: dict, meta: dict,
             split, ema_module: nn.Module | None, links: tuple[str, ...], keep_last: int = 1) -> None:
        """Checkpoint ``name``: ``split(full state dict) -> (model weights, {extra module: state})``; the
        ``keep_last`` newest checkpoints (and those ``last`` / ``best`` name) stay."""
        model_sd, extras = split(self.full_state_dict(module))
        ema_sd = self.full_state_dict(ema_module) if ema_module is not None else None
        if self.is_main:
            state = {**state, **extras, "optimizer": optimizer.state_dict()}
            ck.save_checkpoint(run_dir, name, model_sd, state, meta, ema_sd, links, keep_last=keep_last)
        self.barrier()

    def load(self, ckpt_dir: Path, module: nn.Module, optimizer, state: dict, load_split,
             ema_module: nn.Module | None) -> None:
        """Restore module (model + extras), optimiser and EMA weights from checkpoint ``ckpt_dir``.
        ``load_split(module, model_sd, state)`` loads the model's weights and the extras kept in ``state``."""
        sd, _ = ck.load_weights(ckpt_dir, weights="raw")
        load_split(module, sd, state)
        if ema_module is not None:
            ema_sd, _ = ck.load_weights(ckpt_dir, weights="ema")
            ema_module.load_state_dict(ema_sd)
        if "optimizer" not in state:
            raise ck.CheckpointError(f"{ckpt_dir} holds no optimiser state (saved by --strategy fsdp?)")
        optimizer.load_state_dict(state["optimizer"])


class SingleDevice(Strategy):
    """One process on one device (``--strategy none``)."""


class _Distributed(Strategy):
    """What DDP and FSDP2 share: collectives over the process group, sharded loaders, rank-0 I/O."""

    def _coll_device(self) -> torch.device:
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    def broadcast_path(self, path: Path) -> Path:
        obj = [str(path)]
        dist.broadcast_object_list(obj, src=0)
        return Path(obj[0])

    def mean(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self._coll_device())
        dist.all_reduce(t)
        return (t / self.world_size).item()

    def sum_tensors(self, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for k, v in values.items():
            t = v.to(self._coll_device())
            dist.all_reduce(t)
            out[k] = t.cpu()
        return out

    def gather(self, obj) -> list:
        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def agree(self, flag: bool) -> bool:
        t = torch.tensor([int(flag)], device=self._coll_device())
        dist.broadcast(t, src=0)
        return bool(t.item())

    def barrier(self) -> None:
        dist.barrier()

    def train_loader(self, dataset, batch_size: int, epoch: int, seed: int, num_workers: int, skip: int = 0,
                     state: dict | None = None):
        from torch.utils.data.distributed import DistributedSampler

        if is_stream(dataset):  # a stream takes its own share of every rank and worker: no sampler
            return make_loader(dataset, batch_size, drop_last=True, seed=seed, epoch=epoch, num_workers=num_workers,
                               skip=skip, state=state)
        sampler = DistributedSampler(dataset, num_replicas=self.world_size, rank=self.rank, shuffle=True,
                                     seed=seed, drop_last=True)
        sampler.set_epoch(epoch)
        return make_loader(dataset, batch_size, sampler=sampler, drop_last=True, seed=seed, epoch=epoch,
                           num_workers=num_workers, skip=skip)

    def eval_loader(self, dataset, batch_size: int, num_workers: int):
        # Each rank takes a strided slice; no padding, so summed counts are exact. A stream splits itself.
        from torch.utils.data import Subset

        if is_stream(dataset):
            return make_loader(dataset, batch_size, num_workers=num_workers)
        idx = list(range(self.rank, len(dataset), self.world_size))
        return make_loader(Subset(dataset, idx), batch_size, num_workers=num_workers)


class DDP(_Distributed):
    """``DistributedDataParallel`` over the whole trained module (the model and any trained extras, e.g. the
    feature-distillation projectors), so every trained parameter's gradient is averaged."""

    name = "ddp"

    def wrap(self, module: nn.Module, amp: str) -> nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(module, device_ids=ids)

    def no_sync(self, wrapped: nn.Module, skip: bool):
        return wrapped.no_sync() if skip else contextlib.nullcontext()


class FSDP2(_Distributed):
    """FSDP2 ``fully_shard``: each shard unit, then the root; EMA sharded alike; checkpoints through dcp."""

    name = "fsdp"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.units = 0

    def summary(self) -> dict:
        return {"fsdp_units": self.units}

    def _shard(self, module: nn.Module, amp: str) -> int:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        kw = {}
        if amp != "none":
            dtype = torch.bfloat16 if amp == "bf16" else torch.float16
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        units = shard_units(module)
        for unit in units:
            fully_shard(unit, **kw)
        fully_shard(module, **kw)
        return len(units) + 1  # the root is a unit too

    def wrap(self, module: nn.Module, amp: str) -> nn.Module:
        self.units = self._shard(module, amp)
        return module

    def prepare_ema(self, ema_module: nn.Module, amp: str) -> None:
        self._shard(ema_module, amp)

    def no_sync(self, wrapped: nn.Module, skip: bool):
        if hasattr(wrapped, "set_requires_gradient_sync"):
            wrapped.set_requires_gradient_sync(not skip)
        return contextlib.nullcontext()

    def full_state_dict(self, module: nn.Module) -> dict:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def save(self, run_dir, name, module, optimizer, state, meta, split, ema_module, links, keep_last=1) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        root = Path(run_dir) / ck.CKPT_DIR
        staging = root / f".{name}.dcp.tmp"
        if self.is_main:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(staging, ignore_errors=True)
        dist.barrier()
        msd, osd = get_state_dict(module, optimizer)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(staging))
        model_sd, extras = split(self.full_state_dict(module))  # extras also travel in dcp/
        ema_sd = self.full_state_dict(ema_module) if ema_module is not None else None
        dist.barrier()
        if self.is_main:
            state = {**state, **extras, "world_size_saved": self.world_size}
            ck.save_checkpoint(run_dir, name, model_sd, state, meta, ema_sd, links, extra_dirs={"dcp": staging},
                               keep_last=keep_last)
        dist.barrier()

    def load(self, ckpt_dir, module, optimizer, state, load_split, ema_module) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_state_dict,
            set_model_state_dict,
            set_state_dict,
        )

        dcp_dir = Path(ckpt_dir) / "dcp"
        if not dcp_dir.is_dir():
            raise ck.CheckpointError(f"{ckpt_dir} has no dcp/ (not saved by --strategy fsdp); resume it with the "
                                     f"strategy that saved it")
        msd, osd = get_state_dict(module, optimizer)
        # a parameter that had no optimiser state when saved (no gradient yet, e.g. DINO's last layer frozen in the
        # first epoch) gets none back, as in the uninterrupted run (get_state_dict initialises every one)
        saved = {k.rsplit(".", 1)[0] for k in dcp.FileSystemReader(str(dcp_dir)).read_metadata().state_dict_metadata
                 if k.startswith("optim.state.")}
        osd["state"] = {k: v for k, v in osd["state"].items() if f"optim.state.{k}" in saved}
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=str(dcp_dir))
        # not strict: the optimiser may rightly lack a parameter's state (above); dcp.load already required every
        # key of the model
        set_state_dict(module, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"],
                       options=StateDictOptions(strict=False))
        if ema_module is not None:
            ema_sd, _ = ck.load_weights(ckpt_dir, weights="ema")
            set_model_state_dict(ema_module, ema_sd, options=StateDictOptions(full_state_dict=True))


STRATEGIES: dict[str, type[Strategy]] = {"none": SingleDevice, "ddp": DDP, "fsdp": FSDP2}


def create_strategy(name: str, device: str = "auto") -> Strategy:
    """The strategy ``name`` for this process: reads torchrun's environment and starts the process group for
    ddp / fsdp (NCCL on CUDA, gloo on CPU)."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; expected one of {', '.join(STRATEGIES)}")
    if name == "none":
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ValueError("launched by torchrun with several processes but --strategy is none; pass "
                             "--strategy ddp or fsdp")
        return SingleDevice(resolve_device(device))
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise ValueError(f"--strategy {name} needs torchrun: torchrun --nproc-per-node N -m vitlab train "
                         f"... --strategy {name}")
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    dev = resolve_device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    owns = False
    if not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
        owns = True
    return STRATEGIES[name](dev, rank=rank, world_size=world, local_rank=local, owns_group=owns)
