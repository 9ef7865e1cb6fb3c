"""``DataConfig`` -> ``build`` -> ``DataBundle``: datasets, transforms, batch MixUp/CutMix and loaders.

Knob resolution: a ``DataConfig`` field left at ``None`` takes the dataset's default (``DATASET_DEFAULTS``), else
the preset's (``PRESETS``); a field set explicitly always wins. ``DataBundle.config`` holds the resolved values.

Presets (train augmentation and eval cropping):

======================  ============  =================  =====  ===========  ===  ======  =====  ======  ========
preset                  img_size      scale              hflip  RandAugment  cj   reprob  mixup  cutmix  crop_pct
======================  ============  =================  =====  ===========  ===  ======  =====  ======  ========
imagenet (DeiT)         224           (0.08, 1)          0.5    2 ops, m=9   0    0.25    0.8    1.0     0.875
tiny (<= 64 px images)  32            (0.75, 1)          0.5    2 ops, m=9   0    0.25    0.8    1.0     1.0
tiny, digits            32            (0.75, 1)          0      off          0    0       0      0       1.0
======================  ============  =================  =====  ===========  ===  ======  =====  ======  ========

- ``digits`` (default preset tiny): 8x8 -> 32x32 so a patch-4 (8x8 tokens) or patch-2 ViT fits. No horizontal
  flip: a mirrored 2, 3, 4, 5, 7 or 9 is not that digit. No RandAugment, colour jitter, erasing or mixing
  either: on 1,257 training digits and a short CPU budget, erasing part of an 8-pixel stroke or blending two
  digits changes the label more than it regularises; RandomResizedCrop (mild scale and aspect change) is the
  augmentation. Every knob can be switched back on.
- tiny's scale (0.75, 1) matches the usual 4-pixel pad-and-crop of 32x32 CIFAR in area; crop_pct 1 because a
  32-pixel image has no border to spare.
- DeiT's colour jitter 0.3 is inert in timm when RandAugment is on, so both presets use 0 (set it to add one).
- ``cifar10`` / ``cifar100`` default to tiny; ``imagefolder`` to imagenet; ``fake`` to imagenet when
  ``fake_img_size`` >= 64, else tiny, with img_size = ``fake_img_size``.

Splits: digits 1,257 / 270 / 270 (train / val / test, stratified, fixed seed); CIFAR 45,000 / 5,000 / 10,000;
imagefolder PATH/train, PATH/val, optional PATH/test; fake ``fake_num_samples`` / a quarter of it (at least
one per class) / none.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from vitlab.data import datasets as ds
from vitlab.data.datasets import DataError
from vitlab.data.transforms import batch_mixup, channel_stats, eval_transform, train_transform

DATASETS = ("digits", "fake", "imagefolder", "cifar10", "cifar100")
# built by vitlab.dense (``vitlab train --task segment|depth``), not by build()
DENSE_DATASETS = ("shapes", "segfolder", "depthfolder")

PRESETS: dict[str, dict] = {
    "imagenet": dict(img_size=224, scale=(0.08, 1.0), hflip=0.5, randaugment=True, color_jitter=0.0,
                     reprob=0.25, mixup=0.8, cutmix=1.0, crop_pct=0.875),
    "tiny": dict(img_size=32, scale=(0.75, 1.0), hflip=0.5, randaugment=True, color_jitter=0.0,
                 reprob=0.25, mixup=0.8, cutmix=1.0, crop_pct=1.0),
}

# Per-dataset defaults layered over whichever preset: they say what suits the data (a digit must not be mirrored).
DATASET_DEFAULTS: dict[str, dict] = {
    "digits": dict(hflip=0.0, randaugment=False, color_jitter=0.0, reprob=0.0, mixup=0.0, cutmix=0.0),
}

_KNOBS = ("img_size", "scale", "hflip", "randaugment", "color_jitter", "reprob", "mixup", "cutmix", "crop_pct")


@dataclass
class DataConfig:
    """Which data and how it is augmented; ``None`` fields are filled from the preset (see module docstring)."""

    dataset: str = "digits"        # 'digits' | 'fake' | 'imagefolder:PATH' | 'cifar10:PATH' | 'cifar100:PATH'
    img_size: int | None = None    # None -> the preset's size
    preset: Literal["tiny", "imagenet"] | None = None  # augmentation preset; None -> the dataset's default
    batch_size: int = 64           # the loaders' default batch (training uses TrainConfig.batch_size)
    num_workers: int = 0           # data loader worker processes
    download: bool = False         # cifar only; never download otherwise
    skip_bad_images: bool = False  # imagefolder: skip unreadable images (counted in one warning) instead of failing
    seed: int = 0                  # loader shuffling and fake images; the digits split is fixed regardless
    scale: tuple[float, float] | None = None   # RandomResizedCrop scale
    hflip: float | None = None                 # horizontal flip probability
    randaugment: bool | None = None            # RandAugment(rand_num_ops, rand_magnitude)
    rand_num_ops: int = 2                      # RandAugment operations per image
    rand_magnitude: int = 9                    # RandAugment magnitude
    color_jitter: float | None = None          # ColorJitter strength (0 = off)
    reprob: float | None = None                # RandomErasing p
    mixup: float | None = None                 # MixUp alpha (0 = off)
    cutmix: float | None = None                # CutMix alpha (0 = off)
    crop_pct: float | None = None              # eval resize/crop ratio
    fake_num_samples: int = 256                # fake: training images
    fake_num_classes: int = 10                 # fake: classes
    fake_img_size: int = 224                   # fake: image size

    def __post_init__(self):
        if self.scale is not None:
            self.scale = tuple(float(s) for s in self.scale)  # YAML gives lists
        name = self.dataset.split(":", 1)[0]
        if name not in DATASETS + DENSE_DATASETS:
            raise DataError(f"unknown dataset {self.dataset!r}; expected one of: digits, fake, imagefolder:PATH, "
                            "cifar10:PATH, cifar100:PATH (dense tasks: shapes, segfolder:PATH, depthfolder:PATH)")
        if name in ("imagefolder", "cifar10", "cifar100", *DENSE_DATASETS[1:]) and not self.dataset.partition(":")[2]:
            raise DataError(f"dataset {name} needs a path: {name}:PATH")
        if self.preset is not None and self.preset not in PRESETS:
            raise DataError(f"unknown preset {self.preset!r}; expected one of: {', '.join(PRESETS)}")

    def to_dict(self) -> dict:
        """Plain types only (tuples as lists), ready for ``yaml.safe_dump``; ``DataConfig(**d)`` reads it back."""
        d = dataclasses.asdict(self)
        if d["scale"] is not None:
            d["scale"] = list(d["scale"])
        return d

    @property
    def name(self) -> str:
        return self.dataset.split(":", 1)[0]

    @property
    def path(self) -> Path | None:
        p = self.dataset.partition(":")[2]
        return Path(p).expanduser() if p else None

    def resolved(self) -> DataConfig:
        """A copy with preset, img_size and every augmentation knob filled in."""
        name = self.name
        default_preset = {"imagefolder": "imagenet", "fake": "imagenet" if self.fake_img_size >= 64 else "tiny"}
        preset = self.preset or default_preset.get(name, "tiny")
        values = dict(PRESETS[preset])
        values.update(DATASET_DEFAULTS.get(name, {}))
        if name == "fake":
            values["img_size"] = self.fake_img_size
        for k in _KNOBS:
            v = getattr(self, k)
            if v is not None:
                values[k] = v
        return dataclasses.replace(self, preset=preset, **values)


@dataclass
class DataBundle:
    """Datasets of one source with its transforms; items are (normalised float (C, H, W), int label)."""

    train: Dataset
    val: Dataset
    test: Dataset | None
    num_classes: int
    class_names: list[str]
    in_chans: int
    img_size: int
    mixup: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]] | None  # batch -> (x, soft targets (B, classes))
    config: DataConfig | None = None           # the resolved config (every knob filled in)
    name: str = ""                              # 'digits', 'imagefolder:/data/x', ...
    train_transform: Callable | None = field(default=None, repr=False)
    eval_transform: Callable | None = field(default=None, repr=False)

    def loader(self, split: str, batch_size: int | None = None, shuffle: bool | None = None, sampler=None,
               drop_last: bool | None = None, epoch: int | None = None, pin_memory: bool = False) -> DataLoader:
        """A DataLoader over ``split``; shuffle and drop_last default to True for 'train' only.

        ``epoch`` seeds the shuffle with (seed, epoch), so epoch k's order does not depend on how many loaders
        came before it (exact resume); without it the loader's generator is seeded once with ``config.seed``.
        """
        if split not in ("train", "val", "test"):
            raise DataError(f"unknown split {split!r}; expected train, val or test")
        dataset = getattr(self, split)
        if dataset is None:
            raise DataError(f"dataset {self.name} has no {split} split")
        cfg = self.config or DataConfig()
        is_train = split == "train"
        batch_size = batch_size or cfg.batch_size
        if shuffle is None:
            shuffle = is_train and sampler is None
        if drop_last is None:
            # Never drop the only (partial) batch of a dataset smaller than one batch.
            n = len(sampler) if sampler is not None and hasattr(sampler, "__len__") else len(dataset)
            drop_last = is_train and n >= batch_size
        g = torch.Generator()
        g.manual_seed(cfg.seed if epoch is None else cfg.seed * 1_000_003 + epoch)
        return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, sampler=sampler, drop_last=drop_last,
                          num_workers=cfg.num_workers, generator=g, pin_memory=pin_memory,
                          persistent_workers=False)

    def preprocess(self, image) -> Tensor:
        """One image (a path, a PIL image or a uint8 tensor) through the eval transform -> float (C, H, W)."""
        from PIL import Image

        if isinstance(image, Tensor):
            x = image
        elif isinstance(image, Image.Image):
            x = ds.to_chans(image, self.in_chans)
        else:
            x = ds.load_image(image, self.in_chans)
        return self.eval_transform(x)


def check_num_classes(bundle: DataBundle, n: int, what: str = "the checkpoint") -> None:
    """DataError when the dataset's class count differs from ``n`` (e.g. a checkpoint's head)."""
    if bundle.num_classes != n:
        raise DataError(f"dataset {bundle.name} has {bundle.num_classes} classes but {what} has {n}")


def _nonempty(split: str, dataset: Dataset | None, where: str) -> None:
    if dataset is not None and len(dataset) == 0:
        raise DataError(f"empty split {split}: no images in {where}")


def _stratified_holdout(labels: Tensor, n_holdout: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    from sklearn.model_selection import train_test_split

    idx = np.arange(len(labels))
    keep, hold = train_test_split(idx, test_size=n_holdout, stratify=labels.numpy(), random_state=seed)
    return np.sort(keep), np.sort(hold)


def build(cfg: DataConfig, mean: Sequence[float] = (0.5,), std: Sequence[float] = (0.5,),
          in_chans: int = 3) -> DataBundle:
    """The datasets, transforms and batch mixing for ``cfg``, normalised with the model's ``mean`` / ``std``."""
    if in_chans not in (1, 3):
        raise DataError(f"in_chans must be 1 or 3, got {in_chans}")
    if cfg.name in DENSE_DATASETS:
        raise DataError(f"dataset {cfg.dataset!r} holds dense targets: train on it with --task segment or --task depth")
    r = cfg.resolved()
    try:
        mean, std = channel_stats(mean, in_chans), channel_stats(std, in_chans)
    except ValueError as e:
        raise DataError(str(e)) from None
    size = int(r.img_size)
    t_train = train_transform(size, scale=r.scale, hflip=r.hflip, randaugment=r.randaugment,
                              rand_num_ops=r.rand_num_ops, rand_magnitude=r.rand_magnitude,
                              color_jitter=r.color_jitter, reprob=r.reprob, mean=mean, std=std)
    t_eval = eval_transform(size, crop_pct=r.crop_pct, mean=mean, std=std)
    name, path = r.name, r.path

    if name == "digits":
        splits, classes = ds.digits_arrays(size, in_chans)
        train = ds.TensorImages(*splits["train"], t_train)
        val = ds.TensorImages(*splits["val"], t_eval)
        test = ds.TensorImages(*splits["test"], t_eval)
    elif name == "fake":
        classes = [str(i) for i in range(r.fake_num_classes)]
        n_val = max(r.fake_num_classes, r.fake_num_samples // 4)
        make = lambda n, off, t: ds.FakeImages(n, r.fake_num_classes, r.fake_img_size, in_chans,  # noqa: E731
                                               r.seed * 7 + off, t)
        train, val, test = make(r.fake_num_samples, 0, t_train), make(n_val, 1, t_eval), None
    elif name == "imagefolder":
        if not path.is_dir():
            raise DataError(f"missing directory {path}")
        samples, classes = ds.scan_imagefolder(path / "train", None, r.skip_bad_images)
        train = ds.ImageFolderSplit(samples, in_chans, t_train, r.skip_bad_images)
        samples, _ = ds.scan_imagefolder(path / "val", classes, r.skip_bad_images)
        val = ds.ImageFolderSplit(samples, in_chans, t_eval, r.skip_bad_images)
        test = None
        if (path / "test").exists():
            samples, _ = ds.scan_imagefolder(path / "test", classes, r.skip_bad_images)
            test = ds.ImageFolderSplit(samples, in_chans, t_eval, r.skip_bad_images)
    else:  # cifar10 / cifar100
        xtr, ytr, xte, yte, classes = ds.load_cifar(name, path, r.download, in_chans)
        keep, hold = _stratified_holdout(ytr, ds.CIFAR_VAL_SIZE, seed=0)
        train = ds.TensorImages(xtr[keep], ytr[keep], t_train)
        val = ds.TensorImages(xtr[hold], ytr[hold], t_eval)
        test = ds.TensorImages(xte, yte, t_eval)

    for split, d in (("train", train), ("val", val), ("test", test)):
        _nonempty(split, d, f"{r.dataset} ({split})")
    num_classes = len(classes)
    return DataBundle(train=train, val=val, test=test, num_classes=num_classes, class_names=list(classes),
                      in_chans=in_chans, img_size=size, mixup=batch_mixup(r.mixup, r.cutmix, num_classes),
                      config=r, name=r.dataset, train_transform=t_train, eval_transform=t_eval)
