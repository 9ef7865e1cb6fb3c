"""vitlab.optimize.cait: the folded talking-heads attention computes the model's direct form (forward and
gradients, mixing biases included), is swapped in and out in place, leaves wide heads alone, and falls back to
the direct form for what only it has (masks, weights, dropout in training)."""

from __future__ import annotations

import pytest
import torch

import vitlab
from vitlab.models.cait import TalkingHeadAttn
from vitlab.optimize.cait import FoldedTalkingHeadAttn, fold_talking_heads, unfold_talking_heads


def _random_mixing(attn: TalkingHeadAttn, bias_scale: float) -> None:
    with torch.no_grad():  # random mixing, far from the identity, and non-zero biases
        for lin in (attn.proj_l, attn.proj_w):
            lin.weight.normal_()
            lin.bias.normal_(std=bias_scale)


@pytest.mark.parametrize("bias_scale", [0.0, 1.0])
def test_folded_equals_direct(bias_scale):
    torch.manual_seed(0)
    attn = TalkingHeadAttn(48, num_heads=4)
    _random_mixing(attn, bias_scale)
    x = torch.randn(2, 13, 48, requires_grad=True)
    outs, grads = [], []
    for fold in (False, True):
        if fold:
            assert fold_talking_heads(attn) == 1 and type(attn) is FoldedTalkingHeadAttn
        out = attn(x)
        outs.append(out)
        params = [x, *attn.parameters()]
        g = torch.autograd.grad(out.square().sum(), params, allow_unused=True)
        # proj_l's bias shifts whole softmax rows, so its true gradient is 0: the folded form never reads it
        grads.append([torch.zeros_like(p) if gi is None else gi for p, gi in zip(params, g, strict=True)])
    assert torch.allclose(outs[0], outs[1], atol=1e-4)
    for g0, g1 in zip(*grads, strict=True):
        assert torch.allclose(g0, g1, atol=1e-3, rtol=1e-4)


def test_model_swap_in_place_and_back():
    torch.manual_seed(0)
    model = vitlab.create_model("cait_xxs24_224", img_size=64, depth=2).eval()
    for blk in model.blocks:
        _random_mixing(blk.attn, 1.0)
    x = torch.randn(2, 3, 64, 64)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        ref = model(x)
        assert fold_talking_heads(model) == 2
        assert all(type(b.attn) is FoldedTalkingHeadAttn for b in model.blocks)
        torch.testing.assert_close(model(x), ref, atol=1e-4, rtol=1e-4)
        assert sd.keys() == model.state_dict().keys()
        assert unfold_talking_heads(model) == 2 and all(type(b.attn) is TalkingHeadAttn for b in model.blocks)
        assert torch.equal(model(x), ref)
    wide = vitlab.create_model("cait_xs24_224", img_size=32, depth=1)  # C = 288: beyond the fused kernels
    assert fold_talking_heads(wide) == 0 and fold_talking_heads(wide, max_width=288) == 1


def test_direct_form_for_what_only_it_has():
    torch.manual_seed(0)
    attn = TalkingHeadAttn(32, num_heads=4, attn_drop=0.1)
    direct = TalkingHeadAttn(32, num_heads=4, attn_drop=0.1)
    direct.load_state_dict(attn.state_dict())
    fold_talking_heads(attn)
    x = torch.randn(2, 5, 32)
    bias = torch.randn(2, 1, 1, 5)
    attn.eval(), direct.eval()
    out, w = attn(x, attn_mask=bias, return_attn=True)
    ref_out, ref_w = direct(x, attn_mask=bias, return_attn=True)
    assert torch.equal(out, ref_out) and torch.equal(w, ref_w)
    attn.train(), direct.train()
    torch.manual_seed(1)
    out = attn(x)
    torch.manual_seed(1)
    assert torch.equal(out, direct(x))  # attention dropout in training: the direct form's own draws


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the fused kernels the fold is for)")
def test_folded_on_cuda_equals_direct():
    torch.manual_seed(0)
    attn = TalkingHeadAttn(192, num_heads=4).cuda()
    _random_mixing(attn, 1.0)
    direct = TalkingHeadAttn(192, num_heads=4).cuda()
    direct.load_state_dict(attn.state_dict())
    fold_talking_heads(attn)
    x = torch.randn(2, 196, 192, device="cuda", requires_grad=True)
    outs = []
    for m in (attn, direct):
        out = m(x)
        (g,) = torch.autograd.grad(out.square().sum(), [x])
        outs.append((out, g))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=1e-2, atol=1e-2)
