"""A plugin outside the package (``tests/plugins/vitlab_toy_plugin.py``) adds a task, a dataset, a dense head and
an SSL method (SimSiam) without editing vitlab; each runs from Python and from the command line (``--import`` and
the ``vitlab.plugins`` entry point)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

PLUGIN_DIR = Path(__file__).resolve().parent / "plugins"
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PLUGIN_DIR))

import vitlab_toy_plugin  # noqa: E402,F401  (registers the plugin's task, dataset, head and method)

from vitlab.data import DataConfig, build  # noqa: E402
from vitlab.train import TrainConfig, evaluate, fit, predict  # noqa: E402

FAST = dict(epochs=1, batch_size=8, quiet=True, threads=1, warmup_epochs=0)
TINY = dict(depth=1, embed_dim=32, num_heads=2)


def _vitlab(args: list[str], cwd: Path, extra_path: list[Path] = ()) -> subprocess.CompletedProcess:
    path = os.pathsep.join([str(ROOT / "src"), *map(str, extra_path)])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    return subprocess.run([sys.executable, "-m", "vitlab", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def test_plugin_dataset_builds_with_pil_images():
    b = build(DataConfig("toy_shapes", img_size=16, options={"n": 12}), in_chans=3)
    x, y = b.train[0]
    assert x.shape == (3, 16, 16) and x.dtype == torch.float32 and b.class_names == ["circle", "square", "triangle"]
    assert len(b.train) == 12 and len(b.val) == 3 and b.test is not None


def test_plugin_task_dataset_head_and_method_from_python(tmp_path):
    data = DataConfig("toy_shapes", img_size=16, options={"n": 24})
    s = fit(TrainConfig.for_task("classify", model="vit_pico_patch8_32", model_kwargs=TINY, data=data,
                                 output_dir=str(tmp_path / "cls"), **FAST))
    assert s["finished"] and s["dataset"] == "toy_shapes" and s["test_top1"] is not None
    s = fit(TrainConfig.for_task("toy_brightness_plugin", data=data, task_args={"hidden": 4},
                                 output_dir=str(tmp_path / "toy"), **FAST))
    assert s["task"] == "toy_brightness_plugin" and s["best_val_mse"] is not None
    assert evaluate(tmp_path / "toy", split="val")["mse"] == pytest.approx(s["best_val_mse"], rel=1e-5)
    with pytest.raises(ValueError, match="task 'toy_brightness_plugin' has no predict"):
        predict(tmp_path / "toy", [str(_png(tmp_path))])
    seg = TrainConfig.for_task("segment", model="vit_pico_patch4_32", model_kwargs=TINY, data={"img_size": 32},
                               task_args={"head": "toy_head", "shapes_train": 8, "shapes_eval": 4, "shapes_size": 32},
                               output_dir=str(tmp_path / "seg"), **{**FAST, "eval_every": 1})
    s = fit(seg)
    assert s["finished"] and 0.0 <= s["best_val_miou"] <= 1.0
    s = fit(TrainConfig.for_task("simsiam", model="vit_pico_patch8_32", model_kwargs=TINY, data=data,
                                 task_args={"dim": 16, "pred_dim": 8}, output_dir=str(tmp_path / "ssl"), **FAST))
    assert s["finished"] and s["task"] == "simsiam"


def _png(tmp_path: Path) -> Path:
    from PIL import Image

    p = tmp_path / "x.png"
    Image.new("RGB", (16, 16), (90, 90, 90)).save(p)
    return p


def test_plugin_from_the_command_line(tmp_path):
    imp = ["--import", "vitlab_toy_plugin"]
    common = ["--epochs", "1", "--batch_size", "8", "--threads", "1", "--warmup_epochs", "0", "--quiet",
              "--data", "toy_shapes", "--data.img_size", "16", "--data.options", "{n: 24}"]
    r = _vitlab([*imp, "train", "--task", "toy_brightness_plugin", "--task_args.hidden", "4", *common,
                 "--output_dir", str(tmp_path / "toy")], tmp_path, [PLUGIN_DIR])
    assert r.returncode == 0, r.stderr
    r = _vitlab(["train", *imp, "--task", "toy_brightness_plugin", "--help"], tmp_path, [PLUGIN_DIR])
    assert r.returncode == 0 and "--task_args.hidden" in r.stdout and "--task_args.scale" in r.stdout
    r = _vitlab([*imp, "eval", "--checkpoint", str(tmp_path / "toy"), "--json"], tmp_path, [PLUGIN_DIR])
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["mse"] >= 0
    r = _vitlab([*imp, "predict", "--checkpoint", str(tmp_path / "toy"), str(_png(tmp_path))], tmp_path, [PLUGIN_DIR])
    assert r.returncode == 2 and r.stderr.strip() == "vitlab: error: task 'toy_brightness_plugin' has no predict"
    r = _vitlab(["pretrain", *imp, "--method", "simsiam", "--model", "vit_pico_patch8_32", "--model_kwargs.depth",
                 "1", *common, "--output_dir", str(tmp_path / "ssl")], tmp_path, [PLUGIN_DIR])
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "ssl" / "summary.json").read_text())["task"] == "simsiam"


def test_plugin_through_the_entry_point_group(tmp_path):
    """An installed plugin: a distribution whose entry point in ``vitlab.plugins`` names the module."""
    dist = tmp_path / "site" / "vitlab_toy_plugin-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vitlab-toy-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[vitlab.plugins]\ntoy = vitlab_toy_plugin\n")
    r = _vitlab(["train", "--task", "toy_brightness_plugin", "--print_config"], tmp_path,
                [tmp_path / "site", PLUGIN_DIR])
    assert r.returncode == 0, r.stderr
    assert "task: toy_brightness_plugin" in r.stdout and "hidden: 8" in r.stdout
