"""What the streamed datasets (WebDataset shards, :mod:`vitlab.data.wds`; Hugging Face streams,
:mod:`vitlab.data.hf`) share: where a stream reads in a distributed run, its epoch, its resumable position, and the
wrapper that gives a stream ``build``'s channel conversion and transforms.

A stream is a ``torch.utils.data.IterableDataset`` whose items are ``(PIL image, label)`` (or ``(PIL image,
caption)`` for image-text data). It splits itself: by ``torch.distributed`` rank and world size (read in the main
process, where the process group lives) and by ``DataLoader`` worker, so the loader needs no
``DistributedSampler`` (as in WebDataset's ``split_by_node`` / ``split_by_worker`` and open_clip's loaders).

The protocol a training loop may use (all optional, the loader works without them):

- ``set_epoch(epoch)``: the epoch about to be read (its shuffle and, for endless streams, its place in the stream);
- ``batch_size``: the loader's batch size; with it each worker reads whole batches, so ``len(DataLoader)`` is the
  exact number of batches however many workers there are;
- ``state_dict()`` / ``load_state_dict(state)``: the position within the epoch of this worker (torchdata's
  ``StatefulDataLoader`` keeps one per worker), so a resumed run reads exactly what was left.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Iterator

import torch
from torch.utils.data import IterableDataset, get_worker_info

from vitlab.data.datasets import as_uint8
from vitlab.data.registry import DataError

STREAM_EXTRA = "pip install 'vitlab[stream]'"


def require(module: str, what: str):
    """``module`` imported, or a one-line DataError naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(f"{what} needs the {module} package: {STREAM_EXTRA}") from None


def process_placement() -> tuple[int, int]:
    """(rank, world size) of this process in the default process group; (0, 1) without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def worker_placement() -> tuple[int, int]:
    """(worker id, number of workers) of the DataLoader worker running this; (0, 1) in the main process."""
    info = get_worker_info()
    return (info.id, info.num_workers) if info is not None else (0, 1)


def share(n: int, parts: int, i: int) -> tuple[int, int]:
    """The ``i``-th of ``parts`` contiguous, near-equal pieces of ``range(n)``, as (start, stop)."""
    return n * i // parts, n * (i + 1) // parts


def worker_share(n: int, workers: int, worker: int, batch_size: int | None) -> tuple[int, int]:
    """The piece (start, stop) of a rank's ``n`` samples that one of its ``workers`` reads. With the batch size
    known, each worker gets whole batches and the last one the remainder: the loader's batches are then the ones
    ``len(DataLoader)`` promises, as if one process read them all."""
    if not batch_size:
        return share(n, workers, worker)
    batches = n // batch_size
    start, stop = share(batches, workers, worker)
    return start * batch_size, (n if worker == workers - 1 else stop * batch_size)


class Stream(IterableDataset):
    """The base of vitlab's streams: placement, epoch and position bookkeeping.

    Subclasses set ``train``, ``total`` (the samples of one pass) and ``epoch_length`` (the samples of a training
    epoch) and implement ``_samples`` (this worker's raw samples of an epoch, in order) and ``_decode`` (one raw
    sample as an item). An unreadable sample stops the
    stream with a one-line DataError, or, with ``skip_bad``, is replaced by the previous readable one (so every
    rank still takes the same number of steps) and counted in one warning at the end of the worker's epoch."""

    def __init__(self, name: str, skip_bad: bool):
        self.name, self.skip_bad = name, skip_bad
        self.epoch, self.batch_size = 0, None
        self._placement: tuple[int, int] | None = None    # (rank, world) fixed by set_placement
        # the main process's, carried into the workers; read now (a dataset is built after the process group
        # starts) and again by set_epoch, len and iter in the main process
        self._seen_placement = process_placement()
        self._resume: dict | None = None
        self._position: dict = {"epoch": 0, "consumed": 0}

    # ---- placement
    def set_placement(self, rank: int, world_size: int) -> None:
        """Read as process ``rank`` of ``world_size`` regardless of ``torch.distributed`` (tests, custom
        launchers)."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of {world_size}")
        self._placement = (rank, world_size)

    def placement(self) -> tuple[int, int]:
        """(rank, world size): set, else the process group's, read in the main process (a DataLoader worker
        has no process group; it gets the value its copy of the dataset carries)."""
        if self._placement is not None:
            return self._placement
        if get_worker_info() is None:
            self._seen_placement = process_placement()
        return self._seen_placement

    # ---- epoch and position
    def set_epoch(self, epoch: int) -> None:
        self.placement()
        self.epoch = int(epoch)
        self._position = {"epoch": self.epoch, "consumed": 0}

    def state_dict(self) -> dict:
        """This worker's position: the epoch and the items it has yielded of it (and where it reads)."""
        return dict(self._position)

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (a :meth:`state_dict`): the next iteration reads the rest of that epoch."""
        if not {"epoch", "consumed"} <= set(state):
            raise DataError(f"not a stream position: {sorted(state)}")
        self.epoch = int(state["epoch"])
        self._resume = dict(state)

    def __len__(self) -> int:
        rank, world = self.placement()
        return self._count(world, rank)

    def __iter__(self) -> Iterator:
        rank, world = self.placement()
        worker, workers = worker_placement()
        skip, resume = 0, self._resume
        self._resume = None
        where = {"rank": rank, "world_size": world, "worker": worker, "num_workers": workers}
        if resume is not None and int(resume["epoch"]) == self.epoch:
            if all(resume.get(k, v) == v for k, v in where.items()):
                skip = int(resume["consumed"])
            else:
                warnings.warn(f"the saved stream position was read by {resume} but this run reads by {where}; "
                              f"epoch {self.epoch} starts again", stacklevel=2)
        self._position = {"epoch": self.epoch, "consumed": skip, **where}
        skipped = SkipCounter(self.name)
        last, owed = None, 0
        for k, raw in enumerate(self._samples(self.epoch, rank, world, worker, workers)):
            if k < skip:  # a resumed epoch: the part already read is passed over undecoded
                continue
            self._position["consumed"] = k + 1
            try:
                item = self._decode(raw)
            except UnreadableSample as e:
                if not self.skip_bad:
                    raise DataError(f"{e} (pass skip_bad_images / --data.skip_bad_images to skip it)") from None
                # A stand-in keeps every worker's count, so ranks keep taking the same number of steps.
                skipped.add(str(e))
                if last is None:
                    owed += 1
                    continue
                item = last
            yield item
            last = item
            for _ in range(owed):
                yield item
            owed = 0
        if owed:
            raise DataError(f"{self.name}: no readable sample in this worker's share (first: {skipped.first})")
        skipped.report()

    def _samples(self, epoch: int, rank: int, world: int, worker: int, workers: int) -> Iterator:
        """This worker's raw samples of ``epoch``, in order (undecoded)."""
        raise NotImplementedError

    def _decode(self, raw) -> tuple:
        """A raw sample as (PIL image, label or caption); :class:`UnreadableSample` when it cannot be read."""
        raise NotImplementedError

    def _count(self, world: int, rank: int) -> int:
        """The items rank ``rank`` of ``world`` reads per epoch: in training an equal share of ``epoch_length``
        (every rank takes the same number of steps); in evaluation its contiguous share of all ``total`` samples,
        each read once."""
        if self.train:
            return self.epoch_length // world
        a, b = share(self.total, world, rank)
        return b - a


