"""Train / eval transforms and batch-level MixUp/CutMix, all from ``torchvision.transforms.v2``.

Per item, every source yields a ``uint8`` image tensor (C, H, W) already converted to ``in_chans``:

- train: RandomResizedCrop(img_size, scale) -> RandomHorizontalFlip(hflip) -> RandAugment(num_ops, magnitude)
  -> ColorJitter(cj, cj, cj) -> float in [0, 1] -> Normalize(mean, std) -> RandomErasing(reprob)
- eval: Resize(img_size / crop_pct) -> CenterCrop(img_size) -> float in [0, 1] -> Normalize(mean, std)

Per batch: ``RandomChoice([MixUp(mixup), CutMix(cutmix)])`` returning (x, soft targets (B, num_classes)).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from torchvision.transforms import v2


def channel_stats(values: Sequence[float], in_chans: int) -> list[float]:
    """Mean or std for ``in_chans`` channels: one value is repeated; three values average to one for grayscale."""
    values = [float(v) for v in values]
    if len(values) == in_chans:
        return values
    if len(values) == 1:
        return values * in_chans
    if in_chans == 1:
        # An RGB model config driving a 1-channel model: the luminance-free average is the honest single value.
        return [sum(values) / len(values)]
    raise ValueError(f"mean/std has {len(values)} values but in_chans is {in_chans}")


def train_transform(img_size: int, *, scale: tuple[float, float], hflip: float, randaugment: bool,
                    rand_num_ops: int, rand_magnitude: int, color_jitter: float, reprob: float,
                    mean: Sequence[float], std: Sequence[float]) -> v2.Compose:
    """The per-item training pipeline (uint8 image in, normalised float image out)."""
    ops: list = [v2.RandomResizedCrop(img_size, scale=tuple(scale), antialias=True)]
    if hflip > 0:
        ops.append(v2.RandomHorizontalFlip(hflip))
    if randaugment:
        ops.append(v2.RandAugment(num_ops=rand_num_ops, magnitude=rand_magnitude))
    if color_jitter > 0:
        # Hue stays 0 (as in timm): it is undefined for grayscale and rarely helps.
        ops.append(v2.ColorJitter(color_jitter, color_jitter, color_jitter))
    ops += [v2.ToDtype(torch.float32, scale=True), v2.Normalize(list(mean), list(std))]
    if reprob > 0:
        # After normalisation, as in DeiT, so erased pixels are zero (the dataset mean), not black.
        ops.append(v2.RandomErasing(p=reprob, value=0))
    return v2.Compose(ops)


def eval_transform(img_size: int, *, crop_pct: float, mean: Sequence[float], std: Sequence[float]) -> v2.Compose:
    """Resize the short side to ``img_size / crop_pct``, center-crop ``img_size``, normalise."""
    resize = int(math.floor(img_size / crop_pct))
    return v2.Compose([
        v2.Resize(resize, antialias=True),
        v2.CenterCrop(img_size),
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(list(mean), list(std)),
    ])


def batch_mixup(mixup: float, cutmix: float,
                num_classes: int) -> Callable[[Tensor, Tensor], tuple[Tensor, Tensor]] | None:
    """MixUp and/or CutMix on a batch, one of the two chosen per batch; None when both alphas are 0."""
    ops = []
    if mixup > 0:
        ops.append(v2.MixUp(alpha=mixup, num_classes=num_classes))
    if cutmix > 0:
        ops.append(v2.CutMix(alpha=cutmix, num_classes=num_classes))
    if not ops:
        return None
    choice = ops[0] if len(ops) == 1 else v2.RandomChoice(ops)

    def apply(x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        # x (B, C, H, W) float, y (B,) int64 -> x mixed, targets (B, num_classes) summing to 1 per row.
        return choice(x, y.long())

    return apply
