"""``vitlab bench``: bad counts and misspelt model names give one line and exit 2; in a log or a pipe (not a
terminal) models and tokens print a line per finished model / setting."""

from __future__ import annotations

import re

import pytest

from vitlab.bench import models, tokens
from vitlab.cli import main

TINY = "vit_pico_patch8_32"


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("VITLAB_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize(("argv", "needle"), [
    (["models", TINY, "--batch-size", "0"], "batch size must be an integer >= 1, got 0"),
    (["models", TINY, "--runs", "0"], "runs must be an integer >= 1, got 0"),
    (["models", TINY, "--warmup", "-1"], "warmup must be an integer >= 0, got -1"),
    (["tokens", TINY, "--batch-size", "-2"], "batch size must be"),
    (["attention", "--batch-size", "0"], "batch size must be"),
    (["ladder", TINY, "--runs", "0"], "runs must be"),
    (["models", "vit_pico_patch8_23"], "unknown model 'vit_pico_patch8_23'; close matches: vit_pico_patch8_32"),
    (["models", TINY, "vit_pico_patch8_23"], "close matches: vit_pico_patch8_32"),  # not skipped beside a good one
    (["models", "vit_nope_*"], "no registered model matches"),
])
def test_bad_input_gives_one_line_and_exit_2(argv, needle, capsys):
    assert main(["bench", *argv]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vitlab: error: ") and needle in lines[0], lines


def test_the_api_refuses_bad_counts():
    with pytest.raises(ValueError, match="batch size"):
        models.bench_models([TINY], batch_size=0, progress=False)
    with pytest.raises(ValueError, match="runs"):
        tokens.bench_tokens(TINY, [0], runs=0, progress=False)


def test_not_a_terminal_prints_a_line_per_model_and_setting(capsys):
    """capsys is not a terminal: no live bar, a plain line per finished model (mode) or setting instead."""
    assert main(["bench", "models", TINY, "--mode", "both", "--batch-size", "2", "--warmup", "0", "--runs", "1",
                 "--no-optimize"]) == 0
    out = capsys.readouterr().out.splitlines()
    done = [ln for ln in out if ln.startswith("[")]
    assert len(done) == 2 and all(re.fullmatch(rf"\[\d/2\] {TINY} (infer|train): [\d,]+\.\d img/s  "
                                               r"\(\d+:\d\d, \d+:\d\d elapsed\)", ln) for ln in done), out
    assert main(["bench", "tokens", TINY, "--r", "0,2", "--prune", "evit:0.5", "--batch-size", "2", "--warmup",
                 "0", "--runs", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "timing 3 settings in round robin (cpu, fp32, batch 2)"
    assert [re.sub(r"[\d,]+\.\d img/s  \(\d+:\d\d elapsed\)$", "", ln) for ln in out[1:4]] == \
        ["[1/3] r=0: ", "[2/3] tome r=2: ", "[3/3] evit 0.5: "], out
