"""``vitlab bench tokens``: GMACs counted with the reduced token counts match ToMe's closed form; the CLI writes
JSON and the speed-accuracy PNG; bad input gets one line and exit code 2."""

from __future__ import annotations

import json

import pytest
import torch

import vitlab
import vitlab.tome as tome
from vitlab.cli import main
from vitlab.profile import count_macs
from vitlab.tome.cost import tome_gmacs


@pytest.mark.parametrize("name,r", [("deit_tiny_patch16_224", 13), ("deit_tiny_distilled_patch16_224", (8, -1.0))])
def test_counted_gmacs_follow_tomes_closed_form(name, r):
    model = vitlab.create_model(name).eval()
    x = torch.randn(1, 3, 224, 224)
    assert count_macs(model, x) / 1e9 == pytest.approx(tome_gmacs(model, [0] * 12), rel=0.02)
    tome.apply(model, r=r)
    counted = count_macs(model, x) / 1e9
    assert counted == pytest.approx(tome_gmacs(model, tome.info(model).r), rel=0.02)
    assert counted < 0.8 * tome_gmacs(model, [0] * 12)  # and the merging did cut the work


def test_cli_writes_json_and_png(tmp_path, capsys):
    js, png = tmp_path / "t.json", tmp_path / "t.png"
    rc = main(["bench", "tokens", "vit_pico_patch8_32", "--r", "0,2", "--prune", "evit:0.7,0.5", "--batch-size", "2",
               "--warmup", "0", "--runs", "2", "--quiet", "--json", str(js), "--plot", str(png)])
    assert rc == 0
    rows = json.loads(js.read_text())["rows"]
    assert [r["setting"] for r in rows] == ["r=0", "tome r=2", "evit 0.7", "evit 0.5"]
    # 16 patches + class token; EViT prunes after blocks 1, 2, 3 of 4 (ceil, plus one fused token each time):
    # 0.7: 16 -> 12+1 -> 10+1 -> 8+1; 0.5: 16 -> 8+1 -> 5+1 -> 3+1
    assert [r["tokens_out"] for r in rows] == [17, 17 - 4 * 2, 1 + 9, 1 + 4]
    assert rows[0]["speedup_vs_r0"] == 1.0 and rows[1]["gmacs"] < rows[0]["gmacs"]
    assert rows[1]["gmacs"] == pytest.approx(rows[1]["gmacs_closed_form"], rel=0.02)
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("argv,msg", [
    (["vit_pico_patch8_32", "--r", "0,x"], "comma-separated integers"),
    (["vit_pico_patch8_32", "--r", "0,5"], "at most 15 can merge"),
    (["vit_pico_patch8_32", "--prune", "evit:1.5"], "keep_rate must be in (0, 1]"),
    (["levit_128s", "--r", "0,4"], "hierarchical"),
    (["vit_pico_patch8_32", "--data", "digits"], "--data needs --checkpoint"),
])
def test_bad_input_is_one_line(argv, msg, capsys):
    assert main(["bench", "tokens", *argv, "--batch-size", "1", "--runs", "1", "--warmup", "0", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and msg in err[0]


@pytest.mark.slow
def test_top1_from_a_checkpoint(tmp_path):
    from vitlab.bench.tokens import bench_tokens
    from vitlab.data import DataConfig
    from vitlab.train import TrainConfig, fit

    cfg = TrainConfig(model="vit_pico_patch8_32", model_kwargs=dict(depth=2, embed_dim=32, num_heads=2),
                      data=DataConfig("digits", img_size=32), epochs=2, batch_size=128, quiet=True,
                      output_dir=str(tmp_path / "run"))
    summary = fit(cfg)
    rows = bench_tokens(None, [0, 1], prune=["topk:0.5"], checkpoint=summary["run_dir"], batch_size=4, warmup=0,
                        runs=1, progress=False)
    assert rows[0]["top1"] == pytest.approx(summary["test_top1"], abs=1e-3)  # rounded to 3 decimals
    assert all(r["top1"] is not None for r in rows)


def test_data_with_other_class_names_is_refused(tmp_path, capsys):
    """--data whose classes differ from the checkpoint's (names or order) would score the wrong labels."""
    from vitlab.data import DataConfig
    from vitlab.train import TrainConfig, fit

    cfg = TrainConfig(model="vit_pico_patch8_32", model_kwargs=dict(depth=1, embed_dim=16, num_heads=2),
                      data=DataConfig("fake", img_size=32, fake_num_samples=8, fake_num_classes=3, fake_img_size=32),
                      epochs=1, batch_size=8, quiet=True, device="cpu", output_dir=str(tmp_path / "run"))
    run = fit(cfg)["run_dir"]
    argv = ["bench", "tokens", "--checkpoint", run, "--r", "0", "--batch-size", "1", "--runs", "1", "--warmup", "0",
            "--quiet"]
    assert main([*argv, "--data", "digits"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "names its classes" in err[0]
