"""``--task segment|depth`` through the engine: a tiny run end to end (run dir, checkpoints, resume, test
metrics), ``vitlab eval / predict --task``, the poly schedule, sliding windows and task_args checking."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from tests.train.test_distributed import world_of_one  # noqa: F401  (fixture)
from vitlab.cli import main
from vitlab.dense.infer import slide
from vitlab.dense.tasks import SegmentArgs, WarmupPoly
from vitlab.train import TrainConfig, fit
from vitlab.train.config import parse_task_args


def _cfg(tmp_path, task="segment", head="segmenter_linear", **kw):
    d = {"task": task, "model": "vit_pico_patch8_32", "data": {"dataset": "shapes", "img_size": 32},
         "task_args": {"head": head, "shapes_train": 16, "shapes_eval": 2}, "epochs": 2, "batch_size": 8,
         "threads": 1, "output_dir": str(tmp_path / "run"), "quiet": True, "warmup_epochs": 0.5}
    d.update(kw)
    return TrainConfig.from_dict(d)


@pytest.mark.slow
def test_segment_resume_repeats_the_straight_run(tmp_path):
    straight = fit(_cfg(tmp_path / "a"))
    fit(_cfg(tmp_path / "b", stop_after=1))
    resumed = fit(TrainConfig(resume=str(tmp_path / "b" / "run")))
    assert resumed["test_miou"] == pytest.approx(straight["test_miou"], abs=1e-9)  # exact resume on CPU


def test_segment_run_eval_and_predict(tmp_path, capsys):
    straight = fit(_cfg(tmp_path / "a", epochs=1))
    assert straight["finished"] and 0.0 <= straight["test_miou"] <= 1.0 and straight["test_pixel_acc"] > 0
    run = straight["run_dir"]
    capsys.readouterr()
    assert main(["eval", "--checkpoint", run, "--json"]) == 0  # the task is read from the checkpoint
    r = json.loads(capsys.readouterr().out)
    assert r["miou"] == pytest.approx(straight["test_miou"], abs=1e-9)  # the same protocol: sliding windows
    assert list(r["per_class_iou"]) == ["background", "horse", "digit", "coin"]
    img = tmp_path / "x.png"
    Image.new("RGB", (50, 40), (120, 90, 30)).save(img)
    out = tmp_path / "pred"
    assert main(["predict", "--task", "segment", "--checkpoint", run, str(img), "--output-dir", str(out)]) == 0
    assert Image.open(out / "x_overlay.png").size == (50, 40) and Image.open(out / "x_mask.png").mode == "L"
    capsys.readouterr()
    assert main(["eval", "--task", "classify", "--checkpoint", run]) == 2  # one line naming the mismatch
    assert "is a segment checkpoint" in capsys.readouterr().err


def test_depth_run_reports_errors_on_the_real_sample(tmp_path):
    s = fit(_cfg(tmp_path, task="depth", head="linear_depth", epochs=1))
    assert s["test_abs_rel"] > 0 and 0 <= s["test_delta1"] <= 1 and s["test_rmse"] > 0
    img = tmp_path / "x.png"
    Image.new("RGB", (40, 40), (10, 200, 30)).save(img)
    assert main(["predict", "--task", "depth", "--checkpoint", s["run_dir"], str(img), "--output-dir",
                 str(tmp_path / "p")]) == 0
    assert Image.open(tmp_path / "p" / "x_depth16.png").size == (40, 40)


def test_task_args_are_typed_and_unknown_keys_refused():
    a = parse_task_args({"head": "dpt", "ignore_index": "0", "schedule": "cosine"}, SegmentArgs)
    assert a.ignore_index == 0 and a.schedule == "cosine"
    with pytest.raises(ValueError, match="unknown --task_args key"):
        parse_task_args({"mask_ratio": 0.5}, SegmentArgs)
    with pytest.raises(ValueError, match="schedule"):
        parse_task_args({"schedule": "step"}, SegmentArgs)


def test_poly_schedule():
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    s = WarmupPoly(opt, total_steps=110, warmup_steps=10, base_lr=1.0, min_lr=0.0, warmup_lr=0.0)
    assert s.lr(5) == pytest.approx(0.5) and s.lr(10) == pytest.approx(1.0)
    assert s.lr(60) == pytest.approx(0.5 ** 0.9) and s.lr(110) == pytest.approx(0.0)


def test_sliding_window_equals_direct_application_of_a_pointwise_model():
    conv = torch.nn.Conv2d(3, 5, 1)
    x = torch.randn(2, 3, 45, 70)
    torch.testing.assert_close(slide(conv, x, 32, 5), conv(x).detach(), rtol=1e-5, atol=1e-5)
    small = torch.randn(1, 3, 20, 24)  # smaller than the window: padded, then cropped
    torch.testing.assert_close(slide(conv, small, 32, 5), conv(small).detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_segment_under_each_strategy(tmp_path, strategy):
    s = fit(_cfg(tmp_path, head="dpt", epochs=1, strategy=strategy,
                 task_args={"head": "dpt", "shapes_train": 16, "shapes_eval": 2,
                            "head_kwargs": {"hidden": [8, 16, 32, 64], "fusion": 16}}))
    assert s["finished"] and s["strategy"] == strategy and s["test_miou"] is not None
    if strategy == "fsdp":
        assert s["fsdp_units"] == 4 + 1 + 1  # the backbone's blocks, the decoder, the root


def test_segment_defaults_are_the_demo_recipe(capsys):
    """``vitlab train --task segment`` starts from SegmentTask.recipe; flags override it, and naming another head
    drops the recipe's decoder options (they belong to its head)."""
    import yaml

    from vitlab.dense.tasks import SegmentTask

    def resolved(*flags):
        capsys.readouterr()
        assert main(["train", "--task", "segment", "--print_config", *flags]) == 0
        return yaml.safe_load(capsys.readouterr().out)

    cfg = resolved()
    r = SegmentTask.recipe
    assert (cfg["model"], cfg["epochs"], cfg["lr"], cfg["data"]["scale"]) == (
        r["model"], r["epochs"], r["lr"], r["data.scale"])
    assert cfg["task_args"] == {"head": r["task_args.head"], "head_kwargs": r["task_args.head_kwargs"]}
    assert resolved("--data", "shapes")["data"]["scale"] == r["data.scale"]  # naming the data keeps the recipe
    cfg = resolved("--epochs", "3", "--task_args.head", "dpt")
    assert cfg["epochs"] == 3 and cfg["model"] == r["model"] and cfg["task_args"] == {"head": "dpt"}
    assert resolved("--task", "classify")["model"] == TrainConfig().model  # other tasks keep their defaults
