"""WebDataset shards as a training stream (``wds:SOURCE``), and :func:`pack` writing them from a dataset.

WebDataset (Aizman, Maltby and Breuel, 2019, "High Performance I/O For Large Scale Deep Learning", IEEE Big Data)
keeps a dataset as POSIX tar shards; the files of one sample are consecutive members sharing a key
(``00000042.jpg``, ``00000042.cls``), so a shard is read front to back, from disk or over HTTP, without an index of
files. timm, open_clip and torchtitan read it. Shards are read through the ``webdataset`` package (its URL opener
and tar iterators); the split, shuffle and epoch bookkeeping are vitlab's, so they are exact:

- SOURCE: a brace pattern (``shards/train-{000000..000009}.tar``; local paths, globs, or URLs that
  ``webdataset.gopen`` opens: ``https://``, ``pipe:``...), a shard index JSON (WebDataset's ``wids`` form:
  ``{"shardlist": [{"url": ..., "nsamples": ...}]}``; relative URLs are relative to the index), or a folder written
  by ``vitlab data pack`` (``train.json``, ``val.json``, ``test.json``, ``classes.json`` and the shards).
- Splits: a folder gives its ``{split}.json`` (else its ``{split}-*.tar``); a pattern or index is the train split,
  and val / test come from ``options`` ``val`` / ``test`` or, for local shards, the same pattern with its last
  ``train`` replaced by ``val`` / ``test``.
- Samples: the image is the ``jpg`` / ``jpeg`` / ``png`` / ``webp`` member; the label the ``cls`` member (an int)
  or a ``json`` member's ``label`` (an int, or a class name); the caption (image-text data) the ``txt`` member.
  Classes come from the index's ``classes`` (or the folder's ``classes.json``), else from the labels found.
- Sample counts come from the index, else from one pass over the local shards' tar headers; remote shards need an
  index. An epoch is ``epoch_length`` samples (default: all of them) of an endless sequence of passes over the
  shards, each pass in its own shard order (fixed by the seed); rank ``r`` of ``w`` reads the ``r``-th
  ``epoch_length // w`` of the epoch, and each DataLoader worker a contiguous part of that (whole batches when the
  loader sets ``batch_size``): no sample is read twice in an epoch unless ``epoch_length`` exceeds the data.
  Training splits shuffle within each worker's part through a buffer of ``shuffle`` samples (as WebDataset's
  ``shuffle``); evaluation splits read each sample once, in order.
- A corrupt sample (an image that does not decode, a missing key, a truncated shard) stops the run with one line
  naming the shard and key, or, with ``skip_bad_images``, is replaced by the previous readable sample and counted
  in one warning at the end of the epoch.
"""

from __future__ import annotations

import bisect
import functools
import glob
import io
import json
import os
import random
import re
import tarfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from vitlab._io import open_temp, write_json
from vitlab.data.registry import SPLITS, DataError, register_dataset
from vitlab.data.streaming import Stream, UnreadableSample, require, share, worker_share

IMAGE_KEYS = ("jpg", "jpeg", "png", "webp")
LABEL_KEYS = ("cls", "json")
SHUFFLE = 1000        # training shuffle buffer (samples per worker), WebDataset's usual size
SHARD_SIZE = 1000     # samples per shard written by pack
WHAT = "wds: WebDataset shards"


def _is_url(s: str) -> bool:
    return "://" in s or s.startswith("pipe:")


def _unfold(root: str) -> str:
    # DataConfig hands ROOT over as a Path string, which folds "https://" into "https:/"; URLs get it back.
    if os.path.exists(os.path.expanduser(root)):
        return root
    return re.sub(r"\b([a-z][a-z0-9+.-]*):/(?=[^/])", r"\1://", root)


@dataclass(frozen=True)
class Shard:
    url: str
    count: int


# ------------------------------------------------------------------ finding shards


