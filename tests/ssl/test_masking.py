"""DINOv2's masks: the block-wise generator against a literal restatement of DINOv2's ``MaskingGenerator``
(``dinov2/data/masking.py``) and ``collate_data_and_cast`` (the stratified ratios), the masks' shape (rectangles,
contiguous blocks, at most the target), reproducibility from torch's generator, and iBOT's random variant."""

from __future__ import annotations

import math
import random

import torch

from vitlab.ssl.masking import BlockMaskGenerator, dinov2_masks, python_rng, random_patch_mask


class DINOv2MaskingGenerator:
    """DINOv2's ``MaskingGenerator``, restated line for line (numpy array -> nested lists; ``random`` -> ``rng``)."""

    def __init__(self, input_size, num_masking_patches=None, min_num_patches=4, max_num_patches=None,
                 min_aspect=0.3, max_aspect=None):
        self.height, self.width = input_size
        self.min_num_patches = min_num_patches
        self.max_num_patches = num_masking_patches if max_num_patches is None else max_num_patches
        max_aspect = max_aspect or 1 / min_aspect
        self.log_aspect_ratio = (math.log(min_aspect), math.log(max_aspect))

    def _mask(self, rng, mask, max_mask_patches):
        delta = 0
        for _ in range(10):
            target_area = rng.uniform(self.min_num_patches, max_mask_patches)
            aspect_ratio = math.exp(rng.uniform(*self.log_aspect_ratio))
            h = int(round(math.sqrt(target_area * aspect_ratio)))
            w = int(round(math.sqrt(target_area / aspect_ratio)))
            if w < self.width and h < self.height:
                top = rng.randint(0, self.height - h)
                left = rng.randint(0, self.width - w)
                num_masked = sum(mask[i][j] for i in range(top, top + h) for j in range(left, left + w))
                if 0 < h * w - num_masked <= max_mask_patches:
                    for i in range(top, top + h):
                        for j in range(left, left + w):
                            if mask[i][j] == 0:
                                mask[i][j] = 1
                                delta += 1
                if delta > 0:
                    break
        return delta

    def __call__(self, rng, num_masking_patches=0):
        mask = [[0] * self.width for _ in range(self.height)]
        mask_count = 0
        while mask_count < num_masking_patches:
            max_mask_patches = num_masking_patches - mask_count
            max_mask_patches = min(max_mask_patches, self.max_num_patches)
            delta = self._mask(rng, mask, max_mask_patches)
            if delta == 0:
                break
            mask_count += delta
        return torch.tensor(mask, dtype=torch.bool)


def dinov2_collate_masks(rng, B, n_tokens, mask_generator, mask_ratio_tuple=(0.1, 0.5), mask_probability=0.5):
    """The mask part of DINOv2's ``collate_data_and_cast``."""
    N = n_tokens
    n_samples_masked = int(B * mask_probability)
    probs = torch.linspace(*mask_ratio_tuple, n_samples_masked + 1)
    masks_list = []
    for i in range(0, n_samples_masked):
        prob_min = probs[i]
        prob_max = probs[i + 1]
        masks_list.append(mask_generator(rng, int(N * rng.uniform(prob_min, prob_max))))
    for _ in range(n_samples_masked, B):
        masks_list.append(mask_generator(rng, 0))
    rng.shuffle(masks_list)
    return torch.stack(masks_list).flatten(1)


def test_block_generator_equals_dinov2s():
    for grid, max_n, seed in [((14, 14), 98, 0), ((16, 16), 128, 1), ((4, 4), 8, 2), ((7, 5), None, 3)]:
        ours = BlockMaskGenerator(grid, max_num_patches=max_n)
        ref = DINOv2MaskingGenerator(grid, max_num_patches=max_n if max_n is not None else grid[0] * grid[1])
        r1, r2 = random.Random(seed), random.Random(seed)
        for target in range(0, grid[0] * grid[1] // 2 + 1, 3):
            assert torch.equal(ours(r1, target), ref(r2, target)), (grid, target)


def test_batch_masks_equal_dinov2s_collate():
    grid = (14, 14)
    g = torch.Generator().manual_seed(5)
    ours = dinov2_masks(16, grid, (0.1, 0.5), 0.5, generator=g)
    rng = python_rng(torch.Generator().manual_seed(5))
    ref = dinov2_collate_masks(rng, 16, 196, DINOv2MaskingGenerator(grid, max_num_patches=98))
    assert torch.equal(ours, ref)


def test_batch_masks_stratified_ratios_and_half_the_images():
    """int(B * 0.5) images masked, their ratios spread over 0.1-0.5 (one per slice), never above the target."""
    torch.manual_seed(0)
    B, grid = 32, (14, 14)
    N = grid[0] * grid[1]
    m = dinov2_masks(B, grid)
    counts = m.sum(1)
    assert m.shape == (B, N) and m.dtype == torch.bool
    assert int((counts > 0).sum()) == B // 2
    ratios = (counts[counts > 0].float() / N).sort().values
    assert ratios.max() <= 0.5 and ratios.min() >= 0.05
    assert ratios[-1] - ratios[0] > 0.25  # the slices span the range
    assert not torch.equal(m[: B // 2].sum(1) > 0, torch.ones(B // 2, dtype=torch.bool))  # shuffled
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert torch.equal(dinov2_masks(B, grid, generator=g1), dinov2_masks(B, grid, generator=g2))


def _rectangle(mask: torch.Tensor) -> bool:
    rows, cols = mask.any(1).nonzero().flatten(), mask.any(0).nonzero().flatten()
    box = mask[rows.min(): rows.max() + 1, cols.min(): cols.max() + 1]
    return bool(box.all())


def test_one_block_is_a_rectangle_of_bounded_aspect():
    """Each block is one rectangle of at most the patches still to mask, its aspect h / w log-uniform in
    [0.3, 1 / 0.3] before h and w are rounded; a full mask never exceeds its target."""
    gen = BlockMaskGenerator((14, 14), min_num_patches=4, max_num_patches=98)
    rng = random.Random(0)
    aspects = []
    for _ in range(200):
        m = torch.zeros(14, 14, dtype=torch.bool)
        budget = rng.randint(4, 60)
        added = gen._add_block(rng, m, budget)
        assert added == int(m.sum()) and 0 < added <= budget and _rectangle(m)
        h, w = int(m.any(1).sum()), int(m.any(0).sum())
        aspects.append(h / w)
        assert 0.3 * 0.5 <= h / w <= 2 / 0.3  # rounding of h, w at small areas widens the bound
    assert min(aspects) < 0.6 and max(aspects) > 1.6  # both orientations
    for target in range(0, 99, 7):
        assert int(gen(rng, target).sum()) <= target


def test_block_masks_are_contiguous_random_masks_are_not():
    """Masked patches have far more masked 4-neighbours under block-wise masking than under random masking at the
    same ratios (BEiT's point: a block cannot be filled in from its neighbours)."""
    torch.manual_seed(0)
    grid = (14, 14)

    def neighbours(m):
        m = m.view(-1, *grid).float()
        pad = torch.nn.functional.pad(m, (1, 1, 1, 1))
        n = pad[:, :-2, 1:-1] + pad[:, 2:, 1:-1] + pad[:, 1:-1, :-2] + pad[:, 1:-1, 2:]
        return float((n * m).sum() / m.sum())

    block = dinov2_masks(64, grid, probability=1.0)
    rand = random_patch_mask(64, 196, (0.1, 0.5), 1.0)
    assert neighbours(block) > 3.0 > 1.5 > neighbours(rand)
