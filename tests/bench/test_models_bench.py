"""bench models / bench ladder: rows, JSON and PNG on tiny settings (speed itself is recorded in docs)."""

from __future__ import annotations

import json

import pytest
import torch

from vitlab.bench import ladder, models
from vitlab.timing import paired_ratio, paired_times, round_robin_times

KEYS = {"model", "impl", "mode", "device", "dtype", "batch_size", "img_per_s", "peak_mem_mb", "gmacs", "tflops",
        "util", "ratio_vs_timm", "ratio_vs_timm_compile", "backend"}


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("VITLAB_CACHE_DIR", str(tmp_path / "cache"))


def test_bench_models_against_timm_json_and_plot(tmp_path):
    pytest.importorskip("timm")
    rows = models.bench_models(["deit_tiny_patch16_224"], mode="both", batch_size=1, compare="timm", warmup=1,
                               runs=2, progress=False, optimize="onednn")
    assert {(r["impl"], r["mode"]) for r in rows} == {(i, m) for i in ("vitlab", "timm") for m in ("infer", "train")}
    ours = [r for r in rows if r["impl"] == "vitlab"]
    assert all(KEYS <= set(r) and r["ratio_vs_timm"] > 0 and r["img_per_s"] > 0 for r in ours)
    lo, hi = ours[0]["ratio_spread_timm"]
    assert lo <= ours[0]["ratio_vs_timm"] <= hi
    assert {r["mode"]: r["backend"] for r in ours} == {"infer": "onednn", "train": None}  # optimize: inference
    models.write_json(rows, tmp_path / "m.json")
    models.plot(rows, tmp_path / "m.png")
    data = json.loads((tmp_path / "m.json").read_text())
    assert data["rows"] == rows and {"cpu", "isa"} <= set(data["machine"])
    assert (tmp_path / "m.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_models_no_optimize_is_plain_eager():
    rows = models.bench_models(["deit_tiny_patch16_224"], batch_size=1, warmup=0, runs=1, progress=False,
                               optimize=False)
    assert rows[0]["backend"] is None and rows[0]["ratio_vs_timm"] is None


@pytest.mark.slow
def test_bench_models_against_compiled_timm():
    pytest.importorskip("timm")
    rows = models.bench_models(["deit_tiny_patch16_224"], batch_size=1, compare=["timm", "timm-compile"],
                               warmup=1, runs=2, progress=False, optimize="none")
    assert [r["impl"] for r in rows] == ["vitlab", "timm", "timm-compile"]
    assert rows[0]["ratio_vs_timm_compile"] > 0 and rows[2]["compile"]


def test_bench_models_rejects_bad_input():
    with pytest.raises(ValueError, match="no registered model"):
        models.bench_models(["nope_*"], progress=False)
    with pytest.raises(ValueError, match="mode"):
        models.bench_models(["deit_tiny_patch16_224"], mode="fast", progress=False)
    with pytest.raises(ValueError, match="peers"):
        models.bench_models(["deit_tiny_patch16_224"], compare="onnx", progress=False)
    assert models._peers("timm-compile,timm") == ("timm", "timm-compile")


def test_paired_times_ratio():
    a, b, ratio = paired_times(lambda: sum(range(1000)), lambda: sum(range(100000)), torch.device("cpu"), 1, 5)
    assert b > a and ratio > 1
    times = round_robin_times({"a": lambda: sum(range(1000)), "b": lambda: sum(range(100000))},
                              torch.device("cpu"), 1, 3)
    med, lo, hi = paired_ratio(times, "a", "b")
    assert len(times["a"]) == 3 and 1 < lo <= med <= hi


def test_ladder_rung_in_a_fresh_process(tmp_path):
    rungs = [ladder.Rung("fp32 eager", fused_attn=False), ladder.Rung("bf16 autocast", bf16=True)]
    rows = ladder.bench_ladder("vit_pico_patch8_32", batch_size=2, warmup=1, runs=1, rungs=rungs, progress=False)
    assert [r["rung"] for r in rows] == ["fp32 eager", "bf16 autocast"]
    assert all(r["img_per_s"] > 0 and r["peak_mem_mb"] > 0 for r in rows), rows
    # Mboya's estimate: M = P * 4 B / (32 / Q) * 1.2; bf16 halves the estimate
    assert rows[1]["memory_estimate_mb"] == pytest.approx(rows[0]["memory_estimate_mb"] / 2, rel=1e-3)
    ladder.write_json(rows, tmp_path / "l.json")
    ladder.plot(rows, tmp_path / "l.png")
    assert (tmp_path / "l.png").stat().st_size > 0


@pytest.mark.slow
def test_ladder_fsdp2_two_gloo_processes():
    rows = ladder.bench_ladder("deit_tiny_patch16_224", batch_size=2, warmup=1, runs=1,
                               rungs=[ladder.Rung("FSDP2, 2 processes", fsdp_procs=2)], progress=False)
    assert rows[0].get("error") is None and rows[0]["img_per_s"] > 0, rows