def expand(pattern: str) -> list[str]:
    """The shards a pattern names (braces, ``::``-joined lists, globs for local paths), each local one checked."""
    wds = require("webdataset", WHAT)
    urls = []
    for u in wds.shardlists.expand_urls(pattern):
        if _is_url(u):
            urls.append(u)
        elif any(c in u for c in "*?["):
            urls += sorted(glob.glob(os.path.expanduser(u)))
        else:
            urls.append(os.path.expanduser(u))
    missing = [u for u in urls if not _is_url(u) and not Path(u).is_file()]
    if not urls or len(missing) == len(urls):
        raise DataError(f"shard pattern {pattern} matches nothing" + (f" (no file {missing[0]})" if missing else ""))
    if missing:
        raise DataError(f"shard pattern {pattern}: {len(missing)} of {len(urls)} shards missing (first: {missing[0]})")
    return urls


def _read_text(url: str) -> str:
    if _is_url(url):
        with require("webdataset", WHAT).gopen(url) as f:
            return f.read().decode("utf-8")
    path = Path(url).expanduser()
    if not path.is_file():
        raise DataError(f"shard index not found: {path}")
    return path.read_text(encoding="utf-8")


def read_index(url: str) -> tuple[list[Shard], list[str] | None]:
    """A shard index JSON (``{"shardlist": [{"url", "nsamples"}], "classes": [...]}``) as shards and classes."""
    try:
        d = json.loads(_read_text(url))
        base = url.rsplit("/", 1)[0] if _is_url(url) else str(Path(url).expanduser().parent)
        shards = []
        for s in d["shardlist"]:
            u = str(s["url"])
            if not _is_url(u) and not os.path.isabs(u):
                u = f"{base}/{u}" if _is_url(url) else str(Path(base) / u)
            shards.append(Shard(u, int(s["nsamples"])))
    except json.JSONDecodeError as e:
        raise DataError(f"{url} is not a shard index: not JSON ({e.msg})") from None
    except (KeyError, TypeError, ValueError) as e:
        raise DataError(f"{url} is not a shard index: expected {{\"shardlist\": [{{\"url\", \"nsamples\"}}]}} "
                        f"({type(e).__name__}: {e})") from None
    if not shards:
        raise DataError(f"shard index {url} lists no shards")
    missing = [s.url for s in shards if not _is_url(s.url) and not Path(s.url).is_file()]
    if missing:
        raise DataError(f"shard index {url}: {len(missing)} shard(s) missing (first: {missing[0]})")
    classes = d.get("classes")
    return shards, (list(map(str, classes)) if classes is not None else None)


def _key(name: str) -> tuple[str | None, str | None]:
    # WebDataset's own rule: the key is the path up to the first dot of the file name, the rest the extension.
    m = re.match(r"^((?:.*/|)[^.]+)[.]([^/]*)$", name)
    return (m.group(1), m.group(2).lower()) if m else (None, None)


def _label_of(ext: str, data: bytes) -> int | str | None:
    if ext == "cls":
        return int(data.decode("utf-8").strip())
    value = json.loads(data)
    return value.get("label") if isinstance(value, dict) else None


def scan(path: str, skip_bad: bool = False) -> tuple[int, set]:
    """(samples, labels found) of a local shard from its tar headers and label members (images are not read);
    remembered per file (path, size, modification time), so reading a split's classes again costs nothing."""
    st = os.stat(path)
    return _scan(path, st.st_size, st.st_mtime_ns, skip_bad)


@functools.lru_cache(maxsize=65536)
def _scan(path: str, size: int, mtime_ns: int, skip_bad: bool) -> tuple[int, frozenset]:
    count, labels, last = 0, set(), None
    plain = path.endswith(".tar")  # member offsets are file offsets only in an uncompressed tar
    try:
        with tarfile.open(path, "r:*") as tar:
            for m in tar:
                if not m.isreg():
                    continue
                key, ext = _key(m.name)
                if key is None or key.rsplit("/", 1)[-1].startswith("__"):
                    continue
                if key != last:
                    count, last = count + 1, key
                if plain and m.offset_data + m.size > size:
                    # a seekable tar read past its end just stops; the cut member's sample is not whole
                    count -= 1
                    raise tarfile.ReadError(f"truncated in {m.name}")
                if ext in LABEL_KEYS:
                    try:
                        labels.add(_label_of(ext, tar.extractfile(m).read()))
                    except (ValueError, UnicodeDecodeError):
                        pass  # named when the sample is read
            if plain:  # a tar cut between members reads as a shorter one but lacks its end-of-archive blocks
                with open(path, "rb") as f:
                    f.seek(tar.offset)
                    end = f.read(512)
                if len(end) < 512 or end.strip(b"\0"):
                    raise tarfile.ReadError("no end-of-archive marker (truncated)")
    except (tarfile.TarError, OSError, EOFError) as e:
        if not skip_bad:
            raise DataError(f"corrupt shard {path}: {e} (pass skip_bad_images / --data.skip_bad_images to read "
                            f"its readable samples)") from None
        warnings.warn(f"corrupt shard {path}: {e}; its first {count} samples are read", stacklevel=2)
    return count, frozenset(labels - {None})


