"""Registry-wide tests: every registered model, built small through its ``smoke_kwargs``.

Each test builds its model once and checks several properties, which keeps the suite fast as families grow.
"""

from __future__ import annotations

import pytest
import torch

import vitlab
from tests.conftest import as_logits, smoke_model

ALL = vitlab.list_models(task="classify")  # image classifiers; CLIP: tests/clip, dense models: tests/dense


@pytest.mark.parametrize("name", ALL)
def test_train_forward_backward_and_grad_checkpointing(name):
    model, x = smoke_model(name, num_classes=5)
    model.train()
    ref = model(x)
    logits = as_logits(ref)
    assert logits.shape == (x.shape[0], 5)
    assert torch.isfinite(logits).all()
    sum(o.float().pow(2).mean() for o in (ref if isinstance(ref, tuple) else (ref,))).backward()
    no_grad = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not no_grad, f"parameters without gradient: {no_grad[:5]}"
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    # activation checkpointing recomputes the same function
    model.set_grad_checkpointing(True)
    out = as_logits(model(x))
    torch.testing.assert_close(out, logits, rtol=1e-5, atol=1e-5)
    out.float().sum().backward()


@pytest.mark.parametrize("name", ALL)
def test_eval_api_intermediates_and_classifier(name):
    model, x = smoke_model(name)
    model.eval()
    with torch.no_grad():
        feats = model.forward_features(x)
        final, inter = model.forward_intermediates(x)
        only = model.forward_intermediates(x, indices=1, intermediates_only=True)
        torch.testing.assert_close(final, feats, rtol=1e-5, atol=1e-5)
        assert inter and all(t.ndim == 4 and t.shape[0] == x.shape[0] for t in inter)
        assert len(only) == 1
        torch.testing.assert_close(only[0], inter[-1])
        pre = model.forward_head(feats, pre_logits=True)
        assert pre.shape == (x.shape[0], model.num_features)
        model.reset_classifier(7)
        assert model(x).shape == (x.shape[0], 7)
        model.reset_classifier(0)
        assert model(x).shape == (x.shape[0], model.num_features)
    assert model.get_classifier() is not None
    assert isinstance(model.no_weight_decay(), set)


@pytest.mark.parametrize("name", ALL)
def test_config_in_chans_and_wrong_channels(name):
    cfg = vitlab.get_model_config(name)
    assert cfg.name == name and cfg.family and cfg.paper
    assert len(cfg.input_size) == 3 and len(cfg.mean) == len(cfg.std) == cfg.input_size[0]
    model, x = smoke_model(name, in_chans=1)
    model.eval()
    with torch.no_grad():
        assert model(x).ndim == 2
        with pytest.raises(ValueError, match="channels"):
            model(x.repeat(1, 3, 1, 1))
