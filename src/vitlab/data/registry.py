"""The open dataset registry: a name -> the function that reads it, with what ``build`` needs to know about it.

A registered function ``fn(split, root, **options) -> Dataset | None`` reads one split (``'train'``, ``'val'`` or
``'test'``) of the data under ``root`` (the ``ROOT`` of ``DataConfig(dataset="NAME:ROOT")``, else None). Its items
are ``(image, label)``: a PIL image or a uint8 (C, H, W) tensor with 1 or 3 channels, and an int class index; the
dataset has ``classes`` (the class names) and a length. A split the data does not have (e.g. no test set) is None;
``build`` needs train and val. ``build`` converts every image to the model's channels and applies its transforms.
A split may also be a stream (a ``torch.utils.data.IterableDataset`` with a length and ``classes``, e.g.
:class:`vitlab.data.streaming.Stream`): it splits itself by rank and worker, and the loader gives it no sampler.

    @vitlab.data.register_dataset("pets", needs_root=True, preset="imagenet")
    def pets(split, root, **options): ...        # DataConfig(dataset="pets:~/data/pets"), --data pets:~/data/pets

A name that another reader reads (e.g. image / target pairs) is declared with :func:`declare_dataset`, so
``DataConfig`` checks its root and ``build`` names that reader instead of calling the name unknown.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.utils.data import Dataset

if TYPE_CHECKING:
    from vitlab.data.core import DataConfig

SPLITS = ("train", "val", "test")


class DataError(ValueError):
    """A problem with the data (missing directory, empty class, unreadable image, ...): one line, naming the path."""

    def __init__(self, message: str = "", *args):
        # Raised in a DataLoader worker, it comes back to the main process rebuilt from the worker's traceback
        # ("Caught DataError in DataLoader worker process 0.\nOriginal Traceback ..."); its own line is the last.
        if isinstance(message, str) and message.startswith("Caught DataError") and "\nOriginal Traceback" in message:
            message = message.rstrip().splitlines()[-1].split(": ", 1)[-1]
        super().__init__(message, *args)


def read_text(path: str | Path) -> str:
    """A data file's text, UTF-8; a file that is not (a binary file, another encoding) is a DataError naming it and
    the first byte that does not decode."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start})") from None


DatasetFn = Callable[..., Dataset | None]


@dataclass(frozen=True)
class DatasetSpec:
    """What is known about a registered dataset before it is read."""

    name: str
    fn: DatasetFn | None = None    # (split, root, **options) -> Dataset | None; None: ``read_by`` reads it
    needs_root: bool = False       # the name must be given as NAME:ROOT
    # default augmentation preset ('tiny' or 'imagenet'), or a rule on the DataConfig giving it
    preset: str | Callable[[DataConfig], str] = "tiny"
    # augmentation knobs that suit the data (e.g. no flip for digits), layered over the preset; explicit ones win
    defaults: Mapping[str, Any] | Callable[[DataConfig], Mapping[str, Any]] = field(default_factory=dict)
    # keyword arguments build passes to fn: 'in_chans' (the model's channels) and resolved DataConfig fields
    # ('img_size' is the working size; 'seed', 'download', ...)
    takes: tuple[str, ...] = ()
    read_by: str | None = None     # who reads a declared name (e.g. '--task NAME'), shown by build

    def check_root(self, root: str | None) -> None:
        """One-line DataError when the name needs a ROOT and has none."""
        if self.needs_root and not root:
            raise DataError(f"dataset {self.name} needs a path: {self.name}:PATH")


DATASETS: dict[str, DatasetSpec] = {}


def _add(spec: DatasetSpec) -> None:
    old = DATASETS.get(spec.name)
    if old is not None and old != spec:
        raise ValueError(f"dataset {spec.name!r} is registered twice")
    DATASETS[spec.name] = spec


def register_dataset(name: str, *, needs_root: bool = False, preset: str | Callable[[DataConfig], str] = "tiny",
                     defaults: Mapping[str, Any] | Callable[[DataConfig], Mapping[str, Any]] | None = None,
                     takes: tuple[str, ...] = ()) -> Callable[[DatasetFn], DatasetFn]:
    """Decorator: make ``fn(split, root, **options)`` readable as ``DataConfig(dataset=name)`` / ``--data name``.

    ``needs_root``: the name is given as ``name:ROOT``. ``preset``: the default augmentation preset ('tiny' for
    small images, 'imagenet'), or a function of the DataConfig. ``defaults``: augmentation knobs (``hflip``,
    ``mixup``, ``img_size``, ...) that suit the data, over the preset (a dict or a function of the DataConfig).
    ``takes``: keyword arguments ``build`` passes -- ``'in_chans'`` and resolved DataConfig fields such as
    ``'img_size'`` (the working size) or ``'seed'``; ``DataConfig.options`` adds the dataset's own.
    """

    def deco(fn: DatasetFn) -> DatasetFn:
        _add(DatasetSpec(name, fn, needs_root=needs_root, preset=preset, defaults=defaults or {},
                         takes=tuple(takes)))
        return fn

    return deco


def declare_dataset(name: str, *, read_by: str, needs_root: bool = False) -> None:
    """Reserve ``name`` for a reader other than ``build`` (``read_by`` says which, e.g. ``'--task NAME'``):
    ``DataConfig`` checks its root, and ``build`` refuses it with a line naming ``read_by``."""
    _add(DatasetSpec(name, needs_root=needs_root, read_by=read_by))


def list_datasets() -> list[str]:
    """The names ``build`` reads, sorted."""
    return sorted(n for n, s in DATASETS.items() if s.fn is not None)


def dataset_spec(name: str) -> DatasetSpec:
    """The registration ``build`` reads ``name`` with; a one-line DataError for an unknown or declared name."""
    spec = DATASETS.get(name)
    if spec is None:
        close = difflib.get_close_matches(name, list(DATASETS), n=3, cutoff=0.6)
        hint = f"; close matches: {', '.join(close)}" if close else ""
        raise DataError(f"unknown dataset {name!r}{hint}; registered datasets: {', '.join(list_datasets())}")
    if spec.fn is None:
        raise DataError(f"dataset {name!r} is read by {spec.read_by}, not as classification data")
    return spec
