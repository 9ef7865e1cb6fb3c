"""Patch masks of the DINOv2 objective's masked-image-modelling (iBOT) term.

- :class:`BlockMaskGenerator` -- BEiT's block-wise masking (Bao et al., 2022, "BEiT: BERT Pre-Training of Image
  Transformers", section 2.5 and Algorithm 1), as DINOv2 uses it (Oquab et al., 2023, section 4 "iBOT"; code
  ``dinov2/data/masking.py``, ``MaskingGenerator``): rectangles of a random area (at least ``min_num_patches``
  patches, at most what is still to be masked) and a random aspect ratio (log-uniform in ``[min_aspect,
  1 / min_aspect]``, 0.3 by default) at random places, added until the target count is reached or ten tries in
  a row add nothing.
- :func:`dinov2_masks` -- DINOv2's batch of masks (``collate_data_and_cast``): ``int(B * probability)`` of the
  ``B`` global crops are masked, image ``i`` of them with a ratio drawn uniformly in the ``i``-th of equal slices
  of ``ratio_range`` (0.1-0.5), so the batch spans the whole range; the rest get no mask; the order is shuffled.
  DINOv2 caps a block at half the grid (``max_num_patches = 0.5 * N``).
- :func:`random_patch_mask` -- iBOT's "rand" variant: each masked image masks its ratio's worth of patches chosen
  uniformly at random.

The generators draw from Python's ``random.Random`` (DINOv2's generator uses the ``random`` module) seeded from
torch's generator, so ``torch.manual_seed`` or a ``torch.Generator`` makes a batch of masks reproducible.
"""

from __future__ import annotations

import math
import random

import torch
from torch import Tensor


class BlockMaskGenerator:
    """BEiT / DINOv2 block-wise masking on a ``(height, width)`` patch grid; ``gen(rng, n)`` returns an
    ``(height, width)`` bool tensor with at most ``n`` True patches, made of rectangles."""

    def __init__(self, grid: tuple[int, int], min_num_patches: int = 4, max_num_patches: int | None = None,
                 min_aspect: float = 0.3, max_aspect: float | None = None):
        self.height, self.width = grid
        self.min_num_patches = min_num_patches
        self.max_num_patches = self.height * self.width if max_num_patches is None else max_num_patches
        max_aspect = max_aspect or 1.0 / min_aspect
        self.log_aspect_ratio = (math.log(min_aspect), math.log(max_aspect))

    def _add_block(self, rng: random.Random, mask: Tensor, max_mask_patches: int) -> int:
        """One rectangle (ten tries): the number of patches it newly masks (0 when no try fitted)."""
        delta = 0
        for _ in range(10):
            target_area = rng.uniform(self.min_num_patches, max_mask_patches)
            aspect_ratio = math.exp(rng.uniform(*self.log_aspect_ratio))
            h = int(round(math.sqrt(target_area * aspect_ratio)))
            w = int(round(math.sqrt(target_area / aspect_ratio)))
            if w < self.width and h < self.height:
                top = rng.randint(0, self.height - h)
                left = rng.randint(0, self.width - w)
                block = mask[top: top + h, left: left + w]
                new = h * w - int(block.sum())
                # only a block that adds patches without overshooting what is left to mask
                if 0 < new <= max_mask_patches:
                    block.fill_(True)
                    delta += new
                if delta > 0:
                    break
        return delta

    def __call__(self, rng: random.Random, num_masking_patches: int) -> Tensor:
        mask = torch.zeros(self.height, self.width, dtype=torch.bool)
        count = 0
        while count < num_masking_patches:
            delta = self._add_block(rng, mask, min(num_masking_patches - count, self.max_num_patches))
            if delta == 0:
                break
            count += delta
        return mask


def python_rng(generator: torch.Generator | None = None) -> random.Random:
    """A ``random.Random`` seeded from torch's (global or given) generator."""
    return random.Random(int(torch.randint(0, 2**62, (1,), generator=generator)))


def dinov2_masks(batch: int, grid: tuple[int, int], ratio_range: tuple[float, float] = (0.1, 0.5),
                 probability: float = 0.5, generator: torch.Generator | None = None,
                 mask_generator: BlockMaskGenerator | None = None) -> Tensor:
    """(batch, H * W) bool masks of ``batch`` global crops, DINOv2's ``collate_data_and_cast``: block-wise masks
    with ratios stratified over ``ratio_range`` for ``int(batch * probability)`` images, none for the others,
    shuffled."""
    n = grid[0] * grid[1]
    gen = mask_generator or BlockMaskGenerator(grid, max_num_patches=int(0.5 * n))
    rng = python_rng(generator)
    n_masked = int(batch * probability)
    probs = torch.linspace(ratio_range[0], ratio_range[1], n_masked + 1).tolist()
    masks = [gen(rng, int(n * rng.uniform(probs[i], probs[i + 1]))) for i in range(n_masked)]
    masks += [gen(rng, 0) for _ in range(n_masked, batch)]
    rng.shuffle(masks)
    return torch.stack(masks).flatten(1)


def random_patch_mask(batch: int, num_patches: int, ratio_range: tuple[float, float], probability: float,
                      device=None, generator: torch.Generator | None = None) -> Tensor:
    """(B, N) bool: with ``probability`` an image masks a ratio drawn uniformly from ``ratio_range`` of its
    patches, chosen at random; otherwise none (iBOT's "rand" masks)."""
    u = torch.rand(batch, generator=generator, device=device)
    ratio = ratio_range[0] + (ratio_range[1] - ratio_range[0]) * torch.rand(batch, generator=generator, device=device)
    n_mask = torch.where(u < probability, (ratio * num_patches).round(), torch.zeros_like(ratio)).long()
    ranks = torch.rand(batch, num_patches, generator=generator, device=device).argsort(dim=1).argsort(dim=1)
    return ranks < n_mask[:, None]


__all__ = ["BlockMaskGenerator", "dinov2_masks", "random_patch_mask"]
