"""Recipe pieces: parameter groups, the learning-rate schedule, EMA, soft targets, distillation losses, config."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import vitlab
from vitlab.data import DataConfig, build
from vitlab.train import TrainConfig
from vitlab.train.config import parse_overrides
from vitlab.train.recipe import (
    FeatureProjector,
    ModelEma,
    WarmupCosine,
    classification_loss,
    deit_loss,
    distillation_loss,
    lr_at,
    param_groups,
    scaled_lr,
    smooth_targets,
)


def test_param_groups_skip_norms_biases_tokens_pos_embed():
    model = vitlab.create_model("deit_tiny_distilled_patch16_224", img_size=32, depth=2)
    decay, no_decay = param_groups(model, 0.05)
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    skipped = {names[id(p)] for p in no_decay["params"]}
    decayed = {names[id(p)] for p in decay["params"]}
    assert {"cls_token", "dist_token", "pos_embed"} <= skipped
    assert all(n.endswith(".bias") or "norm" in n or n in ("cls_token", "dist_token", "pos_embed") for n in skipped)
    assert all(n.endswith(".weight") and "norm" not in n for n in decayed)
    assert "blocks.0.attn.qkv.weight" in decayed and "patch_embed.proj.weight" in decayed
    assert len(skipped) + len(decayed) == len(list(model.parameters()))


def test_schedule_warmup_then_cosine_per_iteration():
    assert scaled_lr(5e-4, 1024) == pytest.approx(1e-3)
    base, lo, wl = 1e-3, 1e-5, 1e-6
    assert lr_at(0, 100, 10, base, lo, wl) == pytest.approx(wl)
    assert lr_at(5, 100, 10, base, lo, wl) == pytest.approx(wl + (base - wl) * 0.5)
    assert lr_at(10, 100, 10, base, lo, wl) == pytest.approx(base)
    assert lr_at(55, 100, 10, base, lo, wl) == pytest.approx(lo + 0.5 * (base - lo))  # half-way down the cosine
    assert lr_at(100, 100, 10, base, lo, wl) == pytest.approx(lo)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = WarmupCosine(opt, 100, 10, base, lo, wl)
    for _ in range(37):
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(lr_at(37, 100, 10, base, lo, wl))
    other = WarmupCosine(opt, 100, 10, base, lo, wl)
    other.load_state_dict(sched.state_dict())
    assert opt.param_groups[0]["lr"] == pytest.approx(lo + 0.5 * (base - lo) * (1 + math.cos(math.pi * 27 / 90)))


def test_ema_update_with_and_without_warmup():
    model = torch.nn.Linear(2, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    ema = ModelEma(model, decay=0.9, warmup=False)
    model.weight.data.fill_(1.0)
    ema.update(model)
    assert ema.module.weight[0, 0].item() == pytest.approx(0.1)
    ema.update(model)
    assert ema.module.weight[0, 0].item() == pytest.approx(0.19)
    warm = ModelEma(torch.nn.Linear(2, 1, bias=False), decay=0.999)
    assert warm.current_decay() == pytest.approx(0.1)  # (1 + 0) / (10 + 0): the first update mostly copies
    warm.update(model)
    assert warm.current_decay() == pytest.approx(2 / 11)
    assert not any(p.requires_grad for p in ema.module.parameters())


def test_ema_moves_a_tied_tensor_once():
    model = torch.nn.Sequential(torch.nn.Embedding(3, 2), torch.nn.Linear(2, 3, bias=False))
    model[1].weight = model[0].weight  # an output head tied to the embedding: one tensor, two state-dict names
    torch.nn.init.zeros_(model[0].weight)
    ema = ModelEma(model, decay=0.5, warmup=False)
    assert ema.module[1].weight is ema.module[0].weight
    model[0].weight.data.fill_(1.0)
    ema.update(model)
    assert ema.module[0].weight[0, 0].item() == pytest.approx(0.5)  # not 0.75 (two steps of 0.5)


def test_label_smoothing_and_mixup_soft_targets():
    y = torch.tensor([0, 2])
    t = smooth_targets(y, 4, 0.1)
    assert torch.allclose(t[0], torch.tensor([0.925, 0.025, 0.025, 0.025]))
    logits = torch.randn(2, 4)
    # hard labels and their one-hot soft targets give the same smoothed loss
    assert classification_loss(logits, y, 0.1).item() == pytest.approx(
        classification_loss(logits, F.one_hot(y, 4).float(), 0.1).item(), rel=1e-5)
    bundle = build(DataConfig("fake", fake_num_samples=16, fake_num_classes=4, fake_img_size=16, mixup=0.8,
                              cutmix=1.0), in_chans=1)
    x, y = next(iter(bundle.loader("train", batch_size=8)))
    xm, soft = bundle.mixup(x, y)
    assert soft.shape == (8, 4) and torch.allclose(soft.sum(1), torch.ones(8))
    st = smooth_targets(soft, 4, 0.1)
    assert torch.allclose(st.sum(1), torch.ones(8)) and st.min() >= 0.025 - 1e-6
    loss = classification_loss(torch.randn(8, 4), soft, 0.1)
    assert torch.isfinite(loss)


def test_distillation_losses():
    s, t = torch.randn(4, 5), torch.randn(4, 5)
    y = torch.tensor([0, 1, 2, 3])
    assert distillation_loss("hard", s, t).item() == pytest.approx(F.cross_entropy(s, t.argmax(1)).item())
    assert distillation_loss("soft", t, t, tau=3.0).item() == pytest.approx(0.0, abs=1e-6)
    cls_out, dist_out = torch.randn(4, 5), torch.randn(4, 5)
    want = 0.7 * F.cross_entropy(cls_out, y, label_smoothing=0.1) + 0.3 * distillation_loss("hard", dist_out, t)
    got = deit_loss((cls_out, dist_out), y, 0.1, "hard", t, alpha=0.3)
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
    proj = FeatureProjector([8], [16])
    assert proj([torch.randn(2, 8, 4, 4)], [torch.randn(2, 16, 8, 8)]).ndim == 0


def test_config_yaml_round_trip_and_overrides(tmp_path):
    cfg = TrainConfig(data=DataConfig("digits", scale=(0.5, 1.0)))
    path = cfg.save(tmp_path / "c.yaml")
    back = TrainConfig.load(path)
    assert back == cfg
    over = back.with_overrides(parse_overrides(["--lr", "1e-3", "--data.img_size=16", "--model_kwargs.depth", "6",
                                                "--clip_grad", "none", "--compile", "--betas", "0.9,0.95"]))
    assert over.lr == 1e-3 and over.data.img_size == 16 and over.model_kwargs == {"depth": 6}
    assert over.clip_grad is None and over.compile is True and over.betas == (0.9, 0.95)
    with pytest.raises(ValueError, match="unknown config key"):
        cfg.with_overrides({"nope": "1"})
    with pytest.raises(ValueError, match="cannot read"):
        cfg.with_overrides({"epochs": "many"})
    with pytest.raises(ValueError, match="amp must be"):
        TrainConfig(amp="fp8")
