"""DeiT distillation (hard / soft through the distillation token) and feature distillation, one short run each."""

from __future__ import annotations

import pytest

from tests.train.conftest import tiny_config
from vitlab.classify import DistillConfig
from vitlab.data import DataConfig
from vitlab.train import checkpoint as ck
from vitlab.train import fit

FAKE10 = DataConfig("fake", fake_num_samples=40, fake_num_classes=10, fake_img_size=16, mixup=0.0, cutmix=0.0)


@pytest.mark.parametrize("kind", ["hard", "soft"])
def test_deit_distillation_from_a_checkpoint(trained_run, tmp_path, kind):
    run, _ = trained_run
    cfg = tiny_config(tmp_path, data=FAKE10, epochs=1, model_kwargs={"depth": 1, "embed_dim": 32, "num_heads": 2,
                                                                     "dist_token": True},
                      distill=DistillConfig(kind=kind, teacher=str(run), alpha=0.5, tau=2.0))
    s = fit(cfg)
    assert s["finished"] and s["best_val_top1"] is not None
    sd, meta = ck.load_weights(tmp_path / "run" / "last")
    assert "dist_token" in sd and "head_dist.weight" in sd and meta["model_kwargs"]["dist_token"] is True


def test_feature_distillation_with_projectors(tmp_path):
    cfg = tiny_config(tmp_path, data=FAKE10, epochs=1, ema_decay=0.0,
                      distill=DistillConfig(kind="feature", teacher="vit_pico_patch8_32",
                                            teacher_kwargs={"depth": 2, "embed_dim": 48, "num_heads": 2},
                                            student_layers=[0], teacher_layers=[1]))
    s = fit(cfg)
    assert s["finished"]
    assert "projector" in ck.load_trainer_state(tmp_path / "run" / "last")


def test_teacher_with_other_class_count_is_refused(tmp_path):
    cfg = tiny_config(tmp_path, distill=DistillConfig(kind="hard", teacher="vit_pico_patch8_32",
                                                      teacher_kwargs={"depth": 1}))
    cfg.task_args.distill.teacher_kwargs = {"depth": 1, "num_classes": 7}
    with pytest.raises(ValueError, match="classes"):
        fit(cfg)
