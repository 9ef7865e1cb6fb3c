"""Experiment tracking: ``metrics.jsonl`` (a line per step and per epoch) and the cluster figures (MFU, throughput,
data wait, peak memory), the Callback protocol, the tracker registry, and TensorBoard / MLflow / W&B read back with
their own readers: they hold the scalars of ``metrics.jsonl``, step for step."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch

from tests.train.conftest import tiny_config
from vitlab.data import DataConfig
from vitlab.train import Callback, Tracker, fit, read_metrics, register_tracker
from vitlab.train.callbacks import TRACKERS
from vitlab.train.mfu import GPU_PEAK_TFLOPS, Meter, cpu_peak_tflops, gpu_peak_tflops, model_flops

STEP_KEYS = {"loss", "lr", "grad_norm", "img_per_s", "tokens_per_s", "step_time_s", "data_wait", "mfu",
             "peak_rss_gb"}


def _scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    """What the trackers must hold: ``{train/<key>: [(step, value), ...]}`` of the step lines of ``metrics.jsonl``
    and ``{epoch/<key>: ...}`` of its epoch lines (their numbers but the step and the epoch)."""
    out: dict[str, list[tuple[int, float]]] = {}
    for prefix, kind in (("train/", "step"), ("epoch/", "epoch")):
        for row in read_metrics(run, kind):
            for k, v in row.items():
                if k not in ("step", "epoch") and isinstance(v, (int, float)) and not isinstance(v, bool):
                    out.setdefault(prefix + k, []).append((row["step"], v))
    return out


def _tensorboard_holds_metrics_jsonl(run: Path):
    """TensorBoard's event reader finds every scalar of ``metrics.jsonl`` at its step, and no other step or epoch
    scalar; returns the reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    expected = _scalars(run)
    assert {t for t in acc.Tags()["scalars"] if t.startswith(("train/", "epoch/"))} == set(expected)
    for name, points in expected.items():
        events = acc.Scalars(name)
        assert [e.step for e in events] == [s for s, _ in points], name
        assert [e.value for e in events] == pytest.approx([v for _, v in points], rel=1e-6), name  # float32
    return acc


def _digits(tmp_path, **kw):
    return tiny_config(tmp_path, data=DataConfig("digits", img_size=16), epochs=1, batch_size=128, ema_decay=0.0,
                       **kw)


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
    """One digits epoch (9 steps) logged to TensorBoard and MLflow: (run dir, summary)."""
    out = tmp_path_factory.mktemp("logged")
    summary = fit(_digits(out, log=["tensorboard", "mlflow"]))
    return out / "run", summary


def test_metrics_jsonl_steps_and_the_cluster_figures(logged_run):
    run, s = logged_run
    rows = read_metrics(run, "step")
    assert [r["step"] for r in rows] == list(range(1, 10))
    assert all(STEP_KEYS <= set(r) for r in rows)
    assert rows[-1]["epoch"] == pytest.approx(1.0)
    for r in rows:
        assert 0 <= r["data_wait"] <= 1 and r["img_per_s"] > 0 and r["grad_norm"] > 0 and 0 < r["mfu"] < 1
        # the pico ViT at 16px with patch 8: 4 patches and the class token
        assert r["tokens_per_s"] == pytest.approx(5 * r["img_per_s"])
    # the step's lr is the one the optimiser used: the warm-up's first value
    assert rows[0]["lr"] < rows[-1]["lr"]
    [epoch] = read_metrics(run, "epoch")
    assert {"mfu", "data_wait", "step_time_s", "tokens_per_s", "peak_rss_gb", "val_top1"} <= set(epoch)
    assert epoch["epoch"] == 1 and epoch["step"] == 9
    assert [r["kind"] for r in read_metrics(run)] == ["step"] * 9 + ["epoch"]  # one file holds both
    assert not (run / "steps.jsonl").exists()
    assert s["tokens_per_image"] == 5 and s["gmacs_per_image"] > 0 and s["peak_tflops"] > 0
    assert 0 < s["mfu"] < 1 and s["train_img_per_s"] > 0 and s["peak_rss_gb"] > 0.05
    assert "measured CPU GEMM fp32" in s["peak_source"]
    assert json.loads((run / "summary.json").read_text())["mfu"] == s["mfu"]


def test_tensorboard_holds_the_scalars_of_metrics_jsonl(logged_run):
    run, _ = logged_run
    acc = _tensorboard_holds_metrics_jsonl(run)
    assert {"train/loss", "train/grad_norm", "train/mfu", "train/data_wait", "epoch/val_top1"} <= set(_scalars(run))
    assert "curves" in acc.Tags()["images"]
    assert "config/text_summary" in acc.Tags()["tensors"]  # the config as text


