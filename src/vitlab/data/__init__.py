"""Datasets, transforms and loaders for training and evaluation: ``build(DataConfig(...)) -> DataBundle``.

Datasets are an open registry (``register_dataset``, ``list_datasets()``); built in: ``digits`` (scikit-learn's
1,797 real 8x8 handwritten digits, embedded, split 1,257 / 270 / 270 train / val / test, stratified with a fixed
seed), ``imagefolder:PATH``, ``cifar10:PATH``, ``cifar100:PATH``, ``mnist:PATH``, ``fashion-mnist:PATH``,
``fake``, and two sources for data that does not fit a folder tree: ``wds:SOURCE`` (WebDataset shards, a stream
that splits itself by rank and worker; :mod:`vitlab.data.wds`) and ``hf:SOURCE[:SPLIT]`` (Hugging Face datasets,
indexed or streamed; :mod:`vitlab.data.hf`), described in docs/data.md. Transforms are
``torchvision.transforms.v2``; presets ``imagenet`` (DeiT) and ``tiny`` are described in ``vitlab.data.core``.
Every bad-data problem raises ``DataError`` (a ``ValueError``) with one line naming the path.

    from vitlab.data import DataConfig, build
    bundle = build(DataConfig("digits"), mean=(0.5,), std=(0.5,), in_chans=1)
    for x, y in bundle.loader("train"):          # x (64, 1, 32, 32) float, y (64,) int64
        if bundle.mixup: x, y = bundle.mixup(x, y)   # y -> (64, 10) soft targets

A dataset of its own: a function of (split, root, **options) returning a Dataset of (PIL image or uint8 tensor,
label) with ``classes``, or None for a split it lacks (see ``vitlab.data.registry``):

    @register_dataset("pets", needs_root=True, preset="imagenet")
    def pets(split, root, **options): ...       # DataConfig("pets:~/data/pets") / --data pets:~/data/pets
"""

from vitlab.data import captions, hf, wds  # noqa: F401  (declares captions:, registers wds: and hf:)
from vitlab.data.core import PRESETS, DataBundle, DataConfig, build, check_num_classes
from vitlab.data.datasets import DIGITS_SPLIT, check_image_files, load_image
from vitlab.data.registry import DataError, declare_dataset, list_datasets, register_dataset

__all__ = ["DIGITS_SPLIT", "PRESETS", "DataBundle", "DataConfig", "DataError", "build", "check_image_files",
           "check_num_classes", "declare_dataset", "list_datasets", "load_image", "register_dataset"]
