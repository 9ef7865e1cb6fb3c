"""A vitlab-trained run shared by the export tests (the train tests' tiny digits config)."""

from __future__ import annotations

import pytest

from tests.train.conftest import tiny_config
from vitlab.data import DataConfig
from vitlab.train import fit


@pytest.fixture(scope="session")
def digits_run(tmp_path_factory):
    """A 1-epoch 1-block pico ViT on digits at 16 px (10 named classes, a test split): the run directory."""
    out = tmp_path_factory.mktemp("export-run")
    fit(tiny_config(out, data=DataConfig("digits", img_size=16), epochs=1, batch_size=128, lr=2e-2))
    return out / "run"
