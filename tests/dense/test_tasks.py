"""``--task segment|depth`` through the engine: a tiny run end to end (run dir, checkpoints, resume, test
metrics), evaluation and prediction from the checkpoint's run record, the recipe and the decoder sizing, the poly
schedule, sliding windows and task_args checking."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from tests.train.test_distributed import world_of_one  # noqa: F401  (fixture)
from vitlab.data import DataError
from vitlab.dense.infer import slide
from vitlab.dense.tasks import SegmentArgs, SegmentTask, WarmupPoly, default_head_kwargs
from vitlab.train import TrainConfig, evaluate, fit, predict
from vitlab.train.task import create_task


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


def test_segment_run_evaluates_and_predicts_from_its_checkpoint(tmp_path):
    straight = fit(_cfg(tmp_path / "a", epochs=1, task_args={"head": "segmenter_linear", "shapes_train": 16,
                                                             "shapes_eval": 8}))
    assert straight["finished"] and 0.0 <= straight["test_miou"] <= 1.0 and straight["test_pixel_acc"] > 0
    run = straight["run_dir"]
    r = evaluate(run)  # the run record names the task, the model and the data
    assert r["miou"] == pytest.approx(straight["test_miou"], abs=1e-9)  # the same protocol: sliding windows
    assert list(r["per_class_iou"]) == ["background", "horse", "digit", "coin"] and r["num_images"] == 8
    assert r["summary"].startswith("segmenter_linear on vit_pico_patch8_32 on shapes (test, 8 images): mIoU ")
    assert json.loads(Path(r["files"][0]).read_text())["miou"] == r["miou"]
    img = tmp_path / "x.png"
    Image.new("RGB", (50, 40), (120, 90, 30)).save(img)
    out = tmp_path / "pred"
    [row] = predict(run, [img], output_dir=out)
    assert Image.open(out / "x_overlay.png").size == (50, 40) and Image.open(out / "x_mask.png").mode == "L"
    assert row["line"] == f"{img}: {out / 'x_overlay.png'}  {out / 'x_mask.png'}"
    assert sum(row["classes"].values()) == pytest.approx(1.0)


def test_depth_run_reports_errors_on_the_real_sample(tmp_path):
    s = fit(_cfg(tmp_path, task="depth", head="linear_depth", epochs=1))
    assert s["test_abs_rel"] > 0 and 0 <= s["test_delta1"] <= 1 and s["test_rmse"] > 0
    r = evaluate(s["run_dir"], output_dir=tmp_path / "ev")
    assert r["abs_rel"] == pytest.approx(s["test_abs_rel"], rel=1e-6) and r["files"] == [
        str(tmp_path / "ev" / "eval-depth-test.json")]
    assert "abs_rel" in r["summary"] and "delta3" in r["summary"]
    img = tmp_path / "x.png"
    Image.new("RGB", (40, 40), (10, 200, 30)).save(img)
    [row] = predict(s["run_dir"], [img], output_dir=tmp_path / "p")
    assert Image.open(tmp_path / "p" / "x_depth16.png").size == (40, 40) and row["min_m"] <= row["max_m"]
    assert row["line"].startswith(f"{img}: ") and row["line"].endswith("x_depth16.png")


def test_task_args_are_typed_and_unknown_keys_refused():
    a = TrainConfig.for_task("segment", task_args={"head": "dpt", "ignore_index": "0", "schedule": "cosine"}).task_args
    assert isinstance(a, SegmentArgs) and a.ignore_index == 0 and a.schedule == "cosine"
    assert a.head_kwargs is None  # the head's default sizing, whichever head
    with pytest.raises(ValueError, match="task_args.mask_ratio"):
        TrainConfig.for_task("segment", task_args={"mask_ratio": 0.5})
    with pytest.raises(ValueError, match="schedule"):
        TrainConfig.for_task("segment", task_args={"schedule": "step"})
    with pytest.raises(ValueError, match="stride must be >= 1"):
        TrainConfig.for_task("segment", task_args={"stride": 0})
    with pytest.raises(ValueError, match="silog_lambda"):
        TrainConfig.for_task("depth", task_args={"silog_lambda": 2.0})


def test_a_classification_dataset_is_refused_in_one_line():
    cfg = TrainConfig.for_task("segment", data={"dataset": "digits"})
    with pytest.raises(DataError, match="--task segment takes --data shapes or --data segfolder:PATH"):
        create_task("segment").build(cfg, torch.device("cpu"))


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


def test_segment_defaults_are_the_demo_recipe():
    """``TrainConfig.for_task("segment")`` is the demo's recipe and builds the measured model: ViTDet-SFP sized
    to the width-64 backbone (64 channels, global attention in its four blocks), 0.577M parameters."""
    r = SegmentTask.defaults()
    cfg = TrainConfig.for_task("segment")
    assert cfg == TrainConfig(task="segment").with_overrides(r)
    assert (cfg.model, cfg.epochs, cfg.batch_size, cfg.lr, cfg.data.dataset, cfg.data.scale, cfg.task_args.head) == (
        r["model"], r["epochs"], r["batch_size"], r["lr"], r["data.dataset"], tuple(r["data.scale"]), "vitdet_sfp")
    assert TrainConfig.for_task("segment", epochs=3).epochs == 3  # the caller's values win
    assert TrainConfig.for_task("depth").data.dataset == "shapes"
    task = create_task("segment")
    task.build(TrainConfig.for_task("segment", task_args={"shapes_train": 4, "shapes_eval": 1}), torch.device("cpu"))
    assert task.spec["head_kwargs"] == {"out_channels": 64, "channels": 64, "global_blocks": [0, 1, 2, 3]}
    assert task.num_params == 577_476
    assert task.record().extra["dense"] == task.spec


def test_dpt_is_sized_to_a_small_backbone_unless_told():
    args = {"head": "dpt", "shapes_train": 4, "shapes_eval": 1}
    task = create_task("segment")
    task.build(TrainConfig.for_task("segment", task_args=args), torch.device("cpu"))
    assert task.spec["head_kwargs"] == {"hidden": [8, 16, 32, 64], "fusion": 64}
    assert task.num_params < 1_000_000  # DPT's own 256 channels: 19.7M over the 0.14M backbone
    assert default_head_kwargs("dpt", "vit_base_patch16_224") == {}  # a ViT-B-wide backbone keeps the paper's
    task.build(TrainConfig.for_task("segment", task_args={**args, "head_kwargs": {"fusion": 16}}), torch.device("cpu"))
    assert task.spec["head_kwargs"] == {"fusion": 16}  # an explicit head_kwargs wins
