"""The single-layer attention benchmark (LITv2 supplementary, Table IV) with tiny settings: rows, JSON, PNG, table."""

from __future__ import annotations

import json

import pytest
from rich.console import Console
from rich.table import Table

from vitlab.attention import list_attention
from vitlab.bench import TABLE_IV, bench_attention, format_table, plot, write_json
from vitlab.bench.attention import ROW_KEYS

ONLY = ["msa", "xca", "hornet"]


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("VITLAB_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))  # optimize's choices: not the user's
    yield bench_attention(device="cpu", batch_size=2, dtype="fp32", only=ONLY, warmup=1, runs=2,
                          hw=(7, 7), dim=64, num_heads=4, progress=False)
    mp.undo()


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("VITLAB_CACHE_DIR", str(tmp_path / "cache"))


def test_rows(rows):
    assert [r["name"] for r in rows] == sorted(ONLY)
    for r in rows:
        assert set(ROW_KEYS) <= set(r)
        assert r["device"] == "cpu" and r["dtype"] == "fp32" and r["batch_size"] == 2
        assert r["img_per_s"] > 0 and r["params_m"] > 0 and r["mflops"] > 0
        assert r["paper_cpu_img_per_s"] == TABLE_IV[r["name"]][3]
        assert r["paper_gpu_img_per_s"] == TABLE_IV[r["name"]][4]
        assert r["backend"] in ("none", "onednn", "kernels")  # through vitlab.optimize by default
    msa = next(r for r in rows if r["name"] == "msa")
    assert msa["rel_msa"] == 1.0
    for r in rows:
        assert r["rel_msa"] == pytest.approx(r["img_per_s"] / msa["img_per_s"], rel=1e-2, abs=1e-3)


def test_json_and_png_written(rows, tmp_path):
    path = write_json(rows, tmp_path / "out" / "attention.json")
    data = json.loads(path.read_text())
    assert data["benchmark"] == "attention" and data["rows"] == rows
    assert {"cpu", "isa", "threads", "native_bf16"} <= set(data["machine"])  # CPU speeds depend on them
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]  # the temp file was replaced
    png = plot(rows, tmp_path / "attention.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_table(rows):
    table = format_table(rows)
    assert isinstance(table, Table) and table.row_count == len(rows)
    console = Console(width=120, record=True)
    console.print(table)
    text = console.export_text()
    assert "rel. MSA" in text and "paper GPU" in text and "4,403" in text
    assert "FLOPs are MACs" in text and "ISA" in text and "vitlab.optimize backend" in text


def test_unknown_name_and_bad_dtype_are_refused():
    with pytest.raises(ValueError, match="unknown attention"):
        bench_attention(only="nope", progress=False)
    with pytest.raises(ValueError, match="dtype"):
        bench_attention(only=["msa"], dtype="int3", progress=False)


def test_every_mechanism_runs_once_at_tiny_size():
    rows = bench_attention(batch_size=1, warmup=0, runs=1, hw=(6, 6), dim=64, num_heads=4, progress=False)
    assert [r["name"] for r in rows] == list_attention()


def test_bf16_means_autocast_with_fp32_weights():
    kw = dict(device="cpu", batch_size=1, dtype="bf16", only=["msa", "hilo"], warmup=0, runs=1, hw=(4, 4), dim=32,
              num_heads=4, progress=False)
    rows = bench_attention(**kw)
    assert all(r["dtype"] == "bf16" and r["autocast"] for r in rows)
    cast = bench_attention(**kw, autocast=False)  # the module cast to bf16 instead
    assert all(not r["autocast"] for r in cast)
    assert all(r["autocast"] is False for r in bench_attention(**{**kw, "dtype": "fp32"}))


def test_no_optimize_times_the_plain_layers():
    rows = bench_attention(batch_size=1, only=["msa"], warmup=0, runs=1, hw=(4, 4), dim=32, num_heads=4,
                           progress=False, optimize=None)
    assert rows[0]["backend"] == "eager (not optimized)"
