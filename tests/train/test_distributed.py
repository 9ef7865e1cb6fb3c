"""DDP and FSDP2 under torchrun with 2 gloo processes on CPU (tiny runs: one block, 8x8 fake images; about a
minute each on 2 cores, so ``slow``), and the same strategies in this process as a world of one (seconds, in the
fast suite: EMA under FSDP, feature distillation under DDP and FSDP, the dcp checkpoint round trip, exact
resume)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Full-batch steps on 64 unaugmented fake images: one process with batch 64 and two with 32 each see the same
# samples in every step, so the averaged gradients and the loss curves agree up to float summation order. At 8x8
# RandomResizedCrop with scale (1, 1) can only return the whole image (any other aspect ratio rounds out of it).
COMMON = ["--data", "fake", "--data.fake_num_samples", "64", "--data.fake_img_size", "8",
          "--model_kwargs.patch_size", "4",
          "--data.fake_num_classes", "4", "--data.scale", "1,1", "--data.randaugment", "false", "--data.reprob", "0",
          "--data.hflip", "0",
          "--data.mixup", "0", "--data.cutmix", "0", "--model_kwargs.depth", "1", "--drop_path", "0",
          "--epochs", "3", "--quiet"]


def _launch(nproc: int, out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "vitlab", "train", *COMMON, "--output-dir", str(out), *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def _losses(run: Path) -> list[float]:
    from vitlab.train import read_metrics

    return [r["train_loss"] for r in read_metrics(run, "epoch")]


@pytest.mark.slow  # ~1 min each on 2 cores; the world-of-one tests below cover the strategies in the fast suite
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_match_one_at_the_same_global_batch(tmp_path, strategy):
    _launch(1, tmp_path / "one", "--strategy", strategy, "--batch-size", "64")
    _launch(2, tmp_path / "two", "--strategy", strategy, "--batch-size", "32")
    one, two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert len(one) == len(two) == 3
    assert one == pytest.approx(two, rel=1e-4, abs=1e-5)
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["strategy"] == strategy
    if strategy == "fsdp":
        assert summary["fsdp_units"] == 2  # the one block, then the root
    else:
        assert "fsdp_units" not in summary


FEATURE = ["--distill", "feature", "--teacher", "vit_pico_patch8_32", "--task_args.distill.teacher_kwargs",
           "{depth: 2, embed_dim: 48, num_heads: 2, patch_size: 4}", "--task_args.distill.student_layers", "0",
           "--task_args.distill.teacher_layers", "1", "--ema-decay", "0.9"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_feature_distillation_and_ema_two_processes_match_one(tmp_path, strategy):
    """The projectors' gradients are averaged across ranks (they train inside the wrapped module) and the EMA
    follows the sharded weights: two processes at batch 32 match one at batch 64."""
    from vitlab.train import read_metrics

    _launch(1, tmp_path / "one", "--strategy", strategy, "--batch-size", "64", *FEATURE)
    _launch(2, tmp_path / "two", "--strategy", strategy, "--batch-size", "32", *FEATURE)
    one, two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert one == pytest.approx(two, rel=1e-4, abs=1e-5)
    rows = read_metrics(tmp_path / "two", "epoch")
    rows1 = read_metrics(tmp_path / "one", "epoch")
    assert [r["ema_val_loss"] for r in rows] == pytest.approx([r["ema_val_loss"] for r in rows1], rel=1e-4)


# ---------------------------------------------------------------- in this process, a world of one


@pytest.fixture
def world_of_one(monkeypatch):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(k, v)


def _feature_cfg(out, strategy, **kw):
    from tests.train.conftest import tiny_config
    from vitlab.classify import DistillConfig
    from vitlab.data import DataConfig

    data = DataConfig("fake", fake_num_samples=32, fake_num_classes=4, fake_img_size=16, mixup=0.0, cutmix=0.0)
    return tiny_config(out, data=data, strategy=strategy, ema_decay=0.9, batch_size=16, epochs=2, distill=DistillConfig(
        kind="feature", teacher="vit_pico_patch8_32", teacher_kwargs={"depth": 2, "embed_dim": 48, "num_heads": 2},
        student_layers=[0], teacher_layers=[1]), **kw)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_ema_and_feature_distillation_under_each_strategy_resume_exactly(tmp_path, world_of_one, strategy):
    import torch
    import torch.distributed as dist

    from vitlab.train import checkpoint as ck
    from vitlab.train import fit, read_metrics

    straight = fit(_feature_cfg(tmp_path / "a", strategy))
    assert not dist.is_initialized()  # fit closes the group it opened
    assert straight["strategy"] == strategy and straight["finished"]
    assert (straight.get("fsdp_units") == 2) == (strategy == "fsdp")
    fit(_feature_cfg(tmp_path / "b", strategy, stop_after=1))
    b = tmp_path / "b" / "run"
    fit(_feature_cfg(tmp_path / "b", strategy, resume=str(b)))
    a = tmp_path / "a" / "run"
    assert _losses(a) == _losses(b)
    for name in ("model.safetensors", "ema.safetensors"):
        wa, _ = ck.load_weights((a / "last").resolve() / name)
        wb, _ = ck.load_weights((b / "last").resolve() / name)
        for k in wa:
            torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=1e-6)
    state = ck.load_trainer_state(a / "last")
    assert "projector" in state and state["ema_updates"] == 4
    rows = read_metrics(a, "epoch")
    assert all("ema_val_top1" in r for r in rows)


@pytest.mark.slow
def test_fsdp_checkpoint_saved_then_resumed(tmp_path):
    run = tmp_path / "run"
    _launch(2, run, "--strategy", "fsdp", "--batch-size", "32", "--stop-after", "2")
    ckpt = (run / "last").resolve()
    assert (ckpt / "dcp").is_dir() and (ckpt / "model.safetensors").is_file()
    _launch(2, tmp_path / "straight", "--strategy", "fsdp", "--batch-size", "32")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "-m", "vitlab", "train", "--resume", str(run), "--strategy", "fsdp", "--quiet"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert _losses(run) == pytest.approx(_losses(tmp_path / "straight"), rel=1e-5, abs=1e-6)
    # the gathered weights evaluate like any checkpoint
    from vitlab.train import evaluate

    assert evaluate(run, split="val", output_dir=tmp_path, optimize=False)["num_images"] == 16


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}


@pytest.mark.slow  # four torchrun launches: about 3 min on 2 cores
def test_fsdp_resumes_with_another_world_size(tmp_path):
    """A sharded checkpoint of 2 processes resumes in 1 (accumulating twice the micro-batches to keep the global
    batch), whose checkpoint resumes in 2 again: torch.distributed.checkpoint reshards; the losses follow the
    straight run's. (A resumed run keeps a field left at its default, so the accumulation is never 1 here.)"""
    fsdp = ["--strategy", "fsdp", "--batch-size", "16", "--accum_steps", "2"]
    _launch(2, tmp_path / "straight", *fsdp)
    run = tmp_path / "run"
    _launch(2, run, *fsdp, "--stop-after", "1")
    for nproc, accum, stop in ((1, "4", "2"), (2, "2", "3")):
        r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                            str(nproc), "-m", "vitlab", "train", "--resume", str(run), "--strategy", "fsdp",
                            "--accum_steps", accum, "--stop_after", stop], capture_output=True, text=True,
                           env=_env(), timeout=300)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert ck_state(run)["world_size"] == nproc and ck_state(run)["epoch"] == int(stop)
    assert _losses(run) == pytest.approx(_losses(tmp_path / "straight"), rel=1e-5, abs=1e-6)


