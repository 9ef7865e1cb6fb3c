"""What a run prints in a log or a pipe: plain progress lines, unwrapped lines, one accuracy format, where a resumed
or interrupted run stands; and a fresh run that fails before its first checkpoint leaves no directory (nor files
in a directory that was there)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.train.conftest import tiny_config
from vitlab._console import clock, metric_text, progress_interval
from vitlab.cli import main
from vitlab.data import DataConfig
from vitlab.train import TrainConfig, fit
from vitlab.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
TINY_FLAGS = ["--model", "vit_pico_patch8_32", "--model_kwargs.depth", "1", "--model_kwargs.embed_dim", "32",
              "--model_kwargs.num_heads", "2", "--data", "fake", "--data.fake_num_samples", "48",
              "--data.fake_num_classes", "4", "--data.fake_img_size", "16", "--batch_size", "16", "--threads", "1"]


def _vitlab(*argv: str, cwd: Path) -> subprocess.Popen:
    """``python -m vitlab ARGV`` with stdout and stderr piped (not a terminal) and a progress line every step."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src"), "VITLAB_PROGRESS_INTERVAL": "0"}
    # Ctrl-C's default action in the child even where the test runs in a background job, whose children inherit
    # an ignored SIGINT (Python then installs no KeyboardInterrupt handler)
    return subprocess.Popen([sys.executable, "-m", "vitlab", *argv], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def test_piped_run_prints_progress_lines_and_never_wraps(tmp_path):
    out = tmp_path / ("a-directory-name-long-enough-to-pass-any-terminal-width-" * 3) / "run"
    so, se = _vitlab("train", *TINY_FLAGS, "--epochs", "2", "--output_dir", str(out), cwd=tmp_path).communicate(
        timeout=120)
    lines = so.splitlines()
    assert not se and len(lines) == 2 * 3 + 2 + 2, so  # 3 steps and an epoch line per epoch, start, done
    steps = [ln for ln in lines if " step " in ln]
    assert [ln.split()[:4] for ln in steps[:3]] == [["epoch", "1/2", "step", f"{i}/3"] for i in (1, 2, 3)]
    assert all(re.search(r"loss \d\.\d{4}  [\d,]+ img/s  ETA \d+:\d\d$", ln) for ln in steps), steps
    assert lines[0].startswith("training vit_pico_patch8_32 ") and lines[0].endswith(f"-> {out}")
    assert lines[-1].startswith("done: ") and lines[-1].endswith(f"run dir {out}")
    assert re.search(r"best val top1 \d+\.\d\d% \(epoch \d", lines[-1]), lines[-1]
    assert re.search(r"^epoch 2/2  loss \d\.\d{4}  val top1 \d+\.\d\d%  lr ", lines[-2]), lines[-2]


def test_progress_helpers(monkeypatch):
    assert (clock(5.4), clock(125), clock(3 * 3600 + 62)) == ("0:05", "2:05", "3:01:02")
    assert (metric_text("top1", 20), metric_text("top5", 99.256), metric_text("miou", 45.6789)) == \
        ("20.00%", "99.26%", "45.68")
    monkeypatch.delenv("VITLAB_PROGRESS_INTERVAL", raising=False)
    assert progress_interval() == 30
    monkeypatch.setenv("VITLAB_PROGRESS_INTERVAL", "soon")
    with pytest.raises(ValueError, match="VITLAB_PROGRESS_INTERVAL must be a number of seconds"):
        progress_interval()


def test_done_line_gives_test_and_val_accuracy_with_two_decimals(tmp_path, capsys):
    fit(tiny_config(tmp_path, data=DataConfig("digits", img_size=16), epochs=1, batch_size=128, lr=2e-2))
    done = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.fullmatch(r"done: vit_pico_patch8_32 on digits: test top1 \d+\.\d\d%  best val top1 \d+\.\d\d% "
                        rf"\(epoch 1, (raw|ema)\)  \d+s  run dir {re.escape(str(tmp_path / 'run'))}", done), done


def test_resumed_run_says_where_it_resumes(tmp_path, capsys):
    fit(tiny_config(tmp_path, epochs=3, stop_after=2, quiet=False))
    run = tmp_path / "run"
    assert capsys.readouterr().out.strip().splitlines()[-1] == (f"stopped after epoch 2/3; continue with: vitlab "
                                                                f"train --resume {run}")
    fit(TrainConfig(resume=str(run), threads=1))
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == f"resuming {run} from epoch 2/3"
    assert lines[1].startswith("training ") and lines[2].startswith("epoch 3/3 ")


def test_ctrl_c_says_how_to_resume(tmp_path):
    run = tmp_path / "run"
    p = _vitlab("train", *TINY_FLAGS, "--epochs", "1000", "--output_dir", str(run), cwd=tmp_path)
    seen = []
    for line in p.stdout:  # the first epoch line: a checkpoint exists, the run is somewhere in a later epoch
        seen.append(line)
        if line.startswith("epoch 1/1000  loss"):
            break
    p.send_signal(signal.SIGINT)
    so, se = p.communicate(timeout=60)
    assert p.returncode == 130, (p.returncode, se[-2000:])
    m = re.search(r"^interrupted in epoch (\d+)/1000; the last checkpoint is epoch (\d+); continue with: vitlab "
                  r"train --resume (.+)$", so, re.M)
    assert m and int(m[1]) == int(m[2]) + 1 >= 2 and m[3] == str(run), "".join(seen) + so
    assert se.strip() == "vitlab: interrupted" and (run / "last").exists()


def _fail_in_first_epoch(monkeypatch, exc: type[BaseException]) -> None:
    def train_epoch(self, epoch, progress):
        raise exc("boom")

    monkeypatch.setattr(Trainer, "train_epoch", train_epoch)


def test_fresh_run_that_fails_before_its_first_checkpoint_leaves_nothing(tmp_path, monkeypatch, capsys):
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    _fail_in_first_epoch(monkeypatch, RuntimeError)
    with pytest.raises(RuntimeError, match="boom"):
        fit(tiny_config(tmp_path, output_dir=str(tmp_path / "new" / "run")))
    assert not (tmp_path / "new").exists()  # the run directory and the parent the run made for it
    with pytest.raises(RuntimeError, match="boom"):
        fit(tiny_config(tmp_path, output_dir=str(kept)))
    # it was there before the run: not the run's to remove, but what the run wrote in it is
    assert [p.name for p in kept.iterdir()] == ["notes.txt"]

    _fail_in_first_epoch(monkeypatch, KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        fit(tiny_config(tmp_path, output_dir=str(tmp_path / "ctrl-c")))
    assert capsys.readouterr().out.strip().splitlines()[-1] == ("interrupted in epoch 1/2; no checkpoint yet, "
                                                                "nothing to resume")
    assert not (tmp_path / "ctrl-c").exists()


def test_failed_or_refused_run_leaves_no_directory(tmp_path, capsys):
    cases = {"data fails at build": ["--data", f"imagefolder:{tmp_path / 'nonexistent'}"],
             "refused config": [*TINY_FLAGS, "--accum_steps", "4"]}  # 3 batches: no optimiser step
    for name, argv in cases.items():
        out = tmp_path / name / "run"
        assert main(["train", *argv, "--output_dir", str(out)]) == 2, name
        assert len(capsys.readouterr().err.strip().splitlines()) == 1
        assert not (tmp_path / name).exists(), name
