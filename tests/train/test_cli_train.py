"""The command line: eval/predict outputs, and every bad input -> one line on stderr, exit code 2, no traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from vitlab.cli import main
from vitlab.train import evaluate, predict

ROOT = Path(__file__).resolve().parents[2]


def _run_all(cmds: list[list[str]], cwd) -> list[subprocess.CompletedProcess]:
    """Start every ``python -m vitlab ...`` at once (each spends most of its time importing torch)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    procs = [subprocess.Popen([sys.executable, "-m", "vitlab", *c], cwd=cwd, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for c in cmds]
    out = []
    for c, p in zip(cmds, procs):
        so, se = p.communicate(timeout=240)
        out.append(subprocess.CompletedProcess(c, p.returncode, so, se))
    return out


def test_eval_outputs(trained_run, tmp_path):
    run, summary = trained_run
    r = evaluate(run, "digits", output_dir=tmp_path, optimize=False)
    assert r["split"] == "test" and r["num_images"] == 270
    assert r["top1"] == pytest.approx(summary["test_top1"])  # the same best weights as fit's test
    assert 0 <= r["top1"] <= r["top5"] <= 100
    assert sorted(r["per_class_top1"]) == [str(i) for i in range(10)]
    saved = json.loads((tmp_path / "eval-test.json").read_text())
    assert saved["confusion_matrix"] == r["confusion_matrix"] and len(saved["confusion_matrix"]) == 10
    assert sum(map(sum, saved["confusion_matrix"])) == 270
    assert (tmp_path / "confusion-test.png").read_bytes()[:4] == b"\x89PNG"


def test_predict_outputs(trained_run, tmp_path):
    run, _ = trained_run
    paths = []
    for i, shade in enumerate((0, 255)):
        p = tmp_path / f"img{i}.png"
        Image.new("RGB", (20, 12), (shade, shade, shade)).save(p)  # any size, any mode: converted and resized
        paths.append(p)
    rows = predict(run / "best" / "model.safetensors", paths, topk=3, optimize=False)
    assert [r["image"] for r in rows] == [str(p) for p in paths]
    for r in rows:
        assert len(r["top"]) == 3 and all(label in [str(i) for i in range(10)] for label, _ in r["top"])
        probs = [p for _, p in r["top"]]
        assert probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1 + 1e-6


def test_cli_eval_predict_and_config(trained_run, tmp_path, capsys):
    run, _ = trained_run
    img = tmp_path / "x.png"
    Image.new("L", (8, 8), 128).save(img)
    assert main(["predict", "--checkpoint", str(run), str(img), "--topk", "2", "--json", "--no-optimize"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 1 and len(rows[0]["top"]) == 2
    assert main(["eval", "--checkpoint", str(run), "--output-dir", str(tmp_path), "--json", "--no-optimize"]) == 0
    assert json.loads(capsys.readouterr().out)["dataset"] == "digits"  # the data it was trained on
    assert main(["train", "--print-config", "--epochs", "3", "--lr", "0.01", "--data.img_size", "16"]) == 0
    text = capsys.readouterr().out
    assert "epochs: 3" in text and "lr: 0.01" in text and "img_size: 16" in text


def _printed_config(capsys, *argv):
    from vitlab.train import TrainConfig

    assert main(["train", "--print-config", *argv]) == 0
    return TrainConfig.from_yaml(capsys.readouterr().out)


def test_flags_are_generated_from_the_config_dataclasses(tmp_path, capsys):
    # dashes or underscores, nested dotted flags, Literal choices, bare switches, short aliases, free dict keys
    cfg = _printed_config(capsys, "--batch-size", "8", "--accum_steps", "2", "--data.mixup", "0.8", "--amp",
                          "bf16", "--quiet", "--ema-warmup", "false", "--data", "fake", "--data.scale", "1,1",
                          "--distill", "soft", "--teacher", "vit_pico_patch8_32", "--model_kwargs.depth", "3",
                          "--task_args.distill.student_layers", "0,1", "--clip_grad", "none", "--data.preset", "tiny")
    assert (cfg.batch_size, cfg.accum_steps, cfg.amp, cfg.quiet, cfg.ema_warmup) == (8, 2, "bf16", True, False)
    assert cfg.data.dataset == "fake" and cfg.data.mixup == 0.8 and cfg.data.scale == (1.0, 1.0)
    assert cfg.data.preset == "tiny" and cfg.clip_grad is None
    assert cfg.task_args.distill.kind == "soft" and cfg.task_args.distill.teacher == "vit_pico_patch8_32"
    assert cfg.task_args.distill.student_layers == [0, 1] and cfg.model_kwargs == {"depth": 3}
    # --config with flags on top
    (tmp_path / "run.yaml").write_text("epochs: 7\nlr: 0.001\ndata:\n  dataset: fake\n  mixup: 0.2\n")
    cfg = _printed_config(capsys, "--config", str(tmp_path / "run.yaml"), "--lr", "0.002", "--data.cutmix", "0.5")
    assert (cfg.epochs, cfg.lr, cfg.data.dataset, cfg.data.mixup, cfg.data.cutmix) == (7, 0.002, "fake", 0.2, 0.5)
    # help: each field's comment, its default, the Literal choices
    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--amp {none,bf16,fp16}" in out and "--task_args.distill.kind {none,hard,soft,feature}" in out
    assert "stochastic depth rate (default: 0.1)" in out and "--data.mixup" in out and "MixUp alpha" in out
    assert "--task_args.label_smoothing" in out and "--task_args.head" not in out
    # another task's options: vitlab train --task segment --help
    with pytest.raises(SystemExit):
        main(["train", "--task", "segment", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--task_args.head" in out and "--task_args.label_smoothing" not in out


def test_python_and_the_command_line_build_the_same_config(tmp_path, capsys):
    """``TrainConfig.for_task(name, **overrides)`` is what ``vitlab train --task name --FLAGS`` runs: the same
    resolved config, and the same config.yaml once trained (the run directory aside)."""
    from vitlab.train import TrainConfig, fit

    cases = [(["--task", "segment"], {}), (["--task", "clip"], {}), (["--task", "classify"], {}),
             (["--task", "segment", "--epochs", "2", "--task_args.head", "dpt"],
              {"epochs": 2, "task_args": {"head": "dpt"}}),
             (["--task", "mae", "--task_args.mask_ratio", "0.6", "--data.img_size", "16"],
              {"task_args": {"mask_ratio": 0.6}, "data": {"img_size": 16}})]
    for argv, kw in cases:
        assert main(["train", "--print-config", *argv]) == 0
        assert capsys.readouterr().out == TrainConfig.for_task(argv[1], **kw).to_yaml(), argv
    tiny = {"epochs": 1, "batch_size": 8, "threads": 1, "quiet": True, "model_kwargs": {"depth": 1},
            "task_args": {"shapes_train": 8, "shapes_eval": 4}}
    fit(TrainConfig.for_task("segment", output_dir=str(tmp_path / "py"), **tiny))
    assert main(["train", "--task", "segment", "--epochs", "1", "--batch_size", "8", "--threads", "1", "--quiet",
                 "--model_kwargs.depth", "1", "--task_args.shapes_train", "8", "--task_args.shapes_eval", "4",
                 "--output_dir", str(tmp_path / "cli")]) == 0
    assert (tmp_path / "py" / "config.yaml").read_text() == (tmp_path / "cli" / "config.yaml").read_text()


def _bad_cases(run, tmp_path) -> dict[str, tuple[list[str], str]]:
    bad_img = tmp_path / "broken.png"
    bad_img.write_bytes(b"not an image")
    (tmp_path / "bad.yaml").write_text("epochs: [1, 2\n")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    empty = tmp_path / "emptyfolder"
    (empty / "train" / "cat").mkdir(parents=True)
    (empty / "val").mkdir()
    three = tmp_path / "three"
    for split in ("train", "val"):
        for c in ("a", "b", "c"):
            (three / split / c).mkdir(parents=True)
            Image.new("L", (8, 8), 40).save(three / split / c / "0.png")
    return {
        "missing data dir": (["train", "--data", f"imagefolder:{tmp_path / 'nope'}"], "missing directory"),
        "class dir without images": (["train", "--data", f"imagefolder:{empty}"], "cat"),
        "cifar not downloaded": (["train", "--data", f"cifar10:{tmp_path / 'c10'}"], "--download"),
        "unknown dataset": (["train", "--data", "svhn"], "unknown dataset"),
        "unknown model": (["train", "--model", "vit_nope"], "unknown model"),
        "unknown key": (["train", "--no_such_key", "1"], "unknown config key"),
        "close match": (["train", "--epoch", "2"], "did you mean epochs"),
        "unknown task option": (["train", "--task_args.tome", "2"], "did you mean task_args.tome_r"),
        "ill-typed task option": (["train", "--task_args.tome_r", "many"], "task_args.tome_r: cannot read 'many'"),
        "bad value": (["train", "--data.img_size", "big"], "cannot read"),
        "bad range": (["train", "--epochs", "0"], "epochs must be"),
        "bad choice": (["train", "--amp", "fp8"], "expected one of none, bf16, fp16"),
        "bad nested choice": (["train", "--task_args.distill.kind", "medium"], "distill.kind"),
        "flag without value": (["train", "--epochs"], "expected one argument"),
        "unknown task": (["train", "--task", "nope"], "unknown task"),
        "unknown subcommand": (["tran"], "invalid choice"),
        "missing config": (["train", "--config", str(tmp_path / "none.yaml")], "config file not found"),
        "bad yaml": (["train", "--config", str(tmp_path / "bad.yaml")], "not valid YAML"),
        "yaml not a mapping": (["train", "--config", str(tmp_path / "list.yaml")], "mapping"),
        "resume nothing": (["train", "--resume", str(tmp_path / "norun")], "no run to resume"),
        "ddp without torchrun": (["train", "--strategy", "ddp"], "torchrun"),
        "missing checkpoint": (["eval", "--checkpoint", str(tmp_path / "no.safetensors"), "--data", "digits"],
                               "not found"),
        "class count mismatch": (["eval", "--checkpoint", str(run), "--data", f"imagefolder:{three}"],
                                 "3 classes but the checkpoint has 10"),
        "missing image": (["predict", "--checkpoint", str(run), str(tmp_path / "no.png")], "image not found"),
        "unreadable image": (["predict", "--checkpoint", str(run), str(bad_img)], "unreadable image"),
        "not a checkpoint": (["predict", "--checkpoint", str(tmp_path / "bad.yaml"), str(bad_img)],
                             "checkpoint"),
    }


def _check(name, needle, code, stderr):
    lines = stderr.strip().splitlines()
    assert code == 2, (name, code, stderr[-2000:])
    assert len(lines) == 1 and lines[0].startswith("vitlab: error: "), (name, stderr[-2000:])
    assert "Traceback" not in stderr and needle in lines[0], (name, lines)


def test_bad_inputs_give_one_line_and_exit_2(trained_run, tmp_path, capsys):
    """Every bad input through main() (the CLI's error boundary) in this process."""
    run, _ = trained_run
    for name, (argv, needle) in _bad_cases(run, tmp_path).items():
        code = main(argv)
        _check(name, needle, code, capsys.readouterr().err)


SUBPROCESS_CASES = ("missing data dir", "class count mismatch", "unreadable image")


def test_bad_inputs_through_python_m_vitlab(trained_run, tmp_path):
    """A few of them as a user meets them: a fresh ``python -m vitlab`` process."""
    run, _ = trained_run
    cases = {k: v for k, v in _bad_cases(run, tmp_path).items() if k in SUBPROCESS_CASES}
    for (name, (_, needle)), r in zip(cases.items(), _run_all([c for c, _ in cases.values()], cwd=tmp_path)):
        _check(name, needle, r.returncode, r.stderr)


@pytest.mark.slow
def test_every_bad_input_through_python_m_vitlab(trained_run, tmp_path):
    run, _ = trained_run
    cases = _bad_cases(run, tmp_path)
    for (name, (_, needle)), r in zip(cases.items(), _run_all([c for c, _ in cases.values()], cwd=tmp_path)):
        _check(name, needle, r.returncode, r.stderr)


@pytest.mark.slow
def test_eval_and_predict_through_vitlab_optimize_match_eager(trained_run, tmp_path):
    run, _ = trained_run
    eager = evaluate(run, "digits", output_dir=tmp_path, optimize=False)
    fast = evaluate(run, "digits", output_dir=tmp_path)  # the default: vitlab.optimize
    assert fast["confusion_matrix"] == eager["confusion_matrix"]
    img = tmp_path / "x.png"
    Image.new("L", (8, 8), 128).save(img)
    a, b = predict(run, [img], optimize=False)[0]["top"], predict(run, [img])[0]["top"]
    assert [label for label, _ in a] == [label for label, _ in b]
    assert [p for _, p in a] == pytest.approx([p for _, p in b], abs=1e-5)
