"""Every registered attention mechanism in fp32, bf16 and fp16, cast or under autocast, on odd grids.

Each runs forward on a 13 x 17 and a 7 x 5 grid (odd, non-square, no multiple of any window or pooling
factor) with finite outputs close to its fp32 result; a mechanism whose structure needs a divisible grid would
have to raise one clear ValueError instead (none does: windows and pyramids pad, pooling uses ceil mode). The
offset-bias attentions of LeViT / EfficientFormer, tied to the grid they are built for and not registered, are
tested the same way in test_offset_bias.py. Tiny layers, so that CPU fp16 keeps the whole file to a second.
"""

from __future__ import annotations

import pytest
import torch

from vitlab.attention import create, list_attention

DIM, HEADS = 32, 4
GRIDS = [(13, 17), (7, 5)]
# relative L2 error against fp32 allowed per dtype: a few units of the format's precision (bf16 keeps 8 bits of
# mantissa, fp16 11) accumulated through two projections and a softmax
TOL = {torch.bfloat16: 0.05, torch.float16: 0.01}


def _layer(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return create(name, DIM, HEADS).eval()


@pytest.mark.parametrize("hw", GRIDS, ids=lambda hw: f"{hw[0]}x{hw[1]}")
@pytest.mark.parametrize("name", list_attention())
def test_low_precision_tracks_fp32(name, hw):
    layer = _layer(name)
    x = torch.randn(2, hw[0] * hw[1], DIM, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = layer(x, hw)
        assert ref.shape == x.shape and torch.isfinite(ref).all()
        outs = {}
        for dtype in TOL:
            with torch.autocast("cpu", dtype=dtype):
                outs[f"autocast {dtype}"] = (layer(x, hw), (dtype, torch.float32))  # a last elementwise op may promote
        for dtype in TOL:
            outs[f"cast {dtype}"] = (_layer(name).to(dtype)(x.to(dtype), hw), (dtype,))
    for how, (out, dtypes) in outs.items():
        dtype = dtypes[0]
        assert out.shape == x.shape and out.dtype in dtypes, how
        assert torch.isfinite(out).all(), how
        err = float((out.float() - ref).norm() / ref.norm())
        assert err < TOL[dtype], f"{how}: relative error {err:.3g}"