def classes_from(labels: set, source: str) -> list[str]:
    """Class names for the labels found in shards: ``0..max`` for ints, the sorted names for strings."""
    ints = {x for x in labels if isinstance(x, int)}
    if not labels:
        raise DataError(f"{source}: no cls or json label in the shards (image-text shards are read by --task clip)")
    if ints == labels:
        if min(ints) < 0:
            raise DataError(f"{source}: negative class index {min(ints)}")
        return [str(i) for i in range(max(ints) + 1)]
    if ints:
        raise DataError(f"{source}: labels mix class indices and class names")
    return sorted(map(str, labels))


def open_shards(source: str | list[str], skip_bad: bool = False) -> tuple[list[Shard], list[str] | None, set]:
    """Shards with their counts, the classes their index names (or None) and the labels a scan found."""
    if isinstance(source, str) and source.endswith(".json"):
        shards, classes = read_index(source)
        return shards, classes, set()
    urls = [u for s in ([source] if isinstance(source, str) else source) for u in expand(s)]
    remote = [u for u in urls if _is_url(u)]
    if remote:
        raise DataError(f"{remote[0]} is remote and its sample count is unknown: read remote shards through a shard "
                        f"index JSON ({{\"shardlist\": [{{\"url\", \"nsamples\"}}]}}, as vitlab data pack writes)")
    shards, labels = [], set()
    for u in urls:
        n, found = scan(u, skip_bad)
        shards.append(Shard(u, n))
        labels |= found
    if not sum(s.count for s in shards):
        raise DataError(f"no samples in {source}")
    return shards, None, labels


def split_source(root: str, split: str, named: str | None) -> str | list[str] | None:
    """What ``wds:root`` reads for ``split``: the option naming it, the folder's index or shards, or (local
    patterns) the train pattern with its last ``train`` replaced by the split; None when there is none."""
    if named:
        return named
    path = Path(root).expanduser()
    if not _is_url(root) and path.is_dir():
        if (path / f"{split}.json").is_file():
            return str(path / f"{split}.json")
        found = sorted(glob.glob(str(path / f"{split}-*.tar")))
        return found or None
    if split == "train":
        return root
    i = root.rfind("train")
    if i < 0 or _is_url(root):
        return None
    other = root[:i] + split + root[i + 5:]
    try:
        expand(other) if not other.endswith(".json") else read_index(other)
    except DataError:
        return None
    return other


def _folder_classes(root: str) -> list[str] | None:
    path = Path(root).expanduser() / "classes.json"
    if _is_url(root) or not path.is_file():
        return None
    try:
        return list(map(str, json.loads(path.read_text(encoding="utf-8"))))
    except (json.JSONDecodeError, TypeError) as e:
        raise DataError(f"{path}: expected a JSON list of class names ({e})") from None


# ------------------------------------------------------------------ reading


class _Missing:
    """A sample a shard should hold but does not yield (truncated or unreadable from that point)."""

    def __init__(self, reason: str):
        self.reason = reason


def shard_samples(url: str) -> Iterator[dict]:
    """The samples of one shard (``{"__key__", "__url__", ext: bytes}``), through webdataset's tar iterators."""
    wds = require("webdataset", WHAT)
    t = wds.tariterators
    return t.group_by_keys(t.tar_file_expander(t.url_opener([{"url": url}])))


def _shuffled(items: Iterator, size: int, rng: random.Random) -> Iterator:
    # WebDataset's buffer shuffle: keep `size` items, emit a random one as each new one arrives.
    buf = []
    for x in items:
        if len(buf) < size:
            buf.append(x)
            continue
        j = rng.randrange(size)
        yield buf[j]
        buf[j] = x
    rng.shuffle(buf)
    yield from buf


