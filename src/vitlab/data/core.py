"""``DataConfig`` -> ``build`` -> ``DataBundle``: datasets, transforms, batch MixUp/CutMix and loaders.

Datasets are registered by name (:func:`vitlab.data.register_dataset`); ``build`` reads the train, val and test
splits of ``DataConfig.dataset`` (``NAME`` or ``NAME:ROOT``), converts each image to the model's channels and applies
the train or eval transform.

Knob resolution: a ``DataConfig`` field left at ``None`` takes the dataset's registered default (``defaults=``),
else the preset's (``PRESETS``; the dataset's ``preset=`` unless one is named); a field set explicitly always wins.
``DataBundle.config`` holds the resolved values.

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

Splits: digits 1,257 / 270 / 270 (train / val / test, stratified, fixed seed); CIFAR, MNIST and Fashion-MNIST
(``mnist:PATH`` / ``fashion-mnist:PATH``: the standard IDX files, 28x28 grayscale, tiny preset, no flip for MNIST)
45,000 / 5,000 / 10,000 and 55,000 / 5,000 / 10,000;
imagefolder PATH/train, PATH/val, optional PATH/test; fake ``fake_num_samples`` / a quarter of it (at least
one per class) / none.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, IterableDataset

from vitlab.data import datasets as ds
from vitlab.data.registry import DATASETS, SPLITS, DataError, DatasetSpec, dataset_spec
from vitlab.data.streaming import StreamImages
from vitlab.data.transforms import batch_mixup, channel_stats, eval_transform, train_transform

PRESETS: dict[str, dict] = {
    "imagenet": dict(img_size=224, scale=(0.08, 1.0), hflip=0.5, randaugment=True, color_jitter=0.0,
                     reprob=0.25, mixup=0.8, cutmix=1.0, crop_pct=0.875),
    "tiny": dict(img_size=32, scale=(0.75, 1.0), hflip=0.5, randaugment=True, color_jitter=0.0,
                 reprob=0.25, mixup=0.8, cutmix=1.0, crop_pct=1.0),
}

_KNOBS = ("img_size", "scale", "hflip", "randaugment", "color_jitter", "reprob", "mixup", "cutmix", "crop_pct")


@dataclass
class DataConfig:
    """Which data and how it is augmented; ``None`` fields are filled from the preset (see module docstring)."""

    dataset: str = "digits"        # NAME or NAME:PATH: digits, fake, imagefolder:PATH, ... (list_datasets())
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
    options: dict = field(default_factory=dict)  # the dataset's own keyword options

    def __post_init__(self):
        if self.scale is not None:
            self.scale = tuple(float(s) for s in self.scale)  # YAML gives lists
        # An unknown name is left to build(): a plugin may register it later.
        if self.name in DATASETS:
            DATASETS[self.name].check_root(self.root)
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

    @property
    def root(self) -> str | None:
        """The ROOT of NAME:ROOT as the dataset's function gets it (``~`` expanded), else None."""
        return str(self.path) if self.path else None

    def resolved(self) -> DataConfig:
        """A copy with preset, img_size and every augmentation knob filled in from the dataset's registration."""
        spec = dataset_spec(self.name)
        preset = self.preset or (spec.preset(self) if callable(spec.preset) else spec.preset)
        if preset not in PRESETS:
            raise DataError(f"dataset {self.name} asks for unknown preset {preset!r}; expected one of: "
                            f"{', '.join(PRESETS)}")
        values = {**PRESETS[preset], **(spec.defaults(self) if callable(spec.defaults) else spec.defaults)}
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
        if shuffle is None:  # a stream shuffles itself
            shuffle = is_train and sampler is None and not isinstance(dataset, IterableDataset)
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


class ClassImages(Dataset):
    """A registered dataset's split as (transformed image, int label): each image (PIL or uint8 tensor) is made a
    uint8 (in_chans, H, W) tensor, then passed through ``transform`` (settable, e.g. to a multi-view transform).
    Other attributes are the source dataset's (``labels``, ``samples``, ...)."""

    def __init__(self, dataset: Dataset, in_chans: int, transform: Callable | None):
        self.dataset, self.in_chans, self.transform = dataset, in_chans, transform
        self.classes: list[str] = list(dataset.classes)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> tuple[Tensor, int]:
        image, label = self.dataset[i]
        x = ds.as_uint8(image, self.in_chans)
        return (self.transform(x) if self.transform else x), int(label)

    def __getattr__(self, name: str):
        if name == "dataset":  # not yet set (copy / unpickling): no source to look in
            raise AttributeError(name)
        return getattr(self.dataset, name)


def _read(spec: DatasetSpec, cfg: DataConfig, in_chans: int) -> dict[str, Dataset | None]:
    """The train / val / test splits ``spec``'s function reads for resolved ``cfg``, checked."""
    given = {k: in_chans if k == "in_chans" else getattr(cfg, k) for k in spec.takes}
    clash = sorted(set(given) & set(cfg.options))
    if clash:
        raise DataError(f"dataset {cfg.name}: options {', '.join(clash)} come from the DataConfig, not options")
    try:  # a mistyped option is named here, in one line, before any data is read
        inspect.signature(spec.fn).bind("train", cfg.root, **given, **cfg.options)
    except TypeError as e:
        raise DataError(f"dataset {cfg.name}: {e} (options: {cfg.options})") from None
    splits = {}
    for split in SPLITS:
        d = spec.fn(split, cfg.root, **given, **cfg.options)
        if d is None and split != "test":
            raise DataError(f"dataset {cfg.dataset} has no {split} split (build needs train and val)")
        if d is not None and not hasattr(d, "classes"):
            raise DataError(f"dataset {cfg.name}'s {split} split has no classes attribute (its class names)")
        if d is not None and len(d) == 0:
            raise DataError(f"empty split {split}: no images in {cfg.dataset} ({split})")
        splits[split] = d
    return splits


def build(cfg: DataConfig, mean: Sequence[float] = (0.5,), std: Sequence[float] = (0.5,),
          in_chans: int = 3) -> DataBundle:
    """The datasets, transforms and batch mixing for ``cfg``, normalised with the model's ``mean`` / ``std``."""
    if in_chans not in (1, 3):
        raise DataError(f"in_chans must be 1 or 3, got {in_chans}")
    spec = dataset_spec(cfg.name)
    spec.check_root(cfg.root)
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
    raw = _read(spec, r, in_chans)
    def wrap(d: Dataset, transform: Callable) -> Dataset:
        # a stream (an IterableDataset) splits itself by rank and worker: it keeps a stream's wrapper
        return (StreamImages if isinstance(d, IterableDataset) else ClassImages)(d, in_chans, transform)

    train, val, test = (None if raw[s] is None else wrap(raw[s], t_train if s == "train" else t_eval)
                        for s in SPLITS)
    classes = train.classes
    return DataBundle(train=train, val=val, test=test, num_classes=len(classes), class_names=list(classes),
                      in_chans=in_chans, img_size=size, mixup=batch_mixup(r.mixup, r.cutmix, len(classes)),
                      config=r, name=r.dataset, train_transform=t_train, eval_transform=t_eval)
