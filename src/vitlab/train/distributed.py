"""Strategies: one process (``none``), DDP and FSDP2 under ``torchrun``, behind one small context object the loop
calls (device, loaders, wrapping, gradient sync, metric reduction, checkpoint I/O).

- ``ddp``: ``DistributedDataParallel``; a ``DistributedSampler`` per epoch (``set_epoch``); logging and
  checkpoints from rank 0 (the weights are identical on every rank).
- ``fsdp``: FSDP2 ``fully_shard`` on each block, then on the root; under AMP a ``MixedPrecisionPolicy`` with the
  AMP dtype for parameters and fp32 for gradient reduction. Checkpoints go through ``torch.distributed.checkpoint``
  (``dcp/`` in the checkpoint directory, loadable under another world size) plus rank 0's gathered
  ``model.safetensors`` for evaluation.

Backend: NCCL on CUDA, gloo on CPU. Multi-node is torchrun's own rendezvous, e.g.
``torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 -m vitlab train ...``.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from vitlab.train import checkpoint as ck


@dataclass
class Context:
    strategy: str = "none"
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    owns_group: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.strategy != "none"

    # ---- collectives (no-ops in one process)
    def broadcast_path(self, path: Path) -> Path:
        if not self.distributed:
            return path
        obj = [str(path)]
        dist.broadcast_object_list(obj, src=0)
        return Path(obj[0])

    def mean_across_ranks(self, value: float) -> float:
        if not self.distributed:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self._coll_device())
        dist.all_reduce(t)
        return (t / self.world_size).item()

    def gather_rng(self, state: dict):
        if not self.distributed:
            return state
        out = [None] * self.world_size
        dist.all_gather_object(out, state)
        return out

    def _coll_device(self) -> torch.device:
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    # ---- data
    def train_loader(self, bundle, cfg, epoch: int):
        if not self.distributed:
            return bundle.loader("train", batch_size=cfg.batch_size, epoch=epoch)
        from torch.utils.data.distributed import DistributedSampler

        sampler = DistributedSampler(bundle.train, num_replicas=self.world_size, rank=self.rank, shuffle=True,
                                     seed=bundle.config.seed, drop_last=True)
        sampler.set_epoch(epoch)
        return bundle.loader("train", batch_size=cfg.batch_size, sampler=sampler, shuffle=False, drop_last=True)

    def eval_loader(self, bundle, split: str, cfg):
        bs = max(cfg.batch_size, 256)
        if not self.distributed:
            return bundle.loader(split, batch_size=bs)
        # Each rank takes a strided slice; no padding, so summed counts are exact.
        from torch.utils.data import Subset

        ds = getattr(bundle, split)
        idx = list(range(self.rank, len(ds), self.world_size))
        from torch.utils.data import DataLoader

        return DataLoader(Subset(ds, idx), batch_size=bs, shuffle=False, num_workers=bundle.config.num_workers)

    def evaluate(self, wrapped, loader, device, num_classes: int, cfg) -> dict:
        from vitlab.train.loop import evaluate_model

        r = evaluate_model(wrapped, loader, device, num_classes, cfg.amp, cfg.channels_last)
        if not self.distributed:
            return r
        n_local = r["confusion"].sum().item()
        t = torch.tensor([r["top5"] * n_local / 100.0, r["loss"] * n_local], dtype=torch.float64,
                         device=self._coll_device())
        conf = r["confusion"].to(self._coll_device())
        dist.all_reduce(t)
        dist.all_reduce(conf)
        n = max(conf.sum().item(), 1)
        return {"top1": 100.0 * conf.diag().sum().item() / n, "top5": 100.0 * t[0].item() / n,
                "loss": t[1].item() / n, "confusion": conf.cpu()}

    # ---- model
    def wrap(self, model: nn.Module, cfg) -> nn.Module:
        if self.strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            ids = [self.device.index] if self.device.type == "cuda" else None
            return DDP(model, device_ids=ids)
        if self.strategy == "fsdp":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mp = None
            if cfg.amp != "none":
                dtype = torch.bfloat16 if cfg.amp == "bf16" else torch.float16
                mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
            kw = {"mp_policy": mp} if mp is not None else {}
            for blk in getattr(model, "blocks", []):
                fully_shard(blk, **kw)
            fully_shard(model, **kw)
            return model
        return model

    def no_sync(self, wrapped, skip: bool):
        if skip and self.strategy == "ddp":
            return wrapped.no_sync()
        if self.strategy == "fsdp" and hasattr(wrapped, "set_requires_gradient_sync"):
            wrapped.set_requires_gradient_sync(not skip)
        return contextlib.nullcontext()

    def clip_grad_norm(self, wrapped, params, max_norm: float):
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    # ---- checkpoints
    def _full_state_dict(self, wrapped, model) -> dict:
        if self.strategy != "fsdp":
            return model.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def save(self, run_dir: Path, name: str, wrapped, model, optimizer, state: dict, meta: dict,
             ema_sd: dict | None, links: tuple[str, ...]) -> None:
        if self.strategy == "fsdp":
            self._save_fsdp(run_dir, name, wrapped, model, optimizer, state, meta, ema_sd, links)
            return
        if self.is_main:
            state = {**state, "optimizer": optimizer.state_dict()}
            ck.save_checkpoint(run_dir, name, model.state_dict(), state, meta, ema_sd, links)
        if self.distributed:
            dist.barrier()

    def _save_fsdp(self, run_dir, name, wrapped, model, optimizer, state, meta, ema_sd, links) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        root = Path(run_dir) / ck.CKPT_DIR
        staging = root / f".{name}.dcp.tmp"
        if self.is_main:
            root.mkdir(parents=True, exist_ok=True)
            import shutil

            shutil.rmtree(staging, ignore_errors=True)
        dist.barrier()
        msd, osd = get_state_dict(model, optimizer)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(staging))
        full = self._full_state_dict(wrapped, model)
        dist.barrier()
        if self.is_main:
            state = {**state, "world_size_saved": self.world_size}
            ck.save_checkpoint(run_dir, name, full, state, meta, ema_sd, links, extra_dirs={"dcp": staging})
        dist.barrier()

    def load_model(self, wrapped, model, ckpt_dir: Path, description: dict) -> None:
        if self.strategy == "fsdp":
            return  # loaded with the optimiser from dcp/
        sd, _ = ck.load_weights(ckpt_dir, weights="raw")
        model.load_state_dict(sd)

    def load_optimizer(self, wrapped, optimizer, state: dict, ckpt_dir: Path) -> None:
        if self.strategy != "fsdp":
            if "optimizer" not in state:
                raise ck.CheckpointError(f"{ckpt_dir} holds no optimiser state (saved by --strategy fsdp?)")
            optimizer.load_state_dict(state["optimizer"])
            return
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        dcp_dir = Path(ckpt_dir) / "dcp"
        if not dcp_dir.is_dir():
            raise ck.CheckpointError(f"{ckpt_dir} has no dcp/ (not saved by --strategy fsdp); resume it with the "
                                     f"strategy that saved it")
        msd, osd = get_state_dict(wrapped, optimizer)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=str(dcp_dir))
        set_state_dict(wrapped, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def setup(cfg) -> Context:
    """Read torchrun's environment; start the process group for ddp/fsdp (NCCL on CUDA, gloo on CPU)."""
    from vitlab.train.loop import resolve_device

    if cfg.strategy == "none":
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ValueError("launched by torchrun with several processes but --strategy is none; pass "
                             "--strategy ddp or fsdp")
        return Context(device=resolve_device(cfg.device))
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise ValueError(f"--strategy {cfg.strategy} needs torchrun: torchrun --nproc-per-node N -m vitlab train "
                         f"... --strategy {cfg.strategy}")
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    device = resolve_device(cfg.device)
    if device.type == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    owns = False
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        owns = True
    return Context(strategy=cfg.strategy, rank=rank, world_size=world, local_rank=local, device=device,
                   owns_group=owns)


def teardown(ctx: Context) -> None:
    if ctx.owns_group and dist.is_initialized():
        dist.destroy_process_group()
