"""vitlab.prune.warmup: EViT's keep-rate warm-up against a literal re-statement of the authors' ``adjust_keep_rate``
(youweiliang/evit ``helpers.py``, called per iteration by ``engine.train_one_epoch``), set_keep_rate, and the
warm-up in Trainer runs: the training token count moves with it, inference keeps the target, a resumed run
continues the schedule where it stopped."""

from __future__ import annotations

import math

import pytest
import torch

import vitlab
import vitlab.prune as prune
from vitlab.classify import ClassificationTask
from vitlab.data import DataConfig
from vitlab.train import TrainConfig
from vitlab.train.trainer import Trainer, resume_config


def ref_adjust_keep_rate(iters, epoch, warmup_epochs, total_epochs, ITERS_PER_EPOCH, base_keep_rate=0.5,
                         max_keep_rate=1):
    """The authors' function (engine.py passes warmup_epochs=shrink_start_epoch,
    total_epochs=shrink_start_epoch + shrink_epochs)."""
    if epoch < warmup_epochs:
        return 1
    if epoch >= total_epochs:
        return base_keep_rate
    total_iters = ITERS_PER_EPOCH * (total_epochs - warmup_epochs)
    iters = iters - ITERS_PER_EPOCH * warmup_epochs
    return base_keep_rate + (max_keep_rate - base_keep_rate) * (math.cos(iters / total_iters * math.pi) + 1) * 0.5