class UnreadableSample(Exception):
    """A sample that cannot be read (corrupt image, missing key, truncated shard); its message names it."""


class SkipCounter:
    """Counts unreadable samples a stream stood in for, and warns once, when the worker's epoch ends."""

    def __init__(self, what: str):
        self.what, self.count, self.first = what, 0, ""

    def add(self, reason: str) -> None:
        self.count += 1
        self.first = self.first or reason

    def report(self) -> None:
        if self.count:
            warnings.warn(f"{self.what}: skipped {self.count} unreadable sample(s), each replaced by a readable "
                          f"neighbour (first: {self.first})", stacklevel=2)


class StreamImages(IterableDataset):
    """A stream's items as ``build`` gives every dataset's: the image converted to ``in_chans`` uint8 channels,
    then through ``transform`` (settable, as on :class:`vitlab.data.core.ClassImages`). Epoch, batch size and
    position pass through to the stream."""

    def __init__(self, dataset: Stream, in_chans: int, transform: Callable | None):
        self.dataset, self.in_chans, self.transform = dataset, in_chans, transform
        self.classes: list[str] = list(dataset.classes)

    @property
    def batch_size(self) -> int | None:
        return self.dataset.batch_size

    @batch_size.setter
    def batch_size(self, value: int | None) -> None:
        self.dataset.batch_size = value

    def __len__(self) -> int:
        return len(self.dataset)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, object]]:
        for image, target in self.dataset:
            x = as_uint8(image, self.in_chans)
            yield (self.transform(x) if self.transform else x), target

    def __getattr__(self, name: str):
        if name == "dataset":  # not yet set (copy / unpickling): no source to look in
            raise AttributeError(name)
        return getattr(self.dataset, name)
