"""torch.compile(fullgraph=True) holds (no graph breaks) for the ViT, DeiT and HaLViT families.
(Swin and LeViT carry their own compile tests.)"""

from __future__ import annotations

import pytest
import torch

import vitlab


@pytest.mark.slow
@pytest.mark.parametrize("name", ["vit_tiny_patch16_224", "deit_tiny_distilled_patch16_224",
                                  "halvit_tiny_patch16_224"])
def test_fullgraph_compile_matches_eager(name):
    torch._dynamo.reset()
    model = vitlab.create_model(name, img_size=32, depth=2).eval()
    x = torch.randn(2, 3, 32, 32)
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    model.train()
    out = torch.compile(model, fullgraph=True)(x)
    (out[0] if isinstance(out, tuple) else out).sum().backward()