class ShardStream(Stream):
    """One split of WebDataset shards as a stream of (PIL image, int label) or, with ``captions``, (PIL image,
    caption); see the module docstring for the split, shuffle and epoch rules."""

    def __init__(self, shards: list[Shard], classes: list[str], *, train: bool, seed: int = 0,
                 epoch_length: int | None = None, shuffle: int = SHUFFLE, captions: bool = False,
                 skip_bad: bool = False, name: str = "wds"):
        super().__init__(name, skip_bad)
        self.shards, self.classes, self.train, self.seed = shards, classes, train, seed
        self.total = sum(s.count for s in shards)
        if not self.total:
            raise DataError(f"{name}: the shards hold no samples")
        if epoch_length is not None and int(epoch_length) < 1:
            raise DataError(f"{name}: epoch_length must be positive, got {epoch_length}")
        self.epoch_length = int(epoch_length) if epoch_length else self.total
        self.shuffle, self.captions = int(shuffle) if train else 0, captions
        self._index = {c: i for i, c in enumerate(classes)}

    def _range(self, epoch: int, rank: int, world: int, worker: int, workers: int) -> tuple[int, int]:
        """The positions (in the endless sequence of passes) this worker reads."""
        n = self._count(world, rank)
        start = epoch * self.epoch_length + rank * n if self.train else share(self.total, world, rank)[0]
        a, b = worker_share(n, workers, worker, self.batch_size)
        return start + a, start + b

    def _order(self, k: int) -> list[int]:
        order = list(range(len(self.shards)))
        if self.train:  # the same on every rank and worker: a function of (seed, pass)
            random.Random(f"{self.seed}-pass-{k}").shuffle(order)
        return order

    def _samples(self, epoch, rank, world, worker, workers) -> Iterator:
        start, stop = self._range(epoch, rank, world, worker, workers)
        items = self._positions(start, stop)
        if self.shuffle > 1:
            items = _shuffled(items, self.shuffle, random.Random(f"{self.seed}-{epoch}-{rank}-{worker}"))
        return items

    def _positions(self, start: int, stop: int) -> Iterator:
        p = start
        while p < stop:
            k, offset = divmod(p, self.total)
            order = self._order(k)
            ends = list(accumulate(self.shards[j].count for j in order))
            i = bisect.bisect_right(ends, offset)
            shard = self.shards[order[i]]
            first = offset - (ends[i] - shard.count)
            n = min(shard.count - first, stop - p)
            yield from self._read(shard, first, n)
            p += n

    def _read(self, shard: Shard, first: int, n: int) -> Iterator:
        got = 0
        try:
            for k, sample in enumerate(shard_samples(shard.url)):
                if k < first:
                    continue
                yield sample
                got += 1
                if got == n:
                    return
            reason = f"{shard.url} ends after {first + got} samples; its count is {shard.count}"
        except Exception as e:  # webdataset re-raises tar, I/O and network errors as they come
            reason = f"unreadable shard {shard.url} after sample {first + got}: {str(e).splitlines()[0]}"
        for _ in range(n - got):
            yield _Missing(reason)

    def _decode(self, s) -> tuple:
        if isinstance(s, _Missing):
            raise UnreadableSample(s.reason)
        where = f"{s['__url__']} sample {s['__key__']}"
        ext = next((e for e in IMAGE_KEYS if e in s), None)
        if ext is None:
            raise UnreadableSample(f"{where} has no image ({', '.join(IMAGE_KEYS)}); it holds "
                                   f"{', '.join(k for k in s if not k.startswith('__'))}")
        try:
            with Image.open(io.BytesIO(s[ext])) as img:
                img.load()
        except (OSError, UnidentifiedImageError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
            raise UnreadableSample(f"unreadable image {where}.{ext}: {e}") from None
        if self.captions:
            text = s.get("txt", b"").decode("utf-8", "replace").strip()
            if not text:
                raise UnreadableSample(f"{where} has no txt caption")
            return img, text
        return img, self._label(s, where)

    def _label(self, s: dict, where: str) -> int:
        ext = next((e for e in LABEL_KEYS if e in s), None)
        if ext is None:
            raise UnreadableSample(f"{where} has no label (cls or json)")
        try:
            label = _label_of(ext, s[ext])
        except (ValueError, UnicodeDecodeError) as e:
            raise UnreadableSample(f"{where}.{ext} is not a label: {e}") from None
        if isinstance(label, str) and label in self._index:
            return self._index[label]
        if isinstance(label, int) and 0 <= label < len(self.classes):
            return label
        raise UnreadableSample(f"{where}: label {label!r} is not one of the {len(self.classes)} classes")


def read_split(split: str, root: str, *, seed: int = 0, skip_bad_images: bool = False, epoch_length: int | None = None,
               shuffle: int = SHUFFLE, val: str | None = None, test: str | None = None,
               captions: bool = False, classes: list[str] | None = None) -> ShardStream | None:
    """One split of ``wds:root`` (None for a test split that is not there). Classes: ``classes``, else the
    index's or the folder's ``classes.json``, else the labels a scan finds; the caller passes the train split's
    classes to the others so labels mean the same."""
    source = split_source(root, split, {"val": val, "test": test}.get(split))
    if source is None:
        if split == "test":
            return None
        raise DataError(f"wds:{root} has no {split} shards; name them with --data.options.{split} PATTERN")
    shards, named, labels = open_shards(source, skip_bad_images)
    if captions:
        cls: list[str] = []
    else:
        cls = classes or named or _folder_classes(root) or classes_from(labels, str(source))
    return ShardStream(shards, cls, train=split == "train", seed=seed, epoch_length=epoch_length if split == "train"
                       else None, shuffle=shuffle, captions=captions, skip_bad=skip_bad_images, name=f"wds:{root}")


@register_dataset("wds", needs_root=True, preset="imagenet", takes=("seed", "skip_bad_images"))
def wds_dataset(split: str, root: str, *, seed: int = 0, skip_bad_images: bool = False, epoch_length: int | None = None,
        shuffle: int = SHUFFLE, val: str | None = None, test: str | None = None) -> ShardStream | None:
    """``wds:SOURCE`` (see the module docstring); options: ``epoch_length``, ``shuffle``, ``val``, ``test``."""
    root = _unfold(root)
    classes = None
    if split != "train":  # the train split's classes, so a val split without some class keeps the indices
        classes = read_split("train", root, seed=seed, skip_bad_images=skip_bad_images, val=val, test=test).classes
    return read_split(split, root, seed=seed, skip_bad_images=skip_bad_images, epoch_length=epoch_length,
                      shuffle=shuffle, val=val, test=test, classes=classes)


# ------------------------------------------------------------------ writing


def _encoded(image) -> tuple[str, bytes]:
    """(extension, bytes) of one image: an image file's own bytes, else PNG (lossless) of a PIL image / tensor."""
    if isinstance(image, (str, os.PathLike)):
        ext = Path(image).suffix.lower().lstrip(".")
        return ("jpg" if ext == "jpeg" else ext), Path(image).read_bytes()
    from torchvision.transforms.v2 import functional as TF

    if not isinstance(image, Image.Image):
        image = TF.to_pil_image(image)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "png", buf.getvalue()


def write_shards(items, out: Path, split: str, shard_size: int, written: list[Path]) -> list[Shard]:
    """``items`` (a sequence of (an image file path, PIL image or uint8 tensor; an int label or a str caption),
    each read when it is written) as ``split-NNNNNN.tar`` shards of ``shard_size`` samples (the label as a ``cls``
    member, the caption as ``txt``); each shard is written under a temporary name and renamed into place when
    complete."""
    wds = require("webdataset", WHAT)
    shards = []
    for i in range(0, len(items), shard_size):
        name = f"{split}-{i // shard_size:06d}.tar"
        fd, tmp = open_temp(out, prefix=f".{name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                with wds.TarWriter(f) as sink:
                    for k, (image, target) in enumerate(items[i:i + shard_size], start=i):
                        ext, data = _encoded(image)
                        kind, value = ("txt", target) if isinstance(target, str) else ("cls", str(int(target)))
                        sink.write({"__key__": f"{k:08d}", ext: data, kind: value.encode()})
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, out / name)
        except BaseException:
            if tmp.exists():
                tmp.unlink()
            raise
        written.append(out / name)
        shards.append(Shard(name, min(shard_size, len(items) - i)))
    return shards


class _Ordered:
    """``source[order[i]]`` for i in range(len(order)), read on access (slices give lists)."""

    def __init__(self, source, order: list[int]):
        self.source, self.order = source, order

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self.source[j] for j in self.order[i]]
        return self.source[self.order[i]]


