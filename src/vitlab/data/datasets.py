"""The built-in datasets, registered with :func:`vitlab.data.register_dataset`; items are (image, int label).

- ``digits``: scikit-learn's 1,797 real 8x8 grayscale handwritten digits, held in memory as one uint8 tensor,
  upscaled once to the working size; a fixed stratified split (see ``DIGITS_SPLIT``).
- ``imagefolder``: ``PATH/<split>/<class>/<image>``; files are checked when the folder is scanned, so a bad
  image is named before training starts.
- ``cifar10`` / ``cifar100``: torchvision's on-disk format; a fixed stratified 45,000 / 5,000 train/val split of
  the official training set (val for model selection), the official 10,000 test images as test.
- ``mnist`` / ``fashion-mnist``: the four standard IDX files; the same stratified hold-out (55,000 / 5,000).
- ``fake``: synthetic images, a deterministic function of (seed, split, index); label = index % num_classes.

Images are uint8 (in_chans, H, W) tensors, except imagefolder's PIL images; :func:`as_uint8` converts either to
the model's channels.
"""

from __future__ import annotations

import functools
import os
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch import Tensor
from torch.utils.data import Dataset
from torchvision.transforms.v2 import functional as TF

from vitlab._console import say
from vitlab.data.registry import DataError, register_dataset

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp", ".gif")

# Fixed, independent of DataConfig.seed, so every run (and every paper table) sees the same digits test set.
DIGITS_SPLIT_SEED = 0
DIGITS_SPLIT = {"train": 1257, "val": 270, "test": 270}  # 70 / 15 / 15 of 1,797, stratified by class
HOLDOUT_SIZE = 5000  # CIFAR, MNIST, Fashion-MNIST: the validation images held out of the training set


def to_chans(img: Image.Image, in_chans: int) -> Tensor:
    """A PIL image as a uint8 tensor (in_chans, H, W); alpha is composited over white, colour averaged to 'L'."""
    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        # Transparent pixels carry arbitrary colour underneath; a white backdrop is what a viewer shows.
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        img = Image.alpha_composite(background, rgba)
    img = img.convert("L" if in_chans == 1 else "RGB")
    return TF.pil_to_tensor(img)


def match_chans(x: Tensor, in_chans: int) -> Tensor:
    """uint8 images (..., 1 or 3, H, W) with ``in_chans`` channels: grey repeated, colour averaged to luma."""
    c = x.shape[-3]
    if c == in_chans:
        return x
    if c == 1:
        return x.expand(*x.shape[:-3], 3, *x.shape[-2:]).contiguous()
    # ITU-R 601 luma, the same weights PIL's convert('L') uses for image files.
    w = torch.tensor([0.299, 0.587, 0.114]).view(3, 1, 1)
    return (x.float() * w).sum(-3, keepdim=True).round().clamp(0, 255).to(torch.uint8)


def as_uint8(image: Image.Image | Tensor, in_chans: int) -> Tensor:
    """A dataset's image (a PIL image or a uint8 (1 or 3, H, W) tensor) as a uint8 tensor (in_chans, H, W)."""
    if isinstance(image, Image.Image):
        return to_chans(image, in_chans)
    if isinstance(image, Tensor) and image.dtype == torch.uint8 and image.ndim == 3 and image.shape[0] in (1, 3):
        return match_chans(image, in_chans)
    what = f"{image.dtype} tensor {tuple(image.shape)}" if isinstance(image, Tensor) else type(image).__name__
    raise DataError(f"an image must be a PIL image or a uint8 (C, H, W) tensor with 1 or 3 channels, got {what}")


