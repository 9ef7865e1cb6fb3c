"""Seed 004's memory estimate beside a measured peak, and seed 001's complexity table."""

from __future__ import annotations

import pytest
import torch

from vitlab.analysis.memory import complexity_table, measure_memory, measure_memory_isolated


def test_complexity_table_matches_seed001():
    rows = complexity_table()  # ViT-B/16: D = 768, 12 heads
    assert [r["tokens"] for r in rows] == [196, 576, 1024, 4096]
    for r in rows:
        assert round(r["scores_per_head_m"], 2) == r["seed001_printed_m"]  # the seed's printed output
        assert r["attention_gmacs_per_layer"] == pytest.approx(2 * r["tokens"] ** 2 * 768 / 1e9)
    assert rows[-1]["attention_map_mb_per_layer"] == pytest.approx(12 * 4096**2 * 4 / 2**20)  # 768 MB
    with pytest.raises(ValueError, match="multiple of the patch size"):
        complexity_table(sizes=(200,))


def test_estimate_beside_measurement():
    t = measure_memory("vit_pico_patch8_32", batch_size=2, mode="train", dtype="bf16")
    est = t["estimate_gb"]
    assert est[32] == pytest.approx(t["params"] * 4 * 1.2 / 1e9) and est[4] == pytest.approx(est[32] / 8)
    assert t["dtype"] == "bf16" and t["estimate_at_dtype_gb"] == est[16]
    assert t["measured_over_estimate"] == pytest.approx(t["measured_peak_gb"] / est[16])


@pytest.mark.slow
def test_measured_cpu_memory_holds_the_weights():
    """In a fresh process (in this one, memory freed by earlier tests would be reused and hide the growth)."""
    r = measure_memory_isolated("vit_small_patch16_224", batch_size=1, mode="infer", img_size=32, depth=2)
    est = r["estimate_gb"]
    assert est[32] == pytest.approx(r["params"] * 4 * 1.2 / 1e9) and est[4] == pytest.approx(est[32] / 8)
    assert r["measured_peak_gb"] >= r["loaded_gb"] >= 0.9 * r["weights_gb"]  # the weights are resident


def test_bad_input():
    with pytest.raises(ValueError, match="mode must be"):
        measure_memory("vit_pico_patch8_32", mode="eval")
    with pytest.raises(ValueError, match="dtype must be"):
        measure_memory_isolated("vit_pico_patch8_32", dtype="int8")


@pytest.mark.slow
def test_memory_cli_in_fresh_processes(tmp_path):
    """``vitlab analyze memory`` measures each mode in its own process."""
    import json

    from vitlab.cli import main

    assert main(["analyze", "memory", "--model", "vit_pico_patch8_32", "--batch-size", "2", "--mode", "both",
                 "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "memory.json").read_text())
    assert [r["mode"] for r in data["measurements"]] == ["infer", "train"]
    assert data["complexity"][0]["tokens"] == (224 // 8) ** 2  # the table at vit_pico_patch8_32's own patch size



@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_peak_within_estimate_at_batch_1():
    r = measure_memory("vit_base_patch16_224", batch_size=1, mode="infer", device="cuda")
    assert 0.75 <= r["measured_over_estimate"] <= 1.25, r