def _check_out(out: str | Path, shard_size: int) -> Path:
    if shard_size < 1:
        raise DataError(f"shard size must be positive, got {shard_size}")
    out = Path(out).expanduser()
    if out.exists() and not out.is_dir():
        raise DataError(f"{out} is a file; pass a folder for the shards")
    if (out.is_dir() and any(out.glob("*.tar"))) or any((out / f"{s}.json").exists() for s in SPLITS):
        raise DataError(f"{out} already holds shards; pass a new or empty folder")
    require("webdataset", WHAT)
    return out


def _write_splits(out: Path, splits: dict, classes: list[str], shard_size: int, seed: int) -> dict:
    """Each split's items (an indexable of (image, label or caption)) as shards with their index, then
    ``classes.json``; the training items in one shuffled order. A failure removes what was written."""
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    result = {"out": str(out), "classes": list(classes), "splits": {}}
    try:
        for split, source in splits.items():
            order = list(range(len(source)))
            if split == "train":  # so that every shard holds every class
                random.Random(seed).shuffle(order)
            items = _Ordered(source, order)
            shards = write_shards(items, out, split, shard_size, written)
            index = {"__kind__": "wids-shard-index-v1", "wids_version": 1, "name": split,
                     "shardlist": [{"url": s.url, "nsamples": s.count} for s in shards], "classes": list(classes)}
            written.append(write_json(out / f"{split}.json", index))
            result["splits"][split] = {"samples": len(items), "shards": len(shards)}
        written.append(write_json(out / "classes.json", list(classes)))
    except BaseException:
        for p in written:
            p.unlink(missing_ok=True)
        if created and not any(out.iterdir()):
            out.rmdir()
        raise
    return result


