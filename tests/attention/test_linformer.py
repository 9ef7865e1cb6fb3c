"""Linformer: sequence projections, prefix tokens, other grid sizes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vitlab.attention import create


def test_matches_explicit_projection():
    attn = create("linformer", 32, 2, proj_len=16, grid_size=(4, 5), num_prefix_tokens=1).eval()
    x = torch.randn(2, 21, 32)
    with torch.no_grad():
        out = attn(x, (4, 5))
        q, k, v = attn.qkv(x).reshape(2, 21, 3, 2, 16).permute(2, 0, 3, 1, 4)
        k, v = attn.proj_k @ k, attn.proj_v @ v  # (B, h, 16, d)
        a = (q @ k.transpose(-2, -1) / 4.0).softmax(-1)
        ref = attn.proj((a @ v).transpose(1, 2).reshape(2, 21, 32))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)


def test_other_grid_resamples_projection_and_prefix_count_is_checked():
    attn = create("linformer", 32, 2, grid_size=(4, 4))
    e = attn._seq_proj(attn.proj_k, (8, 8))
    assert e.shape == (256, 64)
    torch.testing.assert_close(e.sum(1), attn.proj_k.sum(1), atol=1e-5, rtol=1e-4)  # same total weight
    assert attn(torch.randn(1, 6 * 7, 32), (6, 7)).shape == (1, 42, 32)
    with pytest.raises(ValueError, match="prefix"):
        attn(torch.randn(1, 1 + 16, 32), (4, 4))
    _ = F  # keep the import list stable for readers
