"""``vitlab analyze TOOL``: JSON + PNG in the output folder, the paths printed; bad input is one line, exit 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.train.conftest import TINY_MODEL, tiny_config
from vitlab.cli import main
from vitlab.train import fit

TINY_LITV2 = ["--model-arg", "embed_dim=16", "--model-arg", "depths=[1,1,1,1]", "--model-arg", "num_heads=[1,2,4,8]"]


def _image(tmp_path):
    path = tmp_path / "img.png"
    Image.fromarray((np.random.default_rng(0).random((40, 48, 3)) * 255).astype("uint8")).save(path)
    return str(path)


def test_attention_cli(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["analyze", "attention", "--model", "vit_pico_patch8_32", "--images", _image(tmp_path), "astronaut",
                 "--query", "1,2", "--head-fusion", "max", "--discard-ratio", "0.5", "--out", str(out)]) == 0
    assert str(out / "attention.json") in capsys.readouterr().out
    data = json.loads((out / "attention.json").read_text())
    assert data["images"] == ["img", "astronaut"] and data["query"] == [1, 2]
    assert len(data["maps"]["img"]) == 4 and len(data["rollout_layers"]) == 4  # 4 heads; 4 blocks rolled out
    assert (out / "attention.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("tool,args,files", [
    ("spectrum", ["--model", "litv2_s", "--img-size", "64", *TINY_LITV2, "--images", "coffee"],
     ["spectrum.json", "spectrum-hilo.png", "spectrum-blocks.png"]),
    ("bias", ["--model", "levit_128s", "--img-size", "64", "--model-arg", "depth=[1,1,1]"], ["bias.json", "bias.png"]),
    ("posembed", ["--model", "vit_pico_patch4_32", "--model-arg", "pos_embed=sincos"],
     ["posembed.json", "posembed.png"]),
    ("timings", ["--model", "vit_pico_patch8_32", "--runs", "2", "--warmup", "0"], ["timings.json", "timings.png"]),
    ("window-study", ["--img-size", "64", *TINY_LITV2, "--windows", "2", "--no-memory", "--batch-size", "1",
                      "--runs", "1", "--warmup", "0"], ["window-study.json", "window-study.png"]),
    ("pooled-queries", ["--img-size", "64", *TINY_LITV2, "--batch-size", "1", "--runs", "1", "--warmup", "0"],
     ["pooled-queries.json", "pooled-queries.png"]),
])
def test_tools_write_json_and_png(tool, args, files, tmp_path):
    assert main(["analyze", tool, *args, "--out", str(tmp_path)]) == 0
    for f in files:
        assert (tmp_path / f).stat().st_size > 0
    json.loads((tmp_path / files[0]).read_text())


@pytest.mark.parametrize("argv,msg", [
    (["attention", "--model", "vit_pico_patch8_32", "--block", "9"], "block index 9 is out of range"),
    (["attention", "--model", "vit_pico_patch8_32", "--images", "missing.png"], "no image missing.png"),
    (["attention", "--model", "vit_pico_patch8_32", "--query", "middle"], "--query must be"),
    (["bias", "--model", "vit_pico_patch8_32"], "no attention bias over offsets; models with one: levit_*"),
    (["posembed", "--model", "vit_pico_patch8_32", "--model-arg", "nope=1"], "vit_pico_patch8_32 does not take nope"),
])
def test_bad_input_one_line_exit_2(argv, msg, tmp_path, capsys):
    assert main(["analyze", *argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("vitlab: error: ") and msg in err and len(err.splitlines()) == 1


def test_unreadable_image(tmp_path, capsys):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not an image")
    assert main(["analyze", "attention", "--model", "vit_pico_patch8_32", "--images", str(bad),
                 "--out", str(tmp_path)]) == 2
    assert "unreadable image" in capsys.readouterr().err


@pytest.fixture(scope="module")
def trained_pico(tmp_path_factory):
    """A 1-epoch run of a 1-block pico ViT on 4 fake classes: (run directory, the --model-arg flags of its model)."""
    run = fit(tiny_config(tmp_path_factory.mktemp("analyze-run"), epochs=1))["run_dir"]
    args = [a for k, v in {**TINY_MODEL, "num_classes": 4}.items() for a in ("--model-arg", f"{k}={v}")]
    return Path(run), args


def test_default_output_folders(trained_pico, tmp_path, monkeypatch, capsys):
    """Without --out: runs/analysis/MODEL (never the working directory itself), RUN/analysis for a run's
    checkpoint, runs/analysis/MODEL-NAME for a checkpoint file from elsewhere."""
    run, model_args = trained_pico
    monkeypatch.chdir(tmp_path)
    assert main(["analyze", "posembed", "--model", "vit_pico_patch8_32"]) == 0
    assert (tmp_path / "runs" / "analysis" / "vit_pico_patch8_32" / "posembed.json").is_file()
    assert main(["analyze", "posembed", "--model", "vit_pico_patch8_32", *model_args,
                 "--checkpoint", str(run / "best" / "model.safetensors")]) == 0
    assert (run / "analysis" / "posembed.json").is_file() and (run / "analysis" / "posembed.png").is_file()
    foreign = tmp_path / "weights" / "pico.safetensors"
    foreign.parent.mkdir()
    shutil.copy(run / "best" / "model.safetensors", foreign)
    assert main(["analyze", "posembed", "--model", "vit_pico_patch8_32", *model_args,
                 "--checkpoint", str(foreign)]) == 0
    assert (tmp_path / "runs" / "analysis" / "vit_pico_patch8_32-pico" / "posembed.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs", "weights"]
    capsys.readouterr()


def test_out_that_is_a_file(tmp_path, capsys):
    (tmp_path / "f").write_text("")
    assert main(["analyze", "posembed", "--model", "vit_pico_patch8_32", "--out", str(tmp_path / "f")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a file" in err