@pytest.mark.parametrize("start,shrink", [(10, 100), (2, 3), (0, 4), (3, 0), (0, 0)])
def test_schedule_equals_authors(start, shrink):
    spe, target = 7, 0.7
    for t in range(spe * (start + shrink + 2)):
        want = ref_adjust_keep_rate(t, t // spe, start, start + shrink, spe, base_keep_rate=target)
        assert prune.keep_rate_at(t, spe, target, start, shrink) == pytest.approx(want, abs=1e-15)


def test_schedule_start_middle_end():
    spe, target, start, shrink = 10, 0.6, 2, 4
    t0, t1 = start * spe, (start + shrink) * spe
    rate = lambda t: prune.keep_rate_at(t, spe, target, start, shrink)  # noqa: E731
    assert rate(0) == rate(t0 - 1) == rate(t0) == 1.0  # unpruned before and at the start of the cosine
    assert rate((t0 + t1) // 2) == pytest.approx((1 + target) / 2)  # half way down
    quarter = t0 + (t1 - t0) // 4
    assert rate(quarter) == pytest.approx(target + (1 - target) * (1 + math.cos(math.pi / 4)) / 2)
    assert rate(t1 - 1) > target and rate(t1) == rate(10 * t1) == target
    # fractional epochs: the cosine spans steps 5 .. 20 of a 10-step epoch
    assert prune.keep_rate_at(4, 10, 0.5, 0.5, 1.5) == 1.0
    assert prune.keep_rate_at(12.5, 10, 0.5, 0.5, 1.5) == pytest.approx(0.75)
    for bad in ((-1, 10), (1, float("nan")), (float("inf"), 1)):
        with pytest.raises(ValueError, match="must be a finite number of epochs >= 0"):
            prune.keep_rate_at(0, 10, 0.5, *bad)
    with pytest.raises(ValueError, match=r"keep_rate must be in \(0, 1\]"):
        prune.keep_rate_at(0, 10, 1.5, 1, 1)


def test_set_keep_rate_changes_the_token_count():
    torch.manual_seed(0)
    model = vitlab.create_model("deit_tiny_patch16_224", img_size=64, patch_size=8, depth=6).eval()
    x = torch.randn(2, 3, 64, 64)
    with pytest.raises(ValueError, match="not patched with token pruning"):
        prune.set_keep_rate(model, 0.5)
    prune.apply(model, "evit", keep_rate=0.5, locations=[2])
    with torch.no_grad():
        assert model.forward_features(x).shape[1] == 1 + 32 + 1  # class, kept, fused
        prune.set_keep_rate(model, 0.25)
        assert model.forward_features(x).shape[1] == 1 + 16 + 1
        prune.set_keep_rate(model, 1.0, train_only=True)  # training forwards unpruned, inference at 0.25
        assert model.forward_features(x).shape[1] == 1 + 16 + 1
        model.train()
        assert model.forward_features(x).shape[1] == 1 + 64
    with pytest.raises(ValueError, match=r"keep_rate must be in \(0, 1\]"):
        prune.set_keep_rate(model, 0.0)


def test_training_losses_target_the_training_rate():
    """DynamicViT's keep-ratio loss (Eq. 12) and the adaptive threshold's aim at the warm-up's current rate."""
    from vitlab.prune.losses import RATIO_WEIGHT, adaptive_loss, dynamicvit_loss

    info = prune.PruneInfo("adaptive", keep_rate=0.5, locations=[1], protected=1)
    info.aux = {"stages": [(torch.ones(2, 8), torch.tensor([-20.0]))]}  # every importance far above the threshold
    assert adaptive_loss(info).item() == pytest.approx(RATIO_WEIGHT * 0.25, rel=1e-3)  # sigmoid(10) ~ 1
    info.train_keep_rate = 1.0
    assert adaptive_loss(info).item() == pytest.approx(0.0, abs=1e-6)
    info = prune.PruneInfo("dynamicvit", keep_rate=0.5, locations=[1, 2], protected=1, train_keep_rate=1.0)
    info.aux = {"stages": [torch.ones(2, 8)] * 2, "mask": torch.ones(2, 8, 1)}  # every token kept
    logits, tokens = torch.randn(2, 4), torch.randn(2, 8, 6)
    assert dynamicvit_loss(info, logits, tokens, logits, tokens).item() == pytest.approx(0.0, abs=1e-6)
    info.train_keep_rate = None  # targets 0.5, 0.25: (0.5^2 + 0.75^2) / 2 stages
    want = RATIO_WEIGHT * (0.25 + 0.5625) / 2
    assert dynamicvit_loss(info, logits, tokens, logits, tokens).item() == pytest.approx(want)


class RecordingTask(ClassificationTask):
    """The classification task, recording per training step the training keep rate and the tokens after the last
    block, and every validation forward's token count."""

    def build(self, cfg, device):
        super().build(cfg, device)
        self.rates, self.train_tokens, self.eval_tokens = [], [], []
        self.model.norm.register_forward_hook(
            lambda m, args, out: (self.train_tokens if m.training else self.eval_tokens).append(out.shape[1]))

    def training_step(self, batch, forward):
        self.rates.append(prune.pruned_info(self.model).rate(training=True))
        return super().training_step(batch, forward)


def _cfg(tmp_path, **kw):
    data = DataConfig("fake", fake_num_samples=64, fake_num_classes=4, fake_img_size=16)
    return TrainConfig(model="vit_pico_patch8_32", model_kwargs=dict(depth=4, embed_dim=32, num_heads=2, patch_size=4),
                       data=data, epochs=2, batch_size=8, quiet=True, threads=1, output_dir=str(tmp_path / "run"),
                       task_args=dict(prune="evit:0.5", prune_shrink_start=0.25, prune_shrink_epochs=1.5), **kw)


def _fit(cfg):
    task = RecordingTask()
    summary = Trainer(cfg, task).fit()
    return task, summary


def _tokens(rate):
    """Tokens after the blocks of the test model (16 patches, EViT at blocks 1, 2, 3) at keep rate ``rate``."""
    n = 16
    for _ in range(3):
        left = math.ceil(rate * n)
        n = n if left >= n else left + 1  # the kept tokens and the fused one
    return 1 + n


def test_warmup_moves_the_training_token_count(tmp_path):
    task, summary = _fit(_cfg(tmp_path))
    spe = len(task.rates) // 2
    assert spe == 8
    want = [prune.keep_rate_at(t, spe, 0.5, 0.25, 1.5) for t in range(2 * spe)]
    assert task.rates == pytest.approx(want, abs=0)
    assert task.rates[0] == 1.0 and task.rates[-1] == 0.5
    # training forwards: every step's token count follows its keep rate, from unpruned (17) down to the target's
    assert task.train_tokens == [_tokens(r) for r in task.rates]
    assert task.train_tokens[0] == 17 and task.train_tokens[-1] == _tokens(0.5) == 5
    assert len(set(task.train_tokens)) >= 4
    # inference (validation) runs at the target throughout, like the checkpoint rebuilt by evaluate()
    assert set(task.eval_tokens) == {_tokens(0.5)}
    r = vitlab.train.evaluate(summary["run_dir"], split="val", optimize=False)
    assert r["top1"] == pytest.approx(summary["best_val_top1"])


def test_resume_mid_warmup_restores_the_keep_rate(tmp_path):
    first, _ = _fit(_cfg(tmp_path, stop_after=1))
    spe = len(first.rates)
    resumed, _ = _fit(resume_config(TrainConfig(resume=str(tmp_path / "run"))))
    # the resumed run's first step uses the checkpointed rate (not step 0's 1.0), then the schedule goes on
    want = [prune.keep_rate_at(t, spe, 0.5, 0.25, 1.5) for t in range(spe, 2 * spe)]
    assert 0.5 < resumed.rates[0] < 1.0
    assert resumed.rates == pytest.approx(want, abs=0)
    assert first.rates + resumed.rates == pytest.approx([prune.keep_rate_at(t, spe, 0.5, 0.25, 1.5)
                                                        for t in range(2 * spe)], abs=0)


def test_bad_warmup_config_is_one_line(capsys):
    for kw, msg in (({"prune": "evit:0.7", "prune_shrink_start": -1}, "must be >= 0 epochs"),
                    ({"prune_shrink_epochs": 3}, "need --prune"),
                    ({"prune": "evit:0.7", "epochs": 5, "prune_shrink_start": 2, "prune_shrink_epochs": 4},
                     "ends at epoch 6, after the run's 5 epochs")):
        epochs = kw.pop("epochs", 100)
        with pytest.raises(ValueError, match=msg):
            TrainConfig(task_args=kw, epochs=epochs)
    from vitlab.cli import main

    assert main(["train", "--prune", "evit:0.7", "--task_args.prune_shrink_epochs", "200", "--epochs", "10",
                 "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "ends at epoch 200" in err[0]
