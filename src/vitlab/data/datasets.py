"""The data sources behind ``vitlab.data.build``; each item is (uint8 image (in_chans, H, W), int label).

- ``digits``: scikit-learn's 1,797 real 8x8 grayscale handwritten digits, held in memory as one uint8 tensor,
  upscaled once to the working size; a fixed stratified split (see ``DIGITS_SPLIT``).
- ``imagefolder``: ``PATH/<split>/<class>/<image>``; files are checked when the folder is scanned, so a bad
  image is named before training starts.
- ``cifar10`` / ``cifar100``: torchvision's on-disk format; a fixed stratified 45,000 / 5,000 train/val split of
  the official training set (val for model selection), the official 10,000 test images as test.
- ``fake``: synthetic images, a deterministic function of (seed, split, index); label = index % num_classes.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch import Tensor
from torch.utils.data import Dataset
from torchvision.transforms.v2 import functional as TF


class DataError(ValueError):
    """A problem with the data (missing directory, empty class, unreadable image, ...): one line, naming the path."""


IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp", ".gif")

# Fixed, independent of DataConfig.seed, so every run (and every paper table) sees the same digits test set.
DIGITS_SPLIT_SEED = 0
DIGITS_SPLIT = {"train": 1257, "val": 270, "test": 270}  # 70 / 15 / 15 of 1,797, stratified by class
CIFAR_VAL_SIZE = 5000


def to_chans(img: Image.Image, in_chans: int) -> Tensor:
    """A PIL image as a uint8 tensor (in_chans, H, W); alpha is composited over white, colour averaged to 'L'."""
    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        # Transparent pixels carry arbitrary colour underneath; a white backdrop is what a viewer shows.
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        img = Image.alpha_composite(background, rgba)
    img = img.convert("L" if in_chans == 1 else "RGB")
    return TF.pil_to_tensor(img)


def load_image(path: str | os.PathLike, in_chans: int) -> Tensor:
    """Read an image file as a uint8 tensor (in_chans, H, W); DataError naming the file when it cannot be read."""
    try:
        with Image.open(path) as img:
            img.load()
            return to_chans(img, in_chans)
    except (OSError, UnidentifiedImageError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise DataError(f"unreadable image {path}: {e}") from None


class TensorImages(Dataset):
    """In-memory uint8 images (N, C, H, W) with labels, passed through ``transform``."""

    def __init__(self, images: Tensor, labels: Tensor, transform: Callable | None = None):
        self.images, self.labels, self.transform = images, labels, transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[Tensor, int]:
        x = self.images[i]
        return (self.transform(x) if self.transform else x), int(self.labels[i])


def digits_arrays(img_size: int, in_chans: int) -> tuple[dict[str, tuple[Tensor, Tensor]], list[str]]:
    """The three digits splits as uint8 images (N, in_chans, img_size, img_size) and int64 labels."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    # Pixel values are 0..16 (ink bright on dark); scale to 0..255 so v2's uint8 ops see a full range.
    x = torch.from_numpy(np.round(d.images * (255.0 / 16.0)).astype(np.uint8)).unsqueeze(1)  # (1797, 1, 8, 8)
    if img_size != x.shape[-1]:
        # Upscaled once here rather than per item: the dataset stays a small in-memory tensor (1797x1x32x32 ~ 1.8 MB).
        x = TF.resize(x, [img_size, img_size], antialias=True)
    if in_chans == 3:
        x = x.expand(-1, 3, -1, -1).contiguous()
    y = torch.from_numpy(d.target.astype(np.int64))
    idx = np.arange(len(y))
    rest, test = train_test_split(idx, test_size=DIGITS_SPLIT["test"], stratify=d.target,
                                  random_state=DIGITS_SPLIT_SEED)
    train, val = train_test_split(rest, test_size=DIGITS_SPLIT["val"], stratify=d.target[rest],
                                  random_state=DIGITS_SPLIT_SEED)
    splits = {k: (x[torch.from_numpy(np.sort(v))], y[torch.from_numpy(np.sort(v))])
              for k, v in (("train", train), ("val", val), ("test", test))}
    return splits, [str(i) for i in range(10)]


class ImageFolderSplit(Dataset):
    """``root/<class>/<image>`` for the given classes; images loaded lazily, converted to ``in_chans``."""

    def __init__(self, samples: list[tuple[str, int]], in_chans: int, transform: Callable | None = None,
                 skip_bad: bool = False):
        self.samples, self.in_chans, self.transform, self.skip_bad = samples, in_chans, transform, skip_bad
        self._warned: set[str] = set()

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[Tensor, int]:
        for k in range(len(self.samples)):
            path, label = self.samples[(i + k) % len(self.samples)]
            try:
                x = load_image(path, self.in_chans)
            except DataError:
                # verify() at scan time cannot see every defect (a truncated JPEG decodes only partly); with
                # skip_bad the next image stands in, so the epoch keeps its length and the run goes on.
                if not self.skip_bad:
                    raise
                if path not in self._warned:
                    self._warned.add(path)
                    warnings.warn(f"skipped unreadable image {path} ({len(self._warned)} so far)", stacklevel=2)
                continue
            return (self.transform(x) if self.transform else x), label
        raise DataError(f"empty split: no readable images among {len(self.samples)} files")


