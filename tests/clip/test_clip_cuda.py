"""CLIP on CUDA (skipped without a GPU): both towers compute on the GPU what they compute on the CPU (fp32, no
TF32), bf16 autocast stays close, and a training step's gradients are finite."""

from __future__ import annotations

import pytest
import torch

import vitlab
from vitlab.clip.loss import clip_loss

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.usefixtures("no_tf32")]


@pytest.mark.parametrize("name", vitlab.list_models("clip_*"))
def test_cuda_matches_cpu(name):
    cfg = vitlab.get_model_config(name)
    model = vitlab.create_model(name, **cfg.smoke_kwargs).eval()
    size = cfg.smoke_kwargs.get("img_size", cfg.input_size[1])
    x = torch.randn(2, cfg.input_size[0], size, size)
    text = torch.randint(1, model.text.vocab_size - 1, (2, model.context_length))
    text[:, 5] = model.text.vocab_size - 1
    with torch.no_grad():
        ref = model(x, text)
        gpu = model.cuda()
        out = gpu(x.cuda(), text.cuda())
        torch.testing.assert_close([o.cpu() for o in out], list(ref), rtol=1e-4, atol=1e-4)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            low = gpu(x.cuda(), text.cuda())
    assert all((a.float().cpu() - b).abs().max() < 0.05 for a, b in zip(low[:2], ref[:2]))
    gpu.train()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss, _ = clip_loss(*gpu(x.cuda(), text.cuda()))
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in gpu.parameters() if p.grad is not None)
