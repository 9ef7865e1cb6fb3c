"""XCA through SDPA equals the explicit cross-covariance formula of XCiT."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vitlab.attention import create


def test_matches_explicit_cross_covariance():
    attn = create("xca", 32, 2).eval()
    with torch.no_grad():
        attn.temperature.copy_(torch.tensor([0.5, 2.0]).view(2, 1, 1))
    x = torch.randn(2, 1 + 12, 32)
    with torch.no_grad():
        out = attn(x, (3, 4))
        q, k, v = attn.qkv(x).reshape(2, 13, 3, 2, 16).permute(2, 0, 3, 4, 1)  # (B, h, d, N)
        a = (F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1) * attn.temperature).softmax(-1)
        ref = attn.proj((a @ v).permute(0, 3, 1, 2).reshape(2, 13, 32))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)


def test_autocast_bf16_close_to_fp32():
    torch.manual_seed(0)
    attn = create("xca", 64, 4).eval()
    x = torch.randn(2, 49, 64)
    with torch.no_grad():
        ref = attn(x, (7, 7))
        with torch.autocast("cpu", torch.bfloat16):
            out = attn(x, (7, 7))
    torch.testing.assert_close(out.float(), ref, rtol=0.05, atol=0.05)
