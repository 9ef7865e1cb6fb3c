"""Dense data: ``segfolder:PATH``, ``depthfolder:PATH`` and the embedded offline default (``shapes``), with joint
transforms that keep image and target aligned (torchvision v2, the target a ``tv_tensors.Mask``).

- ``segfolder:PATH`` (ADE20K / Pascal VOC layout, simplified): ``PATH/images/<name>.{jpg,png,...}`` and
  ``PATH/masks/<name>.png`` index masks (the pixel value is the class; 255 = ignore). Splits: ``images/train``
  + ``masks/train`` and ``images/val`` + ``masks/val`` when present, else every 5th image (sorted) is held out
  for validation. Class names from ``PATH/classes.txt`` (one a line) when present, else the largest label + 1.
- ``depthfolder:PATH``: ``PATH/images/<name>.*`` and ``PATH/depth/<name>.png`` (16-bit, depth = value /
  ``depth_scale``, e.g. 1000 for millimetres; 0 = invalid) or ``<name>.npy`` (float metres; 0, inf = invalid;
  NaN refused). Same split rule.
- ``shapes`` (the default): real objects, each with its own look as in a photograph -- scikit-image's horse
  silhouette filled with a crop of its colour photographs, scikit-learn's handwritten digits drawn as ink (the
  digit's grey level is the ink's opacity), the coins of its coins photograph with their own pixels (Otsu-
  thresholded, hole-filled) -- composited at random places, sizes and flips on crops of its textures (brick,
  grass, gravel), with exact masks; a deterministic function of (seed, split, index). Classes: background,
  horse, digit, coin.
  Its depth twin puts each shape on a fronto-parallel plane at a random depth (size ~ 1 / depth, as a pinhole
  camera sees it) in front of a receding textured ground plane, so the depth map is exact.
- The real depth sample: scikit-image's Middlebury 2014 Motorcycle stereo pair (left view) with its ground-truth
  disparity; depth = f * B / (d + doffs) with the published calibration (f = 3979.911 px, B = 193.001 mm,
  doffs = 124.343 px at full resolution; scikit-image's images are 1/4 size, so f and doffs are divided by 4).

Every problem -- an empty folder, a mask whose size differs from its image, a label >= num_classes other than
255, a depth file with NaNs, an unreadable file -- is a :class:`vitlab.data.DataError` naming the file, found
when the folder is scanned (before training starts).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from torchvision import tv_tensors
from torchvision.transforms import v2

from vitlab.data import DataError, declare_dataset, load_image
from vitlab.data.datasets import IMG_EXTENSIONS

# read by build_dense, not vitlab.data.build: a classifier given one of these names is sent to these tasks
declare_dataset("shapes", read_by="--task segment or --task depth")
declare_dataset("segfolder", read_by="--task segment", needs_root=True)
declare_dataset("depthfolder", read_by="--task depth", needs_root=True)

IGNORE = 255
SHAPE_CLASSES = ["background", "horse", "digit", "coin"]
MIDDLEBURY_MOTORCYCLE = {"f": 3979.911 / 4, "baseline_m": 0.193001, "doffs": 124.343 / 4}


# ---------------------------------------------------------------- transforms


def joint_transform(size: int, train: bool, mean, std, scale=(0.5, 1.0), hflip: float = 0.5, resize: bool = False,
                    depth: bool = False):
    """Image + Mask through one v2 pipeline: train -- RandomResizedCrop (the mask resampled nearest; for depth a
    plain RandomCrop, since rescaling an image changes its metric depth), flip; eval -- unchanged size
    (sliding-window inference), or resized to ``size`` when ``resize``."""
    ops = []
    if train:
        ops += [v2.RandomCrop(size, pad_if_needed=True) if depth else
                v2.RandomResizedCrop(size, scale=tuple(scale), antialias=True)]
        if hflip:
            ops += [v2.RandomHorizontalFlip(hflip)]
    elif resize:
        ops += [v2.Resize((size, size), antialias=True)]
    ops += [v2.ToDtype({tv_tensors.Image: torch.float32, "others": None}, scale=True), v2.Normalize(mean, std)]
    return v2.Compose(ops)


def apply(transform, image: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """(uint8 image (C, H, W), target (H, W) long labels or float depth) -> transformed pair (plain tensors)."""
    img, tgt = transform(tv_tensors.Image(image), tv_tensors.Mask(target[None]))
    return img.as_subclass(Tensor), tgt.as_subclass(Tensor)[0]


class PairDataset(Dataset):
    """Items (image, target) from ``load(i) -> (uint8 image, target)``, through ``transform``."""

    def __init__(self, n: int, load, transform):
        self.n, self.load, self.transform = n, load, transform

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return apply(self.transform, *self.load(i))


@dataclass
class DenseBundle:
    """What a dense task trains on: datasets of (image, target) pairs plus the config the Trainer reads."""

    train: Dataset
    val: Dataset
    test: Dataset | None
    num_classes: int               # segmentation classes (1 for depth)
    class_names: list[str]
    img_size: int                  # the training crop (and the sliding window)
    name: str
    config: object                 # the resolved vitlab.data.DataConfig (seed, num_workers, batch_size)
    in_chans: int = 3
    mean: tuple = (0.5, 0.5, 0.5)
    std: tuple = (0.5, 0.5, 0.5)
    extra: dict = field(default_factory=dict)

    def loader(self, split: str, batch_size: int | None = None, shuffle: bool | None = None, sampler=None,
               drop_last: bool | None = None, epoch: int | None = None, pin_memory: bool = False) -> DataLoader:
        """As :meth:`vitlab.data.DataBundle.loader`: (seed, epoch)-seeded shuffling for exact resume."""
        ds = getattr(self, split, None)
        if ds is None:
            raise DataError(f"dataset {self.name} has no {split} split")
        is_train = split == "train"
        batch_size = batch_size or self.config.batch_size
        shuffle = (is_train and sampler is None) if shuffle is None else shuffle
        if drop_last is None:
            drop_last = is_train and len(ds) >= batch_size
        g = torch.Generator()
        g.manual_seed(self.config.seed if epoch is None else self.config.seed * 1_000_003 + epoch)
        return DataLoader(ds, batch_size=batch_size, shuffle=shuffle, sampler=sampler, drop_last=drop_last,
                          num_workers=self.config.num_workers, generator=g, pin_memory=pin_memory)


# ---------------------------------------------------------------- folders


def _images(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.suffix.lower() in IMG_EXTENSIONS) if folder.is_dir() else []


def _split_pairs(root: Path, target_dir: str, exts: tuple[str, ...]) -> dict[str, list[tuple[Path, Path]]]:
    """{'train': [(image, target)], 'val': [...]} for ``root/images`` + ``root/<target_dir>``."""
    if not root.is_dir():
        raise DataError(f"missing directory {root}")
    if not (root / "images").is_dir():
        raise DataError(f"missing directory {root / 'images'} (expected images/ and {target_dir}/)")

    def pairs(img_dir: Path, tgt_dir: Path) -> list[tuple[Path, Path]]:
        out = []
        for img in _images(img_dir):
            tgt = next((tgt_dir / (img.stem + e) for e in exts if (tgt_dir / (img.stem + e)).is_file()), None)
            if tgt is None:
                raise DataError(f"no {target_dir[:-1] if target_dir.endswith('s') else target_dir} file for "
                                f"{img} in {tgt_dir} (expected {img.stem}{exts[0]})")
            out.append((img, tgt))
        if not out:
            raise DataError(f"empty folder: no images in {img_dir}")
        return out

    if (root / "images" / "train").is_dir():
        return {s: pairs(root / "images" / s, root / target_dir / s) for s in ("train", "val")}
    every = pairs(root / "images", root / target_dir)
    if len(every) < 2:
        raise DataError(f"{root / 'images'} holds {len(every)} image; at least 2 are needed (train and val)")
    return {"train": [p for i, p in enumerate(every) if i % 5 != 4], "val": every[4::5] or every[-1:]}


def _image_size(path: Path) -> tuple[int, int]:
    try:
        with Image.open(path) as im:
            return im.size
    except OSError as e:
        raise DataError(f"unreadable image {path}: {e}") from None


def read_mask(path: Path) -> np.ndarray:
    try:
        with Image.open(path) as im:
            if im.mode not in ("L", "P", "I", "I;16"):
                raise DataError(f"mask {path} is not an index PNG (mode {im.mode}; expected L or P)")
            return np.array(im).astype(np.int64)
    except OSError as e:
        raise DataError(f"unreadable mask {path}: {e}") from None


def read_depth(path: Path, depth_scale: float) -> np.ndarray:
    """Depth in metres (0 where invalid); DataError naming the file for NaNs or an unreadable file."""
    try:
        if path.suffix == ".npy":
            d = np.load(path, allow_pickle=False).astype(np.float32)
        else:
            with Image.open(path) as im:
                d = np.array(im).astype(np.float32) / depth_scale
    except (OSError, ValueError) as e:
        raise DataError(f"unreadable depth file {path}: {e}") from None
    if d.ndim != 2:
        raise DataError(f"depth file {path} is not a 2-D map (shape {d.shape})")
    if np.isnan(d).any():
        raise DataError(f"depth file {path} contains NaN values")
    d[~np.isfinite(d)] = 0.0
    return d


def scan_segfolder(root: Path, num_classes: int | None = None):
    """The checked (image, mask) pairs per split and the class names (see the module docstring)."""
    splits = _split_pairs(root, "masks", (".png",))
    names = None
    if (root / "classes.txt").is_file():
        names = [ln.strip() for ln in (root / "classes.txt").read_text().splitlines() if ln.strip()]
    n = num_classes or (len(names) if names else None)
    top = 0
    for pairs in splits.values():
        for img, msk in pairs:
            m = read_mask(msk)
            if (m.shape[1], m.shape[0]) != _image_size(img):
                raise DataError(f"mask {msk} is {m.shape[1]}x{m.shape[0]} but its image {img} is "
                                f"{'x'.join(map(str, _image_size(img)))}")
            labels = np.unique(m[m != IGNORE])
            if labels.size:
                if n is not None and labels.max() >= n:
                    raise DataError(f"mask {msk} has label {int(labels.max())} >= num_classes {n} (255 = ignore)")
                top = max(top, int(labels.max()))
    n = n or top + 1
    names = names or [str(i) for i in range(n)]
    return splits, names[:n] if len(names) >= n else names + [str(i) for i in range(len(names), n)]


def scan_depthfolder(root: Path, depth_scale: float):
    splits = _split_pairs(root, "depth", (".png", ".npy"))
    for pairs in splits.values():
        for img, dep in pairs:
            d = read_depth(dep, depth_scale)
            if (d.shape[1], d.shape[0]) != _image_size(img):
                raise DataError(f"depth {dep} is {d.shape[1]}x{d.shape[0]} but its image {img} is "
                                f"{'x'.join(map(str, _image_size(img)))}")
    return splits


# ---------------------------------------------------------------- the embedded shapes


def _gray(a: np.ndarray) -> np.ndarray:
    return a if a.ndim == 2 else (a[..., :3].astype(np.float32) @ [0.299, 0.587, 0.114]).astype(np.uint8)


class ShapeAssets:
    """The real pictures the synthetic scenes are cut from (:func:`shape_assets` loads them once a process).

    ``shapes[cls]`` lists ``(mask, look)`` pairs: the horse's look is ``None`` (a photograph crop is drawn per
    scene), a digit's its 0..1 grey levels (ink opacity), a coin's its own grey pixels."""

    def __init__(self):
        import skimage.data as sk
        from sklearn.datasets import load_digits

        self.textures = [sk.brick(), sk.grass(), sk.gravel()]
        self.photos = [sk.astronaut(), sk.chelsea(), sk.coffee(), sk.rocket()]
        horse = ~sk.horse()  # the silhouette is False on True
        digits = load_digits().images[:300] / 16.0  # (300, 8, 8) grey levels in 0..1
        self.shapes = {1: [(horse, None)], 2: [(d >= 6 / 16, d) for d in digits], 3: coin_masks(sk.coins())}


def coin_masks(coins: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """The coins of scikit-image's coins photograph: (exact binary mask, the coin's grey pixels) per coin (Otsu
    threshold, hole-filled, connected components of a coin's size)."""
    from scipy import ndimage
    from skimage.filters import threshold_otsu

    fg = ndimage.binary_fill_holes(ndimage.binary_opening(coins > threshold_otsu(coins), iterations=2))
    lab, n = ndimage.label(fg)
    out = []
    for sl, i in zip(ndimage.find_objects(lab), range(1, n + 1), strict=True):
        m = lab[sl] == i
        if m.sum() > 600:
            out.append((m, coins[sl]))
    return out


@functools.lru_cache(maxsize=1)
def shape_assets() -> ShapeAssets:
    return ShapeAssets()


def _crop(rng, a: np.ndarray, h: int, w: int) -> np.ndarray:
    y, x = rng.integers(0, a.shape[0] - h + 1), rng.integers(0, a.shape[1] - w + 1)
    return a[y:y + h, x:x + w]


def _resize(a: np.ndarray, h: int, w: int) -> np.ndarray:
    return np.asarray(Image.fromarray(a.astype(np.float32)).resize((w, h), Image.BILINEAR))


def _bbox(m: np.ndarray) -> tuple[slice, slice]:
    ys, xs = np.nonzero(m)
    return slice(ys.min(), ys.max() + 1), slice(xs.min(), xs.max() + 1)


def _texture_rgb(rng, assets, h, w) -> np.ndarray:
    t = _crop(rng, assets.textures[rng.integers(len(assets.textures))], h, w).astype(np.float32)
    tint = rng.uniform(0.5, 1.0, size=3)
    return np.clip(t[..., None] * tint, 0, 255)


def shapes_scene(seed: int, size: int, assets: ShapeAssets, depth: bool = False):
    """One scene: (uint8 image (3, size, size), mask (size, size) int64 or depth (size, size) float32)."""
    rng = np.random.default_rng(seed)
    img = _texture_rgb(rng, assets, size, size)
    mask = np.zeros((size, size), np.int64)
    # depth: a ground plane receding from 2 m (bottom row) to 8 m (top row)
    dep = np.repeat(np.linspace(8.0, 2.0, size, dtype=np.float32)[:, None], size, 1)
    objs = []
    for _ in range(rng.integers(1, 4)):
        cls = int(rng.integers(1, 4))
        z = float(rng.uniform(1.0, 4.0))
        objs.append((cls, z))
    objs.sort(key=lambda o: -o[1])  # far first, so nearer shapes occlude
    for cls, z in objs:
        bank = assets.shapes[cls]
        shape, look = bank[rng.integers(len(bank))]
        box = _bbox(shape)
        shape, look = shape[box], None if look is None else look[box]
        if rng.random() < 0.5:
            shape, look = shape[:, ::-1], None if look is None else look[:, ::-1]
        extent = int(size * (0.9 / z if depth else rng.uniform(0.3, 0.6)))
        ar = shape.shape[1] / shape.shape[0]
        h, w = (extent, max(4, int(extent * ar))) if ar <= 1 else (max(4, int(extent / ar)), extent)
        h, w = min(h, size), min(w, size)
        m = _resize(shape, h, w) > 0.5
        y, x = int(rng.integers(0, size - h + 1)), int(rng.integers(0, size - w + 1))
        region = img[y:y + h, x:x + w]
        if cls == 1:  # the horse: a crop of a colour photograph
            fill = _crop(rng, assets.photos[rng.integers(len(assets.photos))], h, w).astype(np.float32)
        elif cls == 2:  # a digit: ink of a random dark colour, its grey level the opacity
            alpha = np.clip(_resize(look, h, w), 0, 1)[..., None]
            fill = (1 - alpha) * region + alpha * rng.uniform(0, 60, size=3)
        else:  # a coin: its own pixels, lit a little warmer or cooler
            fill = _resize(look, h, w)[..., None] * rng.uniform(0.8, 1.2, size=3)
        region[m] = np.clip(fill, 0, 255)[m]
        mask[y:y + h, x:x + w][m] = cls
        dep[y:y + h, x:x + w][m] = z
    image = torch.from_numpy(np.ascontiguousarray(img.astype(np.uint8))).permute(2, 0, 1).contiguous()
    return image, torch.from_numpy(dep if depth else mask)


def motorcycle_sample() -> tuple[Tensor, Tensor]:
    """scikit-image's Middlebury Motorcycle left view and its ground-truth depth in metres (0 = invalid)."""
    import skimage.data as sk

    left, _, disp = sk.stereo_motorcycle()
    c = MIDDLEBURY_MOTORCYCLE
    d = np.where(np.isfinite(disp) & (disp > 0), c["f"] * c["baseline_m"] / (disp + c["doffs"]), 0.0)
    return torch.from_numpy(left).permute(2, 0, 1).contiguous(), torch.from_numpy(d.astype(np.float32))


# ---------------------------------------------------------------- build


SHAPES_SPLITS = {"train": 800, "val": 100, "test": 100}


def build_dense(data_cfg, task: str, mean, std, num_classes: int | None = None, depth_scale: float = 1000.0,
                shapes_size: int | None = None, shapes_train: int | None = None, shapes_eval: int | None = None,
                native_eval: bool = False) -> DenseBundle:
    """The bundle of ``data_cfg.dataset`` (``shapes`` | ``segfolder:PATH`` | ``depthfolder:PATH``) for ``task``
    ('segment' or 'depth'); ``data_cfg.img_size`` is the training crop (default 64 for shapes, else 512).
    ``native_eval``: folder val images at their own size (for sliding-window evaluation one at a time) instead of
    resized to the crop (what batched validation during training needs)."""
    name = data_cfg.dataset.split(":", 1)[0]
    path = data_cfg.path
    want = {"segment": ("shapes", "segfolder"), "depth": ("shapes", "depthfolder")}[task]
    if name not in want:
        raise DataError(f"--task {task} takes --data shapes or --data {want[1]}:PATH, got {data_cfg.dataset!r}")
    size = int(data_cfg.img_size or (min(64, shapes_size or 96) if name == "shapes" else 512))
    scale = data_cfg.scale or ((0.5, 1.0) if name == "shapes" else (0.3, 1.0))  # shapes: the demo recipe's
    hflip = 0.5 if data_cfg.hflip is None else data_cfg.hflip
    t_train = joint_transform(size, True, mean, std, scale, hflip, depth=task == "depth")
    t_eval = joint_transform(size, False, mean, std)
    # batched validation needs one size: folder images resized to the crop (vitlab eval scores the native size)
    t_val = t_eval if native_eval else joint_transform(size, False, mean, std, resize=True)
    test = None
    extra = {}
    if name == "shapes":
        assets = shape_assets()
        shapes_size = shapes_size or 96
        seed, depth = data_cfg.seed, task == "depth"
        counts = {"train": shapes_train or SHAPES_SPLITS["train"], "val": shapes_eval or SHAPES_SPLITS["val"],
                  "test": shapes_eval or SHAPES_SPLITS["test"]}
        base = {"train": 0, "val": 10_000_000, "test": 20_000_000}
        # each scene is drawn once and kept: the transform, not the drawing, changes between epochs
        cache = {s: [shapes_scene(seed * 100_000_007 + base[s] + i, shapes_size, assets, depth)
                     for i in range(n)] for s, n in counts.items()}
        train = PairDataset(counts["train"], cache["train"].__getitem__, t_train)
        val = PairDataset(counts["val"], cache["val"].__getitem__, t_eval)
        classes = SHAPE_CLASSES if task == "segment" else ["depth"]
        if depth:
            test = PairDataset(1, lambda i: motorcycle_sample(), t_eval)
            extra["test_name"] = "Middlebury 2014 Motorcycle (scikit-image)"
        else:
            test = PairDataset(counts["test"], cache["test"].__getitem__, t_eval)
    elif name == "segfolder":
        splits, classes = scan_segfolder(path, num_classes)

        def loader(pairs):
            return lambda i: (load_image(pairs[i][0], 3), torch.from_numpy(read_mask(pairs[i][1])))

        train = PairDataset(len(splits["train"]), loader(splits["train"]), t_train)
        val = PairDataset(len(splits["val"]), loader(splits["val"]), t_val)
    else:  # depthfolder
        splits = scan_depthfolder(path, depth_scale)
        classes = ["depth"]

        def loader(pairs):
            return lambda i: (load_image(pairs[i][0], 3), torch.from_numpy(read_depth(pairs[i][1], depth_scale)))

        train = PairDataset(len(splits["train"]), loader(splits["train"]), t_train)
        val = PairDataset(len(splits["val"]), loader(splits["val"]), t_val)
    n = len(classes) if task == "segment" else 1
    return DenseBundle(train=train, val=val, test=test, num_classes=n, class_names=list(classes), img_size=size,
                       name=data_cfg.dataset, config=data_cfg, mean=tuple(mean), std=tuple(std), extra=extra)