def pack(dataset: str, out: str | Path, shard_size: int = SHARD_SIZE, seed: int = 0,
         skip_bad_images: bool = False) -> dict:
    """Write a dataset's splits as WebDataset shards in ``out``: ``{split}-NNNNNN.tar``, a shard index per split
    (``{split}.json``, WebDataset's ``wids`` form with the classes) and ``classes.json``. An image folder's files
    are copied as they are; other registered datasets' images are written as PNG. The training samples are
    shuffled once (with ``seed``) so that every shard holds every class. A failure leaves ``out`` as it was."""
    from vitlab.data.core import DataConfig, build
    from vitlab.data.datasets import ImageFolderSplit

    out = _check_out(out, shard_size)
    bundle = build(DataConfig(dataset=dataset, skip_bad_images=skip_bad_images, seed=seed), in_chans=3)
    splits = {}
    for split in SPLITS:
        wrapped = getattr(bundle, split)
        if wrapped is None:
            continue
        raw = wrapped.dataset
        if not hasattr(raw, "__getitem__"):
            raise DataError(f"{dataset} is a stream; pack reads datasets with indexed images")
        # an image folder's files are copied as they are; other images are read one at a time as written
        splits[split] = raw.samples if isinstance(raw, ImageFolderSplit) else raw
    return _write_splits(out, splits, bundle.class_names, shard_size, seed)


def pack_pairs(splits: dict[str, list[tuple[str, str]]], out: str | Path, shard_size: int = SHARD_SIZE,
               seed: int = 0) -> dict:
    """Image-text pairs (``{split: [(image file, caption), ...]}``, e.g. a captions folder's) as WebDataset shards
    in ``out``: each image file's bytes with its caption as the ``txt`` member, as :func:`pack` lays them out."""
    return _write_splits(_check_out(out, shard_size), splits, [], shard_size, seed)


__all__ = ["SHARD_SIZE", "Shard", "ShardStream", "expand", "open_shards", "pack", "pack_pairs", "read_index",
           "read_split", "scan", "shard_samples", "write_shards"]
