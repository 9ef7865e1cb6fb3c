"""Hugging Face datasets as training data (``hf:SOURCE[:SPLIT]``), read through the ``datasets`` package (Lhoest
et al., 2021, "Datasets: A Community Library for Natural Language Processing", EMNLP demos).

- SOURCE: a ``save_to_disk`` folder, a folder of data files (parquet, arrow, csv, json: ``load_dataset(folder)``
  reads its splits from the file names), one ``.parquet`` / ``.arrow`` file (the train split), or a Hub name when
  online. ``SPLIT`` names the training split (default ``train``; slicing such as ``train[:50%]`` works for
  sources ``load_dataset`` reads).
- Splits: val is ``options`` ``val_split``, else the first of ``validation``, ``val``, ``valid``, ``dev``; without
  one a fixed 10% of the training rows is held out (seed 0; streams have no hold-out and need a val split). Test is
  ``test_split`` or ``test`` when there.
- Columns: the image column is ``image_column``, else the first ``Image`` feature (or a column named ``image`` /
  ``img``); the label column ``label_column``, else the first ``ClassLabel`` feature (or ``label`` / ``labels``),
  whose names are the classes (integer labels without names: ``0..max``; string labels: their sorted values).
  Image-text data (``--task clip``) reads ``caption_column``, else the first of ``caption``, ``text``, ``txt``.
  Images are decoded here with PIL (the column is read undecoded), so a corrupt one is named by split and row.
- ``streaming=True`` reads without downloading or converting: a ``datasets.IterableDataset`` split between ranks
  by ``datasets.distributed.split_dataset_by_node`` and between a rank's DataLoader workers by ``datasets`` itself
  (by shard). An epoch is ``epoch_length`` samples (default: the split's size from the dataset's metadata); a
  worker whose shards run out before its share starts them again, so every rank takes the same number of steps
  (samples repeat only when shards are uneven). Training streams shuffle with ``datasets``' buffer (``shuffle``
  samples, reseeded per epoch).
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import random
import re
import warnings
from collections.abc import Iterator
from pathlib import Path

from PIL import Image, UnidentifiedImageError
from torch.utils.data import Dataset

from vitlab.data.registry import DataError, register_dataset
from vitlab.data.streaming import Stream, UnreadableSample, require, worker_share

WHAT = "hf: Hugging Face datasets"
VAL_NAMES = ("validation", "val", "valid", "dev")
IMAGE_NAMES = ("image", "img")
LABEL_NAMES = ("label", "labels")
CAPTION_NAMES = ("caption", "text", "txt")
VAL_FRACTION = 0.1
SHUFFLE = 1000
FILE_BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv", ".json": "json", ".jsonl": "json"}


def parse_root(root: str) -> tuple[str, str | None]:
    """``NAME_OR_PATH[:SPLIT]`` as (source, split or None)."""
    source, sep, split = root.rpartition(":")
    if sep and source and re.fullmatch(r"[A-Za-z_][\w.\-]*(\[[^\]]*\])?", split):
        return source, split
    return root, None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


@contextlib.contextmanager
def _hub_quiet():
    # the Hub client logs each failed request before raising; the error line below says it once
    log = logging.getLogger("huggingface_hub")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


@functools.lru_cache(maxsize=8)
def load(source: str, streaming: bool = False) -> dict:
    """The splits of ``source`` as ``{name: datasets.Dataset or IterableDataset}``."""
    hfd = require("datasets", WHAT)
    path = Path(source).expanduser()
    with _hub_quiet():
        return _load(hfd, source, path, streaming)


def _load(hfd, source: str, path: Path, streaming: bool) -> dict:
    try:
        if path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file()):
            d = hfd.load_from_disk(str(path))
            if streaming:  # the rows split into shards that the DataLoader workers share out
                d = {k: _Sized(v.to_iterable_dataset(num_shards=max(1, min(len(v), 64))), len(v))
                     for k, v in (d.items() if isinstance(d, hfd.DatasetDict) else [("train", d)])}
        elif path.is_file():
            builder = FILE_BUILDERS.get(path.suffix.lower())
            if builder is None:
                raise DataError(f"hf:{source}: a file source is .parquet, .arrow, .csv or .json(l)")
            if builder == "arrow" and not streaming:  # memory-mapped where it lies, no copy into the cache
                d = {"train": hfd.Dataset.from_file(str(path))}
            else:
                d = hfd.load_dataset(builder, data_files={"train": str(path)}, streaming=streaming)
        elif path.is_dir():
            d = hfd.load_dataset(str(path), streaming=streaming)
        elif source.startswith(("/", ".", "~")):
            raise DataError(f"hf: no dataset folder or file {path}")
        else:
            d = hfd.load_dataset(source, streaming=streaming)
    except DataError:
        raise
    except Exception as e:  # datasets raises many types (FileNotFoundError, ValueError, hub and network errors)
        raise DataError(f"hf:{source}: cannot load it ({_first_line(e)})") from None
    if isinstance(d, (hfd.Dataset, hfd.IterableDataset, _Sized)):
        d = {"train": d}
    return dict(d)


class _Sized:
    """A stream made from a dataset on disk, with the number of rows it had (``datasets`` keeps no count)."""

    def __init__(self, stream, num_rows: int):
        self.stream, self.num_rows = stream, num_rows


def _unsized(d):
    return d.stream if isinstance(d, _Sized) else d


def _feature_type(features, name: str) -> str:
    return type(features[name]).__name__ if features is not None and name in features else ""


def pick_column(features, columns: list[str], named: str | None, kind: str, option: str, names: tuple[str, ...],
                source: str) -> str:
    """The column to read: ``named`` (checked), else the first feature of type ``kind``, else the first of
    ``names``; a one-line DataError naming the option otherwise."""
    if named is not None:
        if named not in columns:
            raise DataError(f"hf:{source} has no column {named!r} (columns: {', '.join(columns)})")
        return named
    for c in columns:
        if _feature_type(features, c) == kind:
            return c
    for c in names:
        if c in columns:
            return c
    what = {"Image": "image", "ClassLabel": "label", "Value": "caption"}[kind]
    raise DataError(f"hf:{source}: no {what} column among {', '.join(columns)}; name it with "
                    f"--data.options.{option} NAME")


def decode_image(value, where: str) -> Image.Image:
    """An image cell (``{"bytes", "path"}`` of an undecoded ``Image`` feature, bytes, a path or a PIL image)."""
    if isinstance(value, Image.Image):
        return value
    if isinstance(value, dict):
        value = value.get("bytes") or value.get("path")
    try:
        src = io.BytesIO(value) if isinstance(value, (bytes, bytearray)) else value
        if src is None:
            raise ValueError("empty cell")
        with Image.open(src) as img:
            img.load()
            return img
    except (OSError, UnidentifiedImageError, ValueError, TypeError, SyntaxError, Image.DecompressionBombError) as e:
        raise UnreadableSample(f"unreadable image in {where}: {e}") from None


class _Columns:
    """Which columns a split reads and how its labels map to class indices."""

    def __init__(self, d, source: str, *, captions: bool, image_column: str | None, label_column: str | None,
                 caption_column: str | None):
        features = d.features
        columns = list(features) if features is not None else list(getattr(d, "column_names", None) or [])
        self.image = pick_column(features, columns, image_column, "Image", "image_column", IMAGE_NAMES, source)
        if captions:
            self.target = pick_column(features, columns, caption_column, "Value", "caption_column", CAPTION_NAMES,
                                      source)
        else:
            self.target = pick_column(features, columns, label_column, "ClassLabel", "label_column", LABEL_NAMES,
                                      source)
        self.captions, self.source = captions, source
        self.names = features[self.target].names if _feature_type(features, self.target) == "ClassLabel" else None

    def prepare(self, d):
        """Only the two columns, images left undecoded (decoded by PIL here, so a bad one is named)."""
        hfd = require("datasets", WHAT)
        d = d.select_columns([self.image, self.target])
        if _feature_type(d.features, self.image) == "Image":
            d = d.cast_column(self.image, hfd.Image(decode=False))
        return d


def _classes(d, cols: _Columns, streaming: bool) -> list[str]:
    if cols.names is not None:
        return list(cols.names)
    if streaming:
        raise DataError(f"hf:{cols.source}: a stream needs its label column {cols.target!r} as a ClassLabel "
                        f"feature (the class names cannot be read without a pass over the data)")
    values = d.unique(cols.target)
    if all(isinstance(v, int) for v in values):
        if min(values) < 0:
            raise DataError(f"hf:{cols.source}: negative label {min(values)} in column {cols.target!r}")
        return [str(i) for i in range(max(values) + 1)]
    return sorted(map(str, values))


def _target(value, cols: _Columns, index: dict[str, int], where: str):
    if cols.captions:
        if not isinstance(value, str) or not value.strip():
            raise UnreadableSample(f"empty caption in {where}")
        return value.strip()
    if isinstance(value, str) and value in index:
        return index[value]
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(index):
        return value
    raise UnreadableSample(f"{where}: label {value!r} is not one of the {len(index)} classes")


class HFImages(Dataset):
    """A ``datasets.Dataset`` split (or some of its rows) as (PIL image, label) or (PIL image, caption)."""

    def __init__(self, d, cols: _Columns, classes: list[str], rows: list[int] | None, split: str,
                 skip_bad: bool = False):
        self.data, self.cols, self.classes, self.rows = cols.prepare(d), cols, classes, rows
        self.split, self.skip_bad = split, skip_bad
        self._index = {c: i for i, c in enumerate(classes)}
        self._bad: set[int] = set()

    def __len__(self) -> int:
        return len(self.rows) if self.rows is not None else len(self.data)

    def item(self, i: int) -> tuple:
        j = self.rows[i] if self.rows is not None else i
        row = self.data[j]
        where = f"hf:{self.cols.source} ({self.split}, row {j})"
        return decode_image(row[self.cols.image], where), _target(row[self.cols.target], self.cols, self._index, where)

    def __getitem__(self, i: int) -> tuple:
        n = len(self)
        for k in range(n):
            try:
                return self.item((i + k) % n)
            except UnreadableSample as e:
                # as the image folder does: the next row stands in, so the epoch keeps its length
                if not self.skip_bad:
                    raise DataError(f"{e} (pass skip_bad_images / --data.skip_bad_images to skip it)") from None
                if (i + k) % n not in self._bad:
                    self._bad.add((i + k) % n)
                    warnings.warn(f"skipped {e} ({len(self._bad)} so far)", stacklevel=2)
        raise DataError(f"hf:{self.cols.source} ({self.split}): no readable row")

    def captions(self) -> list[str]:
        """Every caption of the split (image-text data), read without decoding an image."""
        values = self.data[self.cols.target]
        return [str(values[j]).strip() for j in (self.rows if self.rows is not None else range(len(values)))]


class HFStream(Stream):
    """A ``datasets.IterableDataset`` split as a stream of (PIL image, label) or (PIL image, caption)."""

    def __init__(self, d, cols: _Columns, classes: list[str], *, length: int, train: bool, seed: int = 0,
                 shuffle: int = SHUFFLE, split: str = "train", skip_bad: bool = False):
        super().__init__(f"hf:{cols.source}", skip_bad)
        self.data, self.cols, self.classes = cols.prepare(d), cols, classes
        self.total = self.epoch_length = length
        self.train, self.seed, self.shuffle, self.split = train, seed, shuffle, split
        self._index = {c: i for i, c in enumerate(classes)}

    def _samples(self, epoch, rank, world, worker, workers) -> Iterator:
        from datasets.distributed import split_dataset_by_node

        d = split_dataset_by_node(self.data, rank=rank, world_size=world) if world > 1 else self.data
        if self.train and self.shuffle > 1:
            d = d.shuffle(seed=self.seed, buffer_size=self.shuffle)
        a, b = worker_share(self._count(world, rank), workers, worker, self.batch_size)
        quota, done, passes = b - a, 0, 0
        while done < quota:
            d.set_epoch(epoch * 1_000_003 + passes)
            got = 0
            for row in d:  # inside a DataLoader worker, datasets gives this worker its own shards
                yield row
                got, done = got + 1, done + 1
                if done == quota:
                    return
            if got == 0 or not self.train:
                if got == 0 and self.train:
                    raise DataError(f"hf:{self.cols.source}: worker {worker} of rank {rank} reads no rows (the "
                                    f"stream has fewer shards than workers); use fewer --data.num_workers")
                return
            passes += 1

    def _decode(self, row) -> tuple:
        where = f"hf:{self.cols.source} ({self.split})"
        return (decode_image(row[self.cols.image], where),
                _target(row[self.cols.target], self.cols, self._index, where))


def _split_names(splits: dict, train: str | None, val_split: str | None, test_split: str | None,
                 source: str) -> dict[str, str | None]:
    names = {"train": train or "train", "val": val_split or next((v for v in VAL_NAMES if v in splits), None),
             "test": test_split or ("test" if "test" in splits else None)}
    for name in names.values():
        if name is not None and name not in splits and not re.search(r"\[", name):
            raise DataError(f"hf:{source} has no split {name!r} (splits: {', '.join(splits)})")
    return names


def read_split(split: str, root: str, *, seed: int = 0, skip_bad_images: bool = False, streaming: bool = False,
               image_column: str | None = None, label_column: str | None = None, caption_column: str | None = None,
               val_split: str | None = None, test_split: str | None = None, epoch_length: int | None = None,
               shuffle: int = SHUFFLE, captions: bool = False) -> HFImages | HFStream | None:
    """One split of ``hf:root`` (None for a test split that is not there); see the module docstring."""
    source, train_name = parse_root(root)
    splits = load(source, bool(streaming))
    if train_name and "[" in train_name and train_name not in splits:  # a slice: load_dataset reads it
        hfd = require("datasets", WHAT)
        try:
            splits = {**splits, train_name: hfd.load_dataset(source, split=train_name, streaming=bool(streaming))}
        except Exception as e:
            raise DataError(f"hf:{source}: cannot read split {train_name!r} ({_first_line(e)})") from None
    names = _split_names(splits, train_name, val_split, test_split, source)
    train = _unsized(splits[names["train"]])
    cols = _Columns(train, source, captions=captions, image_column=image_column, label_column=label_column,
                    caption_column=caption_column)
    classes = [] if captions else _classes(train, cols, bool(streaming))
    name = names[split]
    if streaming:
        if name is None:
            if split == "test":
                return None
            raise DataError(f"hf:{source} has no validation split (splits: {', '.join(splits)}); name one with "
                            f"--data.options.val_split SPLIT")
        d = splits[name]
        length = epoch_length if split == "train" and epoch_length else _num_rows(d, name, source)
        return HFStream(_unsized(d), cols, classes, length=int(length), train=split == "train", seed=seed,
                        shuffle=shuffle, split=name, skip_bad=skip_bad_images)
    if name is None and split == "test":
        return None
    rows = None
    if names["val"] is None and split in ("train", "val"):  # a fixed hold-out of whole rows
        n = len(train)
        held = sorted(random.Random(0).sample(range(n), max(1, round(VAL_FRACTION * n))))
        if len(held) == n:
            raise DataError(f"hf:{source}: one row cannot give both a training and a validation split")
        keep = set(held)
        rows = held if split == "val" else [i for i in range(n) if i not in keep]
        name = names["train"]
    return HFImages(splits[name], cols, classes, rows, name, skip_bad_images)


def _num_rows(d, name: str, source: str) -> int:
    if isinstance(d, _Sized):
        return d.num_rows
    info = getattr(d, "info", None)
    n = info.splits[name].num_examples if info is not None and info.splits and name in info.splits else None
    if not n:
        raise DataError(f"hf:{source}: the stream's size ({name}) is unknown; give --data.options.epoch_length N")
    return int(n)


@register_dataset("hf", needs_root=True, preset="imagenet", takes=("seed", "skip_bad_images"))
def hf_dataset(split: str, root: str, *, seed: int = 0, skip_bad_images: bool = False, streaming: bool = False,
       image_column: str | None = None, label_column: str | None = None, val_split: str | None = None,
       test_split: str | None = None, epoch_length: int | None = None,
       shuffle: int = SHUFFLE) -> HFImages | HFStream | None:
    """``hf:SOURCE[:SPLIT]`` (see the module docstring); options: ``streaming``, ``image_column``,
    ``label_column``, ``val_split``, ``test_split``, ``epoch_length``, ``shuffle``."""
    return read_split(split, root, seed=seed, skip_bad_images=skip_bad_images, streaming=streaming,
                      image_column=image_column, label_column=label_column, val_split=val_split,
                      test_split=test_split, epoch_length=epoch_length, shuffle=shuffle)


__all__ = ["HFImages", "HFStream", "load", "parse_root", "read_split"]