def ck_state(run: Path) -> dict:
    from vitlab.train import checkpoint as ck

    return ck.load_trainer_state(run / "last")


@pytest.mark.slow  # three two-process launches: about 2 min on 2 cores
def test_two_launchers_rendezvous_train_checkpoint_and_resume(tmp_path):
    """Two torchrun launchers on one machine, as on two nodes (``--nnodes 2``, c10d rendezvous): DDP trains with
    step checkpoints, stops, and both launchers resume it; the losses follow a single launcher's two processes."""
    import socket

    ddp = ["--strategy", "ddp", "--batch-size", "16"]
    _launch(2, tmp_path / "straight", *ddp)

    def two_nodes(*args: str) -> list[subprocess.CompletedProcess]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", "vitlab-test",
               "-m", "vitlab", "train", *args]
        procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
                 for _ in range(2)]
        out = []
        for p in procs:
            so, se = p.communicate(timeout=300)
            out.append(subprocess.CompletedProcess(cmd, p.returncode, so, se))
        for r in out:
            assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        return out

    run = tmp_path / "run"
    two_nodes(*COMMON, *ddp, "--output-dir", str(run), "--save_every_steps", "1", "--keep_last", "2",
              "--stop-after", "2")
    assert ck_state(run)["world_size"] == 2 and ck_state(run)["epoch"] == 2
    assert len(list((run / "checkpoints").iterdir())) <= 3  # the two newest and the best
    two_nodes("--resume", str(run), "--strategy", "ddp", "--quiet")
    assert _losses(run) == pytest.approx(_losses(tmp_path / "straight"), rel=1e-5, abs=1e-6)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["finished"]