def _image_ok(path: Path) -> bool:
    # Header check plus verify(): cheap next to decoding, and it catches empty, truncated and non-image files
    # before a run starts rather than hours into it.
    try:
        with Image.open(path) as img:
            img.verify()
        return True
    except Exception:  # PIL raises many unrelated types for corrupt files
        return False


def scan_imagefolder(root: Path, classes: list[str] | None, skip_bad: bool) -> tuple[list[tuple[str, int]], list[str]]:
    """(path, label) pairs of one split folder; ``classes`` fixes the label order (the train split's)."""
    if not root.is_dir():
        raise DataError(f"missing directory {root}")
    found = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not found:
        raise DataError(f"no class directories in {root} (expected {root}/<class>/<image>)")
    if classes is None:
        classes = found
    else:
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
            if _image_ok(p):
                samples.append((str(p), label))
            elif skip_bad:
                bad.append(p)
            else:
                raise DataError(f"unreadable image {p} (pass skip_bad_images / --skip-bad-images to skip it)")
    if bad:
        warnings.warn(f"skipped {len(bad)} unreadable image(s) under {root} (first: {bad[0]})", stacklevel=3)
    if not samples:
        raise DataError(f"empty split: no readable images in {root}")
    return samples, classes


def load_cifar(kind: str, root: Path, download: bool, in_chans: int):
    """(train images, train labels, test images, test labels, class names) as uint8 (N, in_chans, 32, 32)."""
    from torchvision import datasets

    cls = datasets.CIFAR10 if kind == "cifar10" else datasets.CIFAR100
    if not download and not root.is_dir():
        raise DataError(f"missing directory {root} ({kind}; pass download=True / --download to fetch it)")
    try:
        tr = cls(str(root), train=True, download=download)
        te = cls(str(root), train=False, download=download)
    except RuntimeError as e:
        hint = "" if download else "; pass download=True / --download to fetch it"
        raise DataError(f"{kind} not found or corrupt under {root}: {e}{hint}".replace("\n", " ")) from None

    def as_tensor(a: np.ndarray) -> Tensor:
        x = torch.from_numpy(a).permute(0, 3, 1, 2).contiguous()  # (N, 32, 32, 3) -> (N, 3, 32, 32)
        if in_chans == 1:
            # ITU-R 601 luma, the same weights PIL's convert('L') uses for image files.
            w = torch.tensor([0.299, 0.587, 0.114]).view(1, 3, 1, 1)
            x = (x.float() * w).sum(1, keepdim=True).round().clamp(0, 255).to(torch.uint8)
        return x

    return (as_tensor(tr.data), torch.tensor(tr.targets), as_tensor(te.data), torch.tensor(te.targets),
            list(tr.classes))


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


def load_idx(kind: str, root: Path, in_chans: int):
    """MNIST / Fashion-MNIST from the four standard IDX files under ``root`` (``train-images-idx3-ubyte`` ...,
    ``.gz`` or not): (train images, train labels, test images, test labels, class names), uint8 (N, C, 28, 28)."""
    if not root.is_dir():
        raise DataError(f"missing directory {root} ({kind}: the four IDX files, e.g. from Debian's "
                        f"dataset-fashion-mnist in /usr/share/datasets/fashion-mnist)")

    def find(stem: str) -> Path:
        for name in (stem, stem + ".gz"):
            if (root / name).is_file():
                return root / name
        raise DataError(f"{kind}: missing {root / stem}[.gz]")

    out = []
    for split in ("train", "t10k"):
        x = torch.from_numpy(read_idx(find(f"{split}-images-idx3-ubyte")).copy()).unsqueeze(1)
        y = torch.from_numpy(read_idx(find(f"{split}-labels-idx1-ubyte")).astype(np.int64))
        if x.ndim != 4 or len(x) != len(y):
            raise DataError(f"{kind}: {split} images {tuple(x.shape)} and labels {tuple(y.shape)} do not match")
        out += [x.repeat(1, 3, 1, 1) if in_chans == 3 else x, y]
    return (*out, list(IDX_CLASSES[kind]))


class FakeImages(Dataset):
    """Synthetic uint8 images: uniform noise around a class-dependent grey level, so a model can learn a little."""

    def __init__(self, num_samples: int, num_classes: int, img_size: int, in_chans: int, seed: int,
                 transform: Callable | None = None):
        self.n, self.num_classes, self.img_size, self.in_chans = num_samples, num_classes, img_size, in_chans
        self.seed, self.transform = seed, transform

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
        x = (noise + base).clamp(0, 255).to(torch.uint8)
        return (self.transform(x) if self.transform else x), label
