"""The language and vision-language models on CUDA (skipped without a GPU): the Llama decoder (Touvron et al.,
2023), LLaVA (Liu et al., 2023) and BLIP (Li et al., 2022) compute on the GPU what they compute on the CPU (fp32,
no TF32) and greedy-decode the same tokens there; under bf16 (autocast, or the weights cast) their outputs stay
finite and the training losses give finite gradients; a Llama compiled by ``vitlab.optimize`` decodes what the
eager one does."""

from __future__ import annotations

import pytest
import torch

import vitlab

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.usefixtures("no_tf32")]
DEVICE = "cuda"
IMAGE = 110  # llava_tiny's <image> id (vitlab.vlm.model_configs)


def _perturbed(model: torch.nn.Module) -> torch.nn.Module:
    """Every parameter moved off its init (norm weights of one, zero biases), so a wrong term cannot hide."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def _close(got, want):
    torch.testing.assert_close(got.float().cpu(), want, rtol=1e-4, atol=1e-4)


def test_llama_cuda_matches_cpu_and_generates_the_same_tokens():
    model = _perturbed(vitlab.create_model("llama_tiny"))
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (2, 12))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # a left-padded prompt
    with torch.no_grad():
        logits = model(ids)
        tokens = model.generate(ids, 8, attention_mask=mask)
        gpu = model.to(DEVICE)
        _close(gpu(ids.to(DEVICE)), logits)
        assert gpu.generate(ids.to(DEVICE), 8, attention_mask=mask.to(DEVICE)).cpu().tolist() == tokens.tolist()
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            low = gpu(ids.to(DEVICE)).float()
        assert torch.isfinite(low).all()
        half = gpu.to(torch.bfloat16)  # bf16 weights, as served
        out = half.generate(ids.to(DEVICE), 8, temperature=0.8, top_k=20, top_p=0.9,
                            generator=torch.Generator(DEVICE).manual_seed(0))
        assert out.shape == (2, 8) and bool(((out >= 0) & (out < vocab)).all())
    half.float().train()
    loss = torch.nn.functional.cross_entropy(half(ids.to(DEVICE))[:, :-1].flatten(0, 1),
                                             ids[:, 1:].flatten().to(DEVICE))
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in half.parameters())


def test_compiled_llama_decodes_what_the_eager_one_does():
    from vitlab.optimize import optimize

    model = _perturbed(vitlab.create_model("llama_tiny")).to(DEVICE)
    ids = torch.randint(3, model.config.vocab_size, (3, 10), device=DEVICE)
    with torch.no_grad():
        want = model.generate(ids, 6)
        fast = optimize(model, backend="compile")
        assert fast.generate(ids, 6).tolist() == want.tolist()
        assert fast.generate(ids[:, :7], 6).tolist() == model.generate(ids[:, :7], 6).tolist()  # a new length


def test_llava_cuda_matches_cpu():
    model = _perturbed(vitlab.create_model("llava_tiny"))
    ids = torch.randint(5, 100, (2, 7))
    ids[:, 1] = IMAGE
    x = torch.randn(2, 3, 32, 32)
    labels = ids.masked_fill(ids == IMAGE, -100)
    with torch.no_grad():
        logits, loss = model(ids, x, labels=labels)
        tokens = model.generate(ids, x, max_new_tokens=8, eos_token_id=-1)
        gpu = model.to(DEVICE)
        g_logits, g_loss = gpu(ids.to(DEVICE), x.to(DEVICE), labels=labels.to(DEVICE))
        _close(g_logits, logits)
        _close(g_loss, loss)
        got = gpu.generate(ids.to(DEVICE), x.to(DEVICE), max_new_tokens=8, eos_token_id=-1)
        assert got.cpu().tolist() == tokens.tolist()
    gpu.train()
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        _, loss = gpu(ids.to(DEVICE), x.to(DEVICE), labels=labels.to(DEVICE))
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in gpu.parameters()
                                        if p.grad is not None)


def test_blip_cuda_matches_cpu():
    x = torch.randn(3, 3, 32, 32)
    ids = torch.randint(5, 97, (3, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    captioner = _perturbed(vitlab.create_model("blip_tiny_caption"))
    retrieval = _perturbed(vitlab.create_model("blip_tiny_retrieval"))
    with torch.no_grad():
        want_logits = captioner(x, ids, mask)[0]
        want_caption = captioner.generate_caption(x, max_new_tokens=10)
        want_itm, want_itc = retrieval.itm_scores(x, ids, mask), retrieval.itc_scores(x, ids, mask)
        captioner.to(DEVICE)
        retrieval.to(DEVICE)
        xd, idsd, maskd = x.to(DEVICE), ids.to(DEVICE), mask.to(DEVICE)
        _close(captioner(xd, idsd, maskd)[0], want_logits)
        assert captioner.generate_caption(xd, max_new_tokens=10).cpu().tolist() == want_caption.tolist()
        _close(retrieval.itm_scores(xd, idsd, maskd), want_itm)
        _close(retrieval.itc_scores(xd, idsd, maskd), want_itc)
    model = vitlab.create_model("blip_tiny").to(DEVICE)  # the three pre-training objectives, under bf16
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        out = model.losses(xd, idsd, maskd, generator=torch.Generator(DEVICE).manual_seed(0))
    out["loss"].backward()
    assert all(torch.isfinite(v) for v in out.values())
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
