"""LITv2 supplementary, Tables II and III on tiny LITv2s (the full-size runs are the CLI's; see docs/analysis.md)."""

from __future__ import annotations

import pytest
import torch

import vitlab
from vitlab.analysis.studies import PAPER_TABLE2, pooled_queries_study, window_study
from vitlab.profile import profile_model

TINY = dict(embed_dim=16, depths=(1, 1, 1, 1), num_heads=(1, 2, 4, 8))  # 64 px: a 4x4 stage-3 grid


def test_window_study_columns():
    r = window_study(windows=(2, 3), img_size=64, batch_size=1, runs=1, warmup=0, memory=False, model_kwargs=TINY)
    rows = r["rows"]
    assert [row["window"] for row in rows] == [2, 3]
    assert rows[0]["params_m"] == rows[1]["params_m"]  # Table II: HiLo's parameters do not depend on s
    for row in rows:  # GMACs of the model with that window, padding included (s = 3 pads 4x4 to 6x6)
        ref = profile_model("litv2_s", img_size=64, activations=False, local_ws=(0, 0, row["window"], 1), **TINY)
        assert row["gmacs"] == pytest.approx(ref.gmacs) and row["img_per_s"] > 0
    assert rows[1]["gmacs"] != rows[0]["gmacs"]
    assert r["paper"][2]["top1"] == PAPER_TABLE2[2][5] == 85.1
    with pytest.raises(ValueError, match="no LITv2"):
        window_study(model="deit_tiny_patch16_224")


def test_pooled_queries_model_level():
    model = vitlab.create_model("litv2_s", pooled_queries=True, img_size=64, **TINY)
    hilos = [m for m in model.modules() if type(m).__name__ == "HiLo"]
    assert hilos and all(m.pooled_queries for m in hilos)
    assert model(torch.randn(1, 3, 64, 64)).shape == (1, 1000)
    r = pooled_queries_study(img_size=64, batch_size=1, runs=1, warmup=0, model_kwargs=TINY)
    std, pooled = r["rows"]
    assert std["params_m"] == pooled["params_m"]  # Table III: 28 M both
    assert pooled["gmacs"] < std["gmacs"]  # Table III: 3.5 vs 3.7 G (fewer Lo-Fi queries)
    assert r["speed_ratio"] == pytest.approx(pooled["img_per_s"] / std["img_per_s"])


@pytest.mark.slow
def test_window_study_trains_for_top1(tmp_path):
    r = window_study(windows=(2,), img_size=64, batch_size=2, runs=1, memory=True, epochs=1, dataset="digits",
                     train_img_size=64, output_dir=str(tmp_path), model_kwargs=TINY)
    row = r["rows"][0]
    assert 0 <= row["top1"] <= 100 and row["train_memory_gb"] > row["test_memory_gb"] > 0
