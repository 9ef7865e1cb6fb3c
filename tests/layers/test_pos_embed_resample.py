"""The bicubic position-embedding resampling that exports exactly (vitlab.layers.pos_embed): two matmuls with
interpolation matrices equal F.interpolate's bicubic (with and without antialiasing), and same_size decides
without fixing a symbolic size. Through ONNX Runtime: tests/export/test_export.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vitlab.layers import same_size
from vitlab.layers.pos_embed import bicubic_matrix, bicubic_resize_separable

SIZES = [(7, 7), (10, 12), (14, 14), (2, 3), (1, 1), (28, 9), (5, 21), (4, 6)]


@pytest.mark.parametrize("antialias", [False, True])
@pytest.mark.parametrize("src", [(7, 7), (4, 6), (3, 5)])
def test_separable_bicubic_equals_interpolate(src, antialias):
    x = torch.randn(2, 16, *src, generator=torch.Generator().manual_seed(0))  # std 1: errors are not hidden
    for size in SIZES:  # up- and down-sampling, non-square, to a single pixel, the same size
        want = F.interpolate(x, size=size, mode="bicubic", align_corners=False, antialias=antialias)
        got = bicubic_resize_separable(x, size, antialias=antialias)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=f"{src} -> {size}")


def test_bicubic_matrix_is_exact_in_float64():
    # float64 inputs through the same matrices (built in float32) vs PyTorch's float64 kernel: the formulation
    # itself, not only float32 rounding, matches
    for antialias in (False, True):
        m = bicubic_matrix(11, 7, antialias).double()
        eye = torch.eye(7, dtype=torch.float64)[None, None]  # 7 unit impulses: the columns of the matrix
        want = F.interpolate(eye, size=(11, 7), mode="bicubic", align_corners=False, antialias=antialias)[0, 0]
        torch.testing.assert_close(m, want, atol=1e-6, rtol=0)
        torch.testing.assert_close(m.sum(1), torch.ones(11, dtype=torch.float64), atol=1e-6, rtol=0)


def test_same_size():
    assert same_size((7, 7), [7, 7]) and not same_size((7, 7), (7, 8)) and not same_size((7,), (7, 7))
