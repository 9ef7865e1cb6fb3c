"""CUDA paths (skipped without a GPU, so CI on CPU skips them): every registered model computes on the GPU
what it computes on the CPU -- this covers the code that only CUDA takes (the fused-attention backends) --
forward and backward, in fp32 and under bf16 autocast."""

from __future__ import annotations

import pytest
import torch

import vitlab
from tests.conftest import as_logits, smoke_model

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.usefixtures("no_tf32")]  # cuDNN convolutions default to TF32: compare true fp32


@pytest.mark.parametrize("name", vitlab.list_models(task="classify"))  # CLIP: tests/clip
def test_cuda_matches_cpu(name):
    model, x = smoke_model(name, num_classes=5)
    model.eval()
    with torch.no_grad():  # features, not logits: a zero-initialised head would hide every difference
        ref = model.forward_features(x)
        gpu = model.cuda()
        out = gpu.forward_features(x.cuda()).cpu()
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            low = gpu.forward_features(x.cuda()).float().cpu()
    assert torch.isfinite(low).all()
    assert (low - ref).abs().max().item() < 0.1 * max(1.0, ref.abs().max().item())
    gpu.train()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = as_logits(gpu(x.cuda())).float().square().mean()
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in gpu.parameters() if p.grad is not None)