def test_mlflow_holds_the_scalars_of_metrics_jsonl_params_and_artifacts(logged_run):
    from mlflow.tracking import MlflowClient

    run, s = logged_run
    saved = json.loads((run / "trackers.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=saved["tracking_uri"])
    r = client.get_run(saved["run_id"])
    expected = _scalars(run)
    assert {k for k in r.data.metrics if k.startswith(("train/", "epoch/"))} == set(expected)
    for name, points in expected.items():
        hist = sorted(client.get_metric_history(saved["run_id"], name), key=lambda m: m.step)
        assert [(m.step, m.value) for m in hist] == points, name
    assert r.info.status == "FINISHED"
    assert r.data.params["lr"] == "0.005" and r.data.params["model_kwargs.depth"] == "1"
    assert r.data.metrics["best/val_top1"] == pytest.approx(s["best_val_top1"])
    names = {a.path for a in client.list_artifacts(saved["run_id"])}
    assert {"config.yaml", "metrics.jsonl", "summary.json", "curves.png", "images",
            "checkpoint"} <= names


def _wandb_records(path: Path) -> list[bytes]:
    """The records of a W&B ``.wandb`` file: a 7-byte header (``:W&B``, magic, version), then LevelDB-log blocks of
    32 KiB holding records split into chunks (CRC, length, kind: full / first / middle / last)."""
    import struct

    data, records, pos, buf = path.read_bytes(), [], 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # the rest of a block is padding
            pos += left
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        buf += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            records.append(buf)
            buf = b""
    return records


def test_wandb_offline_run_holds_the_scalars_of_metrics_jsonl(tmp_path, monkeypatch):
    import wandb
    from wandb.proto import wandb_internal_pb2

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    s = fit(_digits(tmp_path, log=["wandb"]))
    wandb.teardown()  # the service writes the run's file to its end when it stops (as at the process's exit)
    run = tmp_path / "run"
    assert json.loads((run / "trackers.json").read_text())["wandb"]["mode"] == "offline"
    [file] = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    history = []
    for data in _wandb_records(file):
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(data)
        if rec.WhichOneof("record_type") == "history":
            history.append({"/".join(i.nested_key) if i.nested_key else i.key: json.loads(i.value_json)
                            for i in rec.history.item})
    logged: dict[str, list[tuple[int, float]]] = {}
    for h in history:
        for name, value in h.items():
            if name.startswith(("train/", "epoch/")):
                logged.setdefault(name, []).append((h["trainer/step"], value))
    assert logged == _scalars(run)
    [epoch] = [h for h in history if "epoch/val_top1" in h]
    assert epoch["best/val_top1"] == s["best_val_top1"] and epoch["trainer/step"] == 9
    assert list((run / "wandb").glob("offline-run-*/files/media/images/images/curves_9_*.png"))


# ---------------------------------------------------------------- callbacks and the registry


class Recorder(Callback):
    def __init__(self):
        self.events = []

    def on_fit_start(self, trainer):
        self.events.append(("start", trainer.step))

    def on_step_end(self, trainer, step, scalars):
        self.events.append(("step", step, scalars["loss"]))

    def on_eval_end(self, trainer, epoch, metrics, best):
        self.events.append(("eval", epoch, metrics["val_top1"], best["monitor"]))

    def on_image(self, trainer, name, image, step):
        self.events.append(("image", name, Path(image).is_file()))

    def on_fit_end(self, trainer, summary):
        self.events.append(("end", summary is not None))


def test_a_callback_sees_every_event(tmp_path):
    rec = Recorder()
    s = fit(tiny_config(tmp_path, epochs=2), callbacks=[rec])
    kinds = [e[0] for e in rec.events]
    assert kinds == ["start"] + ["step"] * 3 + ["image", "eval"] + ["step"] * 3 + ["image", "eval", "end"]
    steps = read_metrics(tmp_path / "run", "step")
    assert [e[2] for e in rec.events if e[0] == "step"] == [r["loss"] for r in steps]
    assert rec.events[-3] == ("image", "curves", True) and rec.events[-1] == ("end", True)
    assert rec.events[-2][3] == s["best_val_top1"]


class Failing(Tracker):
    extra = "nothing"
    calls = 0

    def on_step_end(self, trainer, step, scalars):
        type(self).calls += 1
        raise ConnectionError("server went away\nsecond line")


def test_a_failing_tracker_warns_once_and_training_goes_on(tmp_path, capsys):
    register_tracker("always_fails")(Failing)
    try:
        s = fit(tiny_config(tmp_path, epochs=1, log=["always_fails"], quiet=False))
    finally:
        TRACKERS.pop("always_fails")
    assert s["finished"] and Failing.calls == 1
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning")]
    assert warnings == ["warning: always_fails logging failed in on_step_end (ConnectionError: server went away); "
                        "training continues without it"]


def test_tracker_errors_are_one_line_before_any_run_dir(tmp_path, monkeypatch, capsys):
    import importlib.util

    from vitlab.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cases = {"mlflow": "needs the mlflow package: pip install 'vitlab[mlflow]'",
             "tensorbord": "unknown tracker 'tensorbord' in --log; did you mean tensorboard?"}
    for log, message in cases.items():
        out = tmp_path / log / "run"
        assert main(["train", "--data", "fake", "--epochs", "1", "--log", log, "--output_dir", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
        assert not (tmp_path / log).exists()
    monkeypatch.undo()
    out = tmp_path / "uri" / "run"
    assert main(["train", "--data", "fake", "--epochs", "1", "--log", "mlflow", "--mlflow_uri",
                 f"http://127.0.0.1:{port}", "--output_dir", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"MLflow tracking URI http://127.0.0.1:{port} is unreachable" in err[0], err
    assert not (tmp_path / "uri").exists()


# ---------------------------------------------------------------- MFU


def test_mfu_figures():
    assert gpu_peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.4
    assert gpu_peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.0
    assert gpu_peak_tflops("NVIDIA A100-SXM4-80GB", "tf32") == 156.0
    assert gpu_peak_tflops("NVIDIA L4", "fp16") == 121.0
    assert gpu_peak_tflops("Tesla V100-SXM2-16GB", "bf16") is None  # no bf16 tensor cores
    assert all({"fp16", "fp32"} <= set(p) for p in GPU_PEAK_TFLOPS.values())
    assert 0 < cpu_peak_tflops("fp32", n=256) < 100
    # 100 images of 1 GFLOP (training) on 2 devices of 1 TFLOP/s in 0.5 s: 200 img/s x 1e9 / 2e12 = 10%
    m = Meter(torch.device("cpu"), 2, 1e9, 10, 1e12)
    step = m.step(50, 0.5, 0.1)
    assert step["img_per_s"] == 200 and step["mfu"] == pytest.approx(0.1) and step["tokens_per_s"] == 2000
    assert step["data_wait"] == pytest.approx(0.2) and step["step_time_s"] == 0.5
    mark = m.mark()
    m.step(50, 1.5, 0.0)
    assert m.totals(since=mark)["img_per_s"] == pytest.approx(100 / 1.5)
    assert m.totals()["step_time_s"] == 1.0


def test_model_flops_match_the_counter():
    import vitlab
    from vitlab.profile import profile_model

    model = vitlab.create_model("vit_pico_patch8_32", num_classes=10)
    flops, tokens = model_flops(model, 1, 32, torch.device("cpu"))  # grey-scale 32px
    assert flops == pytest.approx(2e9 * profile_model(model, activations=False).gmacs, rel=1e-9)
    assert tokens == 17  # 4 x 4 patches and the class token


def test_a_resumed_run_continues_its_tracker_runs(tmp_path):
    """Stopped after step 5 with a checkpoint at step 4, then resumed: the MLflow run is the same one, finished;
    TensorBoard drops the step logged after the checkpoint, so each step and each epoch is there once, with the
    resumed value, as in ``metrics.jsonl``."""
    from mlflow.tracking import MlflowClient

    from tests.train.test_step_checkpoints import StopAt

    run = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        fit(tiny_config(tmp_path, epochs=2, save_every_steps=2, log=["tensorboard", "mlflow"]), callbacks=[StopAt(5)])
    first = json.loads((run / "trackers.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=first["tracking_uri"])
    assert client.get_run(first["run_id"]).info.status == "KILLED"
    fit(tiny_config(tmp_path, epochs=2, resume=str(run)))
    assert json.loads((run / "trackers.json").read_text())["mlflow"] == first
    assert client.get_run(first["run_id"]).info.status == "FINISHED"
    assert [r["step"] for r in read_metrics(run, "step")] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in read_metrics(run, "epoch")] == [3, 6]
    _tensorboard_holds_metrics_jsonl(run)
