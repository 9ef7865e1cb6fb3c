"""Input images of the analysis tools: scikit-image's bundled photos (astronaut, coffee, chelsea; no download)
or any image file, resized and center-cropped as the model's evaluation transform does
(:func:`vitlab.data.transforms.eval_transform`), normalised with the model's own mean / std.

Returns the model input and the un-normalised crops (for overlays), so a map drawn on a photo lines up with
the pixels the model saw.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_IMAGES = ("astronaut", "coffee", "chelsea")


@dataclass
class Images:
    x: torch.Tensor  # (N, C, H, W) normalised model input
    display: torch.Tensor  # (N, H, W, C) float in [0, 1], the same crops un-normalised (for overlays)
    names: list[str]


def _bundled(name: str) -> torch.Tensor:
    import skimage.data

    return torch.from_numpy(getattr(skimage.data, name)().copy()).permute(2, 0, 1)  # (3, H, W) uint8


def load_images(paths: list[str] | None = None, img_size: int = 224, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5),
                crop_pct: float = 0.9, in_chans: int = 3) -> Images:
    """Image files (or, with ``paths`` empty or None, the three bundled photos) as one batch.

    A bundled photo can also be named in ``paths`` (``astronaut``, ``coffee``, ``chelsea``). Unreadable or
    missing files raise a one-line :class:`vitlab.data.DataError` / FileNotFoundError naming the path."""
    from torchvision.transforms import v2

    from vitlab.data.datasets import load_image
    from vitlab.data.transforms import channel_stats, eval_transform

    paths = list(paths or DEFAULT_IMAGES)
    raw, names = [], []
    for p in paths:
        if p in DEFAULT_IMAGES and not Path(p).exists():
            img = _bundled(p)
            if in_chans == 1:
                img = img.float().mean(0, keepdim=True).round().to(torch.uint8)
        else:
            if not Path(p).exists():
                raise FileNotFoundError(f"no image {p} (give a readable image file, or one of the bundled "
                                        f"photos: {', '.join(DEFAULT_IMAGES)})")
            img = load_image(p, in_chans)
        raw.append(img)
        names.append(Path(p).stem)
    mean, std = channel_stats(mean, in_chans), channel_stats(std, in_chans)
    norm = eval_transform(img_size, crop_pct=crop_pct, mean=mean, std=std)
    crop = v2.Compose(norm.transforms[:-1])  # the same resize / crop / scale to [0, 1], without Normalize
    x = torch.stack([norm(r) for r in raw])
    display = torch.stack([crop(r) for r in raw]).permute(0, 2, 3, 1).clamp(0, 1)
    return Images(x=x, display=display, names=names)


def model_images(model, paths: list[str] | None = None, img_size: int | None = None) -> Images:
    """:func:`load_images` with the model's input size, mean, std and crop fraction (its registry config)."""
    cfg = getattr(model, "pretrained_cfg", None)
    built = getattr(model, "img_size", None) or getattr(getattr(model, "patch_embed", None), "img_size", None)
    size = img_size or (built[0] if built else cfg.input_size[1] if cfg is not None else 224)
    kw = {} if cfg is None else dict(mean=cfg.mean, std=cfg.std, crop_pct=cfg.crop_pct, in_chans=cfg.input_size[0])
    return load_images(paths, size, **kw)
