"""Small, fast training configs and one trained run shared by the train tests."""

from __future__ import annotations

import dataclasses

import pytest

from vitlab.classify import ClassifyArgs
from vitlab.data import DataConfig
from vitlab.train import TrainConfig, fit

TINY_MODEL = {"depth": 1, "embed_dim": 32, "num_heads": 2}
CLASSIFY_ARGS = {f.name for f in dataclasses.fields(ClassifyArgs)}


def tiny_config(tmp_path, **kw) -> TrainConfig:
    """A seconds-long run: a 1-block pico ViT on 48 fake 16x16 images of 4 classes, full tiny-preset augmentation
    (RandAugment, erasing, MixUp/CutMix) so every RNG stream is exercised. Keywords that name classification
    options (``distill``, ``prune`` ...) go to ``task_args``."""
    task_args = {k: kw.pop(k) for k in list(kw) if k in CLASSIFY_ARGS}
    data = kw.pop("data", DataConfig("fake", fake_num_samples=48, fake_num_classes=4, fake_img_size=16))
    base = dict(model="vit_pico_patch8_32", model_kwargs=dict(TINY_MODEL), data=data, epochs=2, batch_size=16,
                lr=5e-3, warmup_epochs=1, ema_decay=0.9, quiet=True, output_dir=str(tmp_path / "run"))
    base.update(kw)
    return TrainConfig.for_task("classify", task_args=task_args, **base)


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory):
    """A finished 2-epoch run on digits at 16px (a test split, 10 named classes): (run dir, summary)."""
    out = tmp_path_factory.mktemp("trained")
    cfg = tiny_config(out, data=DataConfig("digits", img_size=16), epochs=2, batch_size=128, lr=2e-2)
    summary = fit(cfg)
    return out / "run", summary
