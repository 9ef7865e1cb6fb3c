"""ELU+1 linear attention equals its quadratic form phi(q) phi(k)^T v, row-normalised."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vitlab.attention import create


def test_matches_quadratic_form():
    attn = create("linear", 32, 2).eval()
    x = torch.randn(2, 1 + 20, 32)  # a prefix token is fine: global mechanism
    with torch.no_grad():
        out = attn(x, (4, 5))
        q, k, v = attn.qkv(x).reshape(2, 21, 3, 2, 16).permute(2, 0, 3, 1, 4)
        a = (F.elu(q) + 1) @ (F.elu(k) + 1).transpose(-2, -1)  # (B, h, N, N), positive
        ref = attn.proj(((a / a.sum(-1, keepdim=True)) @ v).transpose(1, 2).reshape(2, 21, 32))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
