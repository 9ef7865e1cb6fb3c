"""fit(): a one-epoch smoke run on digits, the run directory, exact resume, atomic checkpoint saves."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.train.conftest import tiny_config
from vitlab.data import DataConfig
from vitlab.train import checkpoint as ck
from vitlab.train import fit, read_metrics
from vitlab.train.trainer import TIME_KEYS


def test_one_epoch_smoke_on_digits(tmp_path):
    cfg = tiny_config(tmp_path, data=DataConfig("digits", img_size=16), epochs=1, batch_size=128, ema_decay=0.0)
    s = fit(cfg)
    run = tmp_path / "run"
    assert s["model"] == "vit_pico_patch8_32" and s["dataset"] == "digits" and s["epochs"] == 1
    assert s["finished"] and 0 <= s["test_top1"] <= 100 and s["best_val_top1"] >= 0 and s["params_m"] > 0
    assert s["wall_time_s"] > 0
    assert json.loads((run / "summary.json").read_text())["test_top1"] == s["test_top1"]
    rows = read_metrics(run, "epoch")
    assert len(rows) == 1
    assert {"epoch", "train_loss", "val_top1", "val_top5", "lr", "img_per_s", "epoch_time_s"} <= set(rows[0])
    assert (run / "curves.png").stat().st_size > 0 and (run / "config.yaml").is_file()
    for link in ("last", "best"):
        d = (run / link).resolve()
        assert {p.name for p in d.iterdir()} >= {"model.safetensors", "trainer.pt", "meta.json"}
    state = ck.load_trainer_state(run / "last")
    assert {"optimizer", "scheduler", "scaler", "epoch", "step", "rng", "best"} <= set(state)
    assert state["epoch"] == 1 and state["step"] == 9  # 1257 // 128 optimiser steps
    # the saved config is the resolved one and trains again as it is (a new run: no output directory of its own)
    from vitlab.train import TrainConfig

    saved = TrainConfig.load(run / "config.yaml")
    assert saved.data.img_size == 16 and saved.data.preset == "tiny" and saved.output_dir is None


def _weights(run, name="model.safetensors"):
    from safetensors.torch import load_file

    return load_file(str((run / "last").resolve() / name))


def test_resume_is_exact(tmp_path):
    straight = fit(tiny_config(tmp_path / "a"))
    fit(tiny_config(tmp_path / "b", stop_after=1))
    b = tmp_path / "b" / "run"
    assert ck.load_trainer_state(b / "last")["epoch"] == 1
    resumed = fit(tiny_config(tmp_path / "b", resume=str(b), output_dir=str(b)))
    a = tmp_path / "a" / "run"
    for name in ("model.safetensors", "ema.safetensors"):
        wa, wb = _weights(a, name), _weights(b, name)
        assert wa.keys() == wb.keys()
        for k in wa:
            torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=1e-6)
    assert len(read_metrics(a, "epoch")) == 2
    ma, mb = read_metrics(a), read_metrics(b)  # every step and epoch line once, with the straight run's values
    assert len(ma) == len(mb)
    for ra, rb in zip(ma, mb):
        assert {k: v for k, v in ra.items() if k not in TIME_KEYS} == {k: v for k, v in rb.items()
                                                                        if k not in TIME_KEYS}
    sa, sb = ck.load_trainer_state(a / "last"), ck.load_trainer_state(b / "last")
    assert sa["step"] == sb["step"] and torch.equal(sa["rng"][0]["torch"], sb["rng"][0]["torch"])
    assert straight["best_val_top1"] == resumed["best_val_top1"]


def _save(run, name, value, links=("last",)):
    sd = {"w": torch.full((4,), float(value))}
    return ck.save_checkpoint(run, name, sd, {"epoch": value, "rng": ck.rng_state()},
                              {"model": "vit_pico_patch8_32", "epoch": value}, links=links)


def test_failed_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    run = tmp_path / "run"
    _save(run, "epoch-0001", 1, links=("last", "best"))
    real = ck._write_file

    def boom(path, data):
        if path.name == ck.TRAINER:
            real(path, data[: len(data) // 2])
            raise OSError("disk full")
        real(path, data)

    monkeypatch.setattr(ck, "_write_file", boom)
    with pytest.raises(OSError, match="disk full"):
        _save(run, "epoch-0002", 2)
    monkeypatch.undo()
    assert os.readlink(run / "last") == "checkpoints/epoch-0001"
    assert ck.load_trainer_state(run / "last")["epoch"] == 1
    assert _weights(run)["w"][0].item() == 1.0
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["epoch-0001"]


def test_killed_save_keeps_previous_checkpoint(tmp_path):
    """A process SIGKILLed in the middle of writing a checkpoint leaves the previous one loadable."""
    run = tmp_path / "run"
    _save(run, "epoch-0001", 1, links=("last", "best"))
    script = textwrap.dedent(f"""
        import os, signal, torch
        from vitlab.train import checkpoint as ck
        real = ck._write_file
        def dying(path, data):
            if path.name == ck.TRAINER:
                with open(path, "wb") as f:
                    f.write(data[: len(data) // 2])
                    f.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            real(path, data)
        ck._write_file = dying
        ck.save_checkpoint({str(run)!r}, "epoch-0002", {{"w": torch.full((4,), 2.0)}}, {{"epoch": 2}},
                           {{"model": "vit_pico_patch8_32", "epoch": 2}})
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    assert any(p.name.endswith(".tmp") for p in (run / "checkpoints").iterdir())  # the half-written attempt
    assert ck.load_trainer_state(run / "last")["epoch"] == 1
    assert _weights(run)["w"][0].item() == 1.0
    _save(run, "epoch-0002", 2)  # the next save succeeds and clears the leftovers
    assert ck.load_trainer_state(run / "last")["epoch"] == 2
    assert os.readlink(run / "best") == "checkpoints/epoch-0001"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["epoch-0001", "epoch-0002"]


def test_existing_run_dir_is_refused(tmp_path):
    fit(tiny_config(tmp_path, epochs=1, stop_after=1))
    with pytest.raises(ValueError, match="already holds a run"):
        fit(tiny_config(tmp_path, epochs=1))


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_amp_accumulation_channels_last_grad_checkpointing(tmp_path, amp):
    s = fit(tiny_config(tmp_path, epochs=1, amp=amp, accum_steps=2, batch_size=8, channels_last=True,
                        grad_checkpointing=True))
    assert s["finished"] and s["global_batch"] == 16
    state = ck.load_trainer_state(tmp_path / "run" / "last")
    assert state["step"] == 3  # 48 images / (8 x 2)
    assert state["scaler"] or amp == "bf16"  # fp16 keeps a GradScaler state


@pytest.mark.slow
def test_compile(tmp_path):
    assert fit(tiny_config(tmp_path, epochs=1, compile=True))["finished"]


def test_python_resume_takes_the_runs_own_model_and_data_and_restores_threads(tmp_path, capsys):
    """``fit(TrainConfig(resume=RUN))`` continues the run with its own model, data and recipe, as the CLI does."""
    from tests.train.conftest import TINY_MODEL
    from vitlab.cli import main
    from vitlab.train import TrainConfig
    from vitlab.train.trainer import resume_config

    fit(tiny_config(tmp_path, stop_after=1))
    run = tmp_path / "run"
    threads = torch.get_num_threads()
    cfg = resume_config(TrainConfig(resume=str(run), threads=1))
    assert cfg.model_kwargs == TINY_MODEL and cfg.data.dataset == "fake" and cfg.lr == 5e-3 and cfg.threads == 1
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--threads", "1", "--print-config"]) == 0
    assert TrainConfig.from_yaml(capsys.readouterr().out) == cfg  # the CLI resolves it the same way
    s = fit(TrainConfig(resume=str(run), threads=1))
    assert s["finished"] and s["epochs_done"] == 2 and s["dataset"] == "fake"
    assert ck.load_trainer_state(run / "last")["epoch"] == 2
    assert torch.get_num_threads() == threads  # fit set one thread, then gave the old count back


@pytest.mark.parametrize("which", ["last", "best"])
def test_the_test_split_scores_the_chosen_checkpoint(tmp_path, which):
    from vitlab.train import evaluate

    cfg = tiny_config(tmp_path, data=DataConfig("digits", img_size=16), epochs=2, batch_size=128, ema_decay=0.0,
                      test_weights=which)
    s = fit(cfg)
    assert s["test_weights"] == which
    direct = evaluate(tmp_path / "run" / which, "digits", output_dir=tmp_path / "eval", optimize=False)
    assert s["test_top1"] == pytest.approx(direct["top1"])