def open_image(path: str | os.PathLike) -> Image.Image:
    """An image file, decoded; DataError naming the file when it cannot be read."""
    try:
        with Image.open(path) as img:
            img.load()
            return img
    except (OSError, UnidentifiedImageError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise DataError(f"unreadable image {path}: {e}") from None


def check_image_files(paths) -> list[str]:
    """``paths`` as strings, each an existing file: one-line errors for none, a directory or a missing file."""
    if not paths:
        raise ValueError("no images given")
    for p in map(Path, paths):
        if p.is_dir():
            raise ValueError(f"{p} is a directory; pass image files (e.g. {p}/*.png)")
        if not p.is_file():
            raise FileNotFoundError(f"image not found: {p}")
    return [str(p) for p in paths]


def load_image(path: str | os.PathLike, in_chans: int) -> Tensor:
    """Read an image file as a uint8 tensor (in_chans, H, W); DataError naming the file when it cannot be read."""
    return to_chans(open_image(path), in_chans)


class TensorImages(Dataset):
    """In-memory uint8 images (N, C, H, W) with int64 labels (N,) and the class names."""

    def __init__(self, images: Tensor, labels: Tensor, classes: list[str]):
        self.images, self.labels, self.classes = images, labels, classes

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[Tensor, int]:
        return self.images[i], int(self.labels[i])


def _stratified_holdout(labels: Tensor, n_holdout: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    from sklearn.model_selection import train_test_split

    idx = np.arange(len(labels))
    keep, hold = train_test_split(idx, test_size=n_holdout, stratify=labels.numpy(), random_state=seed)
    return np.sort(keep), np.sort(hold)


def _holdout_split(split: str, load: Callable[[bool], tuple[Tensor, Tensor, list[str]]]) -> TensorImages:
    """``split`` of a source with an official train / test pair, ``load(train) -> (uint8 images, int64 labels,
    classes)``: train and val are a fixed stratified hold-out of ``HOLDOUT_SIZE`` images, test the official one."""
    if split == "test":
        return TensorImages(*load(False))
    x, y, classes = load(True)
    keep, hold = _stratified_holdout(y, HOLDOUT_SIZE, seed=0)
    i = keep if split == "train" else hold
    return TensorImages(x[i], y[i], classes)


@register_dataset("digits", defaults=dict(hflip=0.0, randaugment=False, color_jitter=0.0, reprob=0.0, mixup=0.0,
                                          cutmix=0.0), takes=("img_size", "in_chans"))
def digits(split: str, root: str | None, *, img_size: int, in_chans: int) -> TensorImages:
    """One digits split as uint8 images (N, in_chans, img_size, img_size) and int64 labels."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    idx = np.arange(len(d.target))
    rest, test = train_test_split(idx, test_size=DIGITS_SPLIT["test"], stratify=d.target,
                                  random_state=DIGITS_SPLIT_SEED)
    train, val = train_test_split(rest, test_size=DIGITS_SPLIT["val"], stratify=d.target[rest],
                                  random_state=DIGITS_SPLIT_SEED)
    keep = np.sort({"train": train, "val": val, "test": test}[split])
    # Pixel values are 0..16 (ink bright on dark); scale to 0..255 so v2's uint8 ops see a full range.
    x = torch.from_numpy(np.round(d.images[keep] * (255.0 / 16.0)).astype(np.uint8)).unsqueeze(1)  # (N, 1, 8, 8)
    if img_size != x.shape[-1]:
        # Upscaled once here rather than per item: the dataset stays a small in-memory tensor (1797x1x32x32 ~ 1.8 MB).
        x = TF.resize(x, [img_size, img_size], antialias=True)
    return TensorImages(match_chans(x, in_chans), torch.from_numpy(d.target[keep].astype(np.int64)),
                        [str(i) for i in range(10)])


class ImageFolderSplit(Dataset):
    """``root/<class>/<image>`` for the given classes; items (PIL image, label), images decoded lazily."""

    def __init__(self, samples: list[tuple[str, int]], classes: list[str], skip_bad: bool = False):
        self.samples, self.classes, self.skip_bad = samples, classes, skip_bad
        self._warned: set[str] = set()

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[Image.Image, int]:
        for k in range(len(self.samples)):
            path, label = self.samples[(i + k) % len(self.samples)]
            try:
                return open_image(path), label
            except DataError:
                # verify() at scan time cannot see every defect (a truncated JPEG decodes only partly); with
                # skip_bad the next image stands in, so the epoch keeps its length and the run goes on.
                if not self.skip_bad:
                    raise
                if path not in self._warned:
                    self._warned.add(path)
                    warnings.warn(f"skipped unreadable image {path} ({len(self._warned)} so far)", stacklevel=2)
        raise DataError(f"empty split: no readable images among {len(self.samples)} files")


def image_ok(path: Path) -> bool:
    # Header check plus verify(): cheap next to decoding, and it catches empty, truncated and non-image files
    # before a run starts rather than hours into it.
    try:
        with Image.open(path) as img:
            img.verify()
        return True
    except Exception:  # PIL raises many unrelated types for corrupt files
        return False


def undecodable(path: str | os.PathLike) -> str | None:
    """Why ``path`` does not decode, or None when it does. A JPEG is decoded at its smallest DCT scale (1/8 a
    side, PIL's draft mode: about 1 ms for a 640 x 480 photograph, 2 at full size), which still reads every
    coefficient, so a truncated file fails here as at full size: what :func:`image_ok`'s ``verify()`` cannot
    see."""
    try:
        with Image.open(path) as img:
            img.draft("RGB", (1, 1))
            img.load()
        return None
    except Exception as e:  # PIL raises many unrelated types for corrupt files
        return str(e) or type(e).__name__


DECODE_SAYS_FROM = 2000  # images: a check of more says what it does, and how long it took (a second or more)


def first_undecodable(paths: list[str]) -> tuple[str, str] | None:
    """The first of ``paths`` (in their order) that does not decode, with the reason (:func:`undecodable`), or
    None. Decoded on a thread per CPU (PIL releases the GIL while it decodes); for many, a line on the console
    before and one after (the count, the time)."""
    many, start = len(paths) >= DECODE_SAYS_FROM, time.perf_counter()
    if many:
        say(f"decoding {len(paths):,} images once to check them")
    pool = ThreadPoolExecutor(max_workers=min(os.cpu_count() or 1, 8))
    try:
        for path, why in zip(paths, pool.map(undecodable, paths)):
            if why is not None:
                return path, why
    finally:
        pool.shutdown(cancel_futures=True)  # the rest unchecked once one has failed
    if many:
        seconds = time.perf_counter() - start
        say(f"all {len(paths):,} images decode ({seconds:.1f} s, {len(paths) / max(seconds, 1e-9):,.0f} images/s)")
    return None


def class_dirs(root: Path) -> list[str]:
    """The sorted class folder names of one split folder (hidden ones skipped)."""
    if not root.is_dir():
        raise DataError(f"missing directory {root}")
    found = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not found:
        raise DataError(f"no class directories in {root} (expected {root}/<class>/<image>)")
    return found


def scan_imagefolder(root: Path, classes: list[str], skip_bad: bool) -> list[tuple[str, int]]:
    """(path, label) pairs of one split folder; ``classes`` fixes the label order (the train split's)."""
    found = class_dirs(root)
    extra = [c for c in found if c not in classes]
    if extra:
        raise DataError(f"class directory {root / extra[0]} is not among the train classes "
                        f"({len(extra)} unknown class(es))")
    samples, bad = [], []
    for c in found:
        files = sorted(p for p in (root / c).rglob("*") if p.is_file() and p.suffix.lower() in IMG_EXTENSIONS)
        if not files:
            raise DataError(f"class directory without images: {root / c}")
        label = classes.index(c)
        for p in files:
            if image_ok(p):
                samples.append((str(p), label))
            elif skip_bad:
                bad.append(p)
            else:
                raise DataError(f"unreadable image {p} (pass skip_bad_images / --skip-bad-images to skip it)")
    if bad:
        warnings.warn(f"skipped {len(bad)} unreadable image(s) under {root} (first: {bad[0]})", stacklevel=3)
    if not samples:
        raise DataError(f"empty split: no readable images in {root}")
    return samples


@register_dataset("imagefolder", needs_root=True, preset="imagenet", takes=("skip_bad_images",))
def imagefolder(split: str, root: str, *, skip_bad_images: bool = False) -> ImageFolderSplit | None:
    """``root/<split>/<class>/<image>``; train and val are required, test is read when ``root/test`` exists."""
    path = Path(root)
    if not path.is_dir():
        raise DataError(f"missing directory {path}")
    if split == "test" and not (path / "test").exists():
        return None
    classes = class_dirs(path / "train")
    return ImageFolderSplit(scan_imagefolder(path / split, classes, skip_bad_images), classes, skip_bad_images)


def load_cifar(kind: str, root: Path, download: bool, in_chans: int, train: bool) -> tuple[Tensor, Tensor, list[str]]:
    """The official training or test set as (uint8 images (N, in_chans, 32, 32), int64 labels, class names)."""
    from torchvision import datasets

    cls = datasets.CIFAR10 if kind == "cifar10" else datasets.CIFAR100
    if not download and not root.is_dir():
        raise DataError(f"missing directory {root} ({kind}; pass download=True / --download to fetch it)")
    try:
        d = cls(str(root), train=train, download=download)
    except RuntimeError as e:
        hint = "" if download else "; pass download=True / --download to fetch it"
        raise DataError(f"{kind} not found or corrupt under {root}: {e}{hint}".replace("\n", " ")) from None
    x = torch.from_numpy(d.data).permute(0, 3, 1, 2).contiguous()  # (N, 32, 32, 3) -> (N, 3, 32, 32)
    return match_chans(x, in_chans), torch.tensor(d.targets), list(d.classes)


def cifar_split(kind: str, split: str, root: str, *, in_chans: int, download: bool = False) -> TensorImages:
    """CIFAR-10 / -100 in torchvision's on-disk format: a 45,000 / 5,000 train / val hold-out, the official test."""
    return _holdout_split(split, functools.partial(load_cifar, kind, Path(root), download, in_chans))


register_dataset("cifar10", needs_root=True, takes=("in_chans", "download"))(functools.partial(cifar_split, "cifar10"))
register_dataset("cifar100", needs_root=True, takes=("in_chans", "download"))(
    functools.partial(cifar_split, "cifar100"))


IDX_CLASSES = {
    "mnist": [str(i) for i in range(10)],
    "fashion-mnist": ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
                      "Ankle boot"],
}


def read_idx(path: Path) -> np.ndarray:
    """An IDX file (LeCun's MNIST format, gzipped or not) of unsigned bytes as an array of its shape."""
    import gzip

    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError) as e:
        raise DataError(f"cannot read {path}: {e}") from None
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] != 0x08:
        raise DataError(f"{path} is not an IDX file of unsigned bytes (magic {data[:4].hex()})")
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    body = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if body.size != int(np.prod(dims)):
        raise DataError(f"{path} is truncated: {body.size} bytes for shape {tuple(dims)}")
    return body.reshape(dims)


def load_idx(kind: str, root: Path, in_chans: int, train: bool) -> tuple[Tensor, Tensor, list[str]]:
    """MNIST / Fashion-MNIST's training or test set from the standard IDX files under ``root``
    (``train-images-idx3-ubyte`` ..., ``.gz`` or not): uint8 images (N, in_chans, 28, 28), labels, class names."""
    if not root.is_dir():
        raise DataError(f"missing directory {root} ({kind}: the four IDX files, e.g. from Debian's "
                        f"dataset-fashion-mnist in /usr/share/datasets/fashion-mnist)")

    def find(stem: str) -> Path:
        for name in (stem, stem + ".gz"):
            if (root / name).is_file():
                return root / name
        raise DataError(f"{kind}: missing {root / stem}[.gz]")

    split = "train" if train else "t10k"
    x = torch.from_numpy(read_idx(find(f"{split}-images-idx3-ubyte")).copy()).unsqueeze(1)
    y = torch.from_numpy(read_idx(find(f"{split}-labels-idx1-ubyte")).astype(np.int64))
    if x.ndim != 4 or len(x) != len(y):
        raise DataError(f"{kind}: {split} images {tuple(x.shape)} and labels {tuple(y.shape)} do not match")
    return match_chans(x, in_chans), y, list(IDX_CLASSES[kind])


def idx_split(kind: str, split: str, root: str, *, in_chans: int) -> TensorImages:
    """MNIST / Fashion-MNIST from the four IDX files: a 55,000 / 5,000 train / val hold-out, the official test."""
    return _holdout_split(split, functools.partial(load_idx, kind, Path(root), in_chans))


# a mirrored digit is not that digit (a mirrored shirt is still a shirt)
register_dataset("mnist", needs_root=True, defaults=dict(hflip=0.0), takes=("in_chans",))(
    functools.partial(idx_split, "mnist"))
register_dataset("fashion-mnist", needs_root=True, takes=("in_chans",))(functools.partial(idx_split, "fashion-mnist"))


class FakeImages(Dataset):
    """Synthetic uint8 images: uniform noise around a class-dependent grey level, so a model can learn a little."""

    def __init__(self, num_samples: int, num_classes: int, img_size: int, in_chans: int, seed: int):
        self.n, self.num_classes, self.img_size, self.in_chans = num_samples, num_classes, img_size, in_chans
        self.seed, self.classes = seed, [str(i) for i in range(num_classes)]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[Tensor, int]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        label = i % self.num_classes
        # A per-item generator makes each image a function of (seed, index) only, whatever the worker or order.
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        base = int(255 * (label + 0.5) / self.num_classes)
        noise = torch.randint(-48, 49, (self.in_chans, self.img_size, self.img_size), generator=g)
        return (noise + base).clamp(0, 255).to(torch.uint8), label


@register_dataset("fake", preset=lambda cfg: "imagenet" if cfg.fake_img_size >= 64 else "tiny",
                  defaults=lambda cfg: {"img_size": cfg.fake_img_size},
                  takes=("in_chans", "seed", "fake_num_samples", "fake_num_classes", "fake_img_size"))
def fake(split: str, root: str | None, *, in_chans: int, seed: int, fake_num_samples: int, fake_num_classes: int,
         fake_img_size: int) -> FakeImages | None:
    """``fake_num_samples`` training images, a quarter as many (at least one per class) for val, no test."""
    if split == "test":
        return None
    n = fake_num_samples if split == "train" else max(fake_num_classes, fake_num_samples // 4)
    return FakeImages(n, fake_num_classes, fake_img_size, in_chans, seed * 7 + (split == "val"))
