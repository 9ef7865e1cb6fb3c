"""Step checkpoints and mid-epoch resume: a run stopped (Ctrl-C or ``kill -9``) between two epoch ends and resumed
ends with the straight run's weights exactly (CPU, no loader workers); keep-last retention; time-based saves;
streams (``IterableDataset``) without a sampler, resumed from their own position."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.utils.data import IterableDataset

from tests.train.conftest import tiny_config
from vitlab.classify.tasks import ClassificationTask
from vitlab.train import Callback, Trainer, fit, read_metrics, register_task
from vitlab.train import checkpoint as ck
from vitlab.train.strategy import make_loader
from vitlab.train.trainer import TIME_KEYS

ROOT = Path(__file__).resolve().parents[2]


class StopAt(Callback):
    """Interrupts the run (as Ctrl-C does) right after optimiser step ``step``."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, trainer, step, scalars):
        if step == self.step:
            raise KeyboardInterrupt


def _weights(run: Path, name: str = "model.safetensors") -> dict:
    from safetensors.torch import load_file

    return load_file(str((run / "last").resolve() / name))


def _same_run(a: Path, b: Path) -> None:
    """Runs ``a`` and ``b`` end with equal weights (bit for bit) and equal ``metrics.jsonl`` but for the timings:
    every step and every epoch once, in order, with the same values."""
    for name in ("model.safetensors", "ema.safetensors"):
        wa, wb = _weights(a, name), _weights(b, name)
        assert wa.keys() == wb.keys()
        for k in wa:
            assert torch.equal(wa[k], wb[k]), (name, k)
    la, lb = ([{k: v for k, v in r.items() if k not in TIME_KEYS} for r in read_metrics(run)] for run in (a, b))
    assert la == lb
    epochs, expected, done = read_metrics(b, "epoch"), [], 0
    assert [r["epoch"] for r in epochs] == list(range(1, len(epochs) + 1))
    for e in epochs:  # each step once, in order, and each epoch's line after its last step
        expected += [("step", s) for s in range(done + 1, e["step"] + 1)] + [("epoch", e["step"])]
        done = e["step"]
    assert [(r["kind"], r["step"]) for r in read_metrics(b)] == expected


def test_interrupted_mid_epoch_resumes_exactly(tmp_path, capsys):
    """3 steps per epoch, a checkpoint every 2 steps: stopped at step 5, the run resumes from step 4 (epoch 2, its
    first step done) and ends with the straight run's weights; the lines say where it stopped and resumes."""
    fit(tiny_config(tmp_path / "a", epochs=2))
    b = tmp_path / "b" / "run"
    with pytest.raises(KeyboardInterrupt):
        fit(tiny_config(tmp_path / "b", epochs=2, save_every_steps=2, quiet=False), callbacks=[StopAt(5)])
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == f"interrupted in epoch 2/2; the last checkpoint is step 4 (epoch 2); continue with: vitlab " \
                      f"train --resume {b}"
    assert os.readlink(b / "last") == "checkpoints/step-00000004"
    assert ck.load_trainer_state(b / "last")["epoch_steps"] == 1
    # step 5 was logged before the stop, after epoch 1's line
    assert [(r["kind"], r["step"]) for r in read_metrics(b)] == [("step", 1), ("step", 2), ("step", 3),
                                                                  ("epoch", 3), ("step", 4), ("step", 5)]
    with (b / "metrics.jsonl").open("a") as f:  # and a kill while writing step 6 would leave half a line
        f.write('{"kind": "step", "step": 6, "epoch": 2.0, "lo')
    assert len(read_metrics(b)) == 6
    fit(tiny_config(tmp_path / "b", epochs=2, resume=str(b), quiet=False))
    assert capsys.readouterr().out.splitlines()[0] == f"resuming {b} from step 4 (epoch 2/2, step 1/3 of the epoch)"
    _same_run(tmp_path / "a" / "run", b)


def test_killed_between_the_epoch_line_and_its_checkpoint(tmp_path, monkeypatch):
    """The epoch's line is written before its checkpoint: a run killed between the two resumes from the checkpoint
    before and drops that line (and the epoch's steps), so the resumed run logs each step and each epoch once."""
    save = Trainer.save

    def save_or_die(self, epoch, row, is_best):
        if epoch == 2:
            raise KeyboardInterrupt
        save(self, epoch, row, is_best)

    monkeypatch.setattr(Trainer, "save", save_or_die)
    run = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        fit(tiny_config(tmp_path, epochs=2))
    [_, killed] = read_metrics(run, "epoch")
    monkeypatch.undo()
    fit(tiny_config(tmp_path, epochs=2, resume=str(run)))
    assert [(r["kind"], r["step"]) for r in read_metrics(run)] == [("step", 1), ("step", 2), ("step", 3),
                                                                    ("epoch", 3), ("step", 4), ("step", 5),
                                                                    ("step", 6), ("epoch", 6)]
    resumed = read_metrics(run, "epoch")[1]
    assert {k: v for k, v in resumed.items() if k not in TIME_KEYS} == \
        {k: v for k, v in killed.items() if k not in TIME_KEYS}


def test_keep_last_and_time_based_saves(tmp_path):
    """A save after every step (the minutes elapsed always due), the two newest kept besides the best."""
    fit(tiny_config(tmp_path, epochs=2, save_every_minutes=1e-9, keep_last=2, eval_every=2))
    run = tmp_path / "run"
    kept = sorted(p.name for p in (run / "checkpoints").iterdir())
    # steps 1, 2 (mid-epoch 1), epoch 1 (step 3), steps 4, 5, epoch 2 (step 6; best): the two newest remain
    assert kept == ["epoch-0002", "step-00000005"]
    assert os.readlink(run / "last") == os.readlink(run / "best") == "checkpoints/epoch-0002"


@pytest.mark.slow  # two fresh interpreters: about 15 s on 2 cores
def test_kill_9_mid_epoch_loses_at_most_n_steps_and_resumes_exactly(tmp_path):
    fit(tiny_config(tmp_path / "a", epochs=2))
    b = tmp_path / "b"
    script = textwrap.dedent(f"""
        import os, signal
        from pathlib import Path
        from tests.train.conftest import tiny_config
        from vitlab.train import Callback, fit

        class Kill(Callback):
            def on_step_end(self, trainer, step, scalars):
                if step == 5:
                    os.kill(os.getpid(), signal.SIGKILL)

        fit(tiny_config(Path({str(b)!r}), epochs=2, save_every_steps=2), callbacks=[Kill()])
    """)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}:{ROOT / 'src'}"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert ck.load_trainer_state(b / "run" / "last")["step"] == 4  # killed at step 5: one step lost
    fit(tiny_config(b, epochs=2, resume=str(b / "run")))
    _same_run(tmp_path / "a" / "run", b / "run")


# ---------------------------------------------------------------- streams


class Stream(IterableDataset):
    """A map-style dataset read as a stream: the epoch's order seeded by ``set_epoch``, its position saved and
    restored by ``state_dict`` / ``load_state_dict`` (what the streaming datasets provide)."""

    def __init__(self, data, stateful: bool = True):
        self.data, self.epoch, self.pos = data, 0, 0
        if not stateful:
            self.state_dict = self.load_state_dict = None

    def __len__(self) -> int:
        return len(self.data)

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.pos = epoch, 0

    def __iter__(self):
        order = torch.randperm(len(self.data), generator=torch.Generator().manual_seed(self.epoch)).tolist()
        while self.pos < len(order):
            self.pos += 1
            yield self.data[order[self.pos - 1]]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.pos = state["epoch"], state["pos"]


@pytest.mark.parametrize("stateful", [True, False])
def test_a_stream_resumes_from_its_position(stateful):
    data = list(range(20))
    straight = [b.tolist() for b in make_loader(Stream(data, stateful), 4, drop_last=True, epoch=3)]
    loader = make_loader(Stream(data, stateful), 4, drop_last=True, epoch=3)
    it = iter(loader)
    first = [next(it).tolist() for _ in range(2)]
    state = loader.state_dict() if stateful else None
    rest = make_loader(Stream(data, stateful), 4, drop_last=True, epoch=3, skip=2, state=state)
    assert first + [b.tolist() for b in rest] == straight
    assert type(rest).__name__ == ("StatefulDataLoader" if stateful else "_SkipBatches")


class StreamClassify(ClassificationTask):
    """Classification whose training split is read as a stream."""

    def build(self, cfg, device):
        super().build(cfg, device)
        self.data = replace(self.data, train=Stream(self.data.train))


@pytest.fixture
def stream_task():
    from vitlab.train.task import TASKS

    register_task("classify_stream")(StreamClassify)
    yield
    TASKS.pop("classify_stream")


def test_a_streamed_run_resumes_mid_epoch_exactly(tmp_path, monkeypatch, stream_task):
    import socket

    from tests.train.conftest import TINY_MODEL
    from vitlab.data import DataConfig
    from vitlab.train import TrainConfig

    def cfg(out, **kw):
        data = DataConfig("fake", fake_num_samples=48, fake_num_classes=4, fake_img_size=16)
        return TrainConfig.for_task("classify_stream", model="vit_pico_patch8_32", model_kwargs=dict(TINY_MODEL),
                                    data=data, epochs=2, batch_size=16, lr=5e-3, warmup_epochs=1, quiet=True,
                                    ema_decay=0.9, output_dir=str(out / "run"), strategy="ddp", **kw)

    with socket.socket() as s:  # DDP as a world of one: the stream gets no DistributedSampler
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(k, v)
    fit(cfg(tmp_path / "a"))
    with pytest.raises(KeyboardInterrupt):
        fit(cfg(tmp_path / "b", save_every_steps=2), callbacks=[StopAt(3)])
    b = tmp_path / "b" / "run"
    state = ck.load_trainer_state(b / "last")
    assert state["epoch_steps"] == 2 and state["loader"][0] is not None  # the stream's own position
    fit(cfg(tmp_path / "b", resume=str(b)))
    _same_run(tmp_path / "a" / "run", b)
