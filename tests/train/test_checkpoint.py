"""Checkpoints: tied weights written once and tied again on resume; a run directory copied without its links
(``shutil.copytree(symlinks=False)``) resumes; a run that cannot resume says why in one line; a save killed at any
point leaves the run's record naming a complete checkpoint."""

from __future__ import annotations

import json
import os
import shutil
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from torch.utils.data import TensorDataset

from tests.train.conftest import tiny_config
from vitlab.cli import main
from vitlab.convert import CheckpointError
from vitlab.registry import create_model
from vitlab.train import Callback, Task, TrainConfig, fit, register_task
from vitlab.train import checkpoint as ck
from vitlab.train.task import RunRecord

VOCAB, DIM = 16, 8


class TiedLM(nn.Module):
    """A small language model whose output head is the token embedding (tied, as in BERT, BLIP's text decoder and
    Llama variants with ``tie_word_embeddings``)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mix = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(ids))))


class TiedLMTask(Task):
    """Next-token prediction on 64 fixed random sequences of 6 tokens (4 steps an epoch at batch 16)."""

    monitor, monitor_mode = "loss", "min"

    def build(self, cfg, device):
        ids = torch.randint(0, VOCAB, (64, 6), generator=torch.Generator().manual_seed(0))
        self.data = SimpleNamespace(train=TensorDataset(ids), val=TensorDataset(ids[:16]))
        self.model = self.module = TiedLM().to(device)

    def training_step(self, batch, forward):
        (ids,) = batch
        return F.cross_entropy(forward(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()), {}

    def validation_step(self, batch, forward):
        loss, _ = self.training_step(batch, forward)
        n = batch[0].shape[0]
        return {"loss": loss.double() * n, "n": torch.tensor(float(n), dtype=torch.float64)}

    def validation_metrics(self, sums):
        return {"loss": (sums["loss"] / sums["n"]).item()}

    def record(self):
        return RunRecord(task=self.name, model="tied_lm")


@pytest.fixture
def tied_task():
    from vitlab.train.task import TASKS

    register_task("tied_lm")(TiedLMTask)
    yield
    TASKS.pop("tied_lm")


def _tied_config(out, **kw) -> TrainConfig:
    return TrainConfig.for_task("tied_lm", model="tied_lm", epochs=2, batch_size=16, lr=1e-2, warmup_epochs=0,
                                ema_decay=0.5, quiet=True, output_dir=str(out / "run"), **kw)


def _file_keys(path) -> set[str]:
    with safe_open(str(path), framework="pt") as f:
        return set(f.keys())


def _tied(m: TiedLM) -> bool:
    return m.head.weight is m.embed.weight


# ---------------------------------------------------------------- tied weights


def test_a_tied_head_trains_saves_and_resumes_tied(tmp_path, tied_task):
    """Trained one epoch, saved, resumed: the model the resumed run trains is tied, holds the saved values, and
    ends where the straight run ends; every file of the run (weights, EMA, best) loads, tie included."""
    fit(_tied_config(tmp_path / "a"))
    fit(_tied_config(tmp_path / "b", stop_after=1))
    b = tmp_path / "b" / "run"
    saved, _ = ck.load_weights(b / "last", weights="raw")
    assert saved["head.weight"] is saved["embed.weight"]
    seen = {}

    class Check(Callback):
        def on_fit_start(self, trainer):
            m = trainer.task.model
            seen["tied"] = _tied(m)
            seen["equal"] = all(torch.equal(v, saved[k]) for k, v in m.state_dict().items())
            seen["ema tied"] = _tied(trainer.ema.module)

    fit(_tied_config(tmp_path / "b", resume=str(b)), callbacks=[Check()])
    assert seen == {"tied": True, "equal": True, "ema tied": True}
    for name in ("raw", "ema"):
        wa, _ = ck.load_weights(tmp_path / "a" / "run" / "last", weights=name)
        wb, _ = ck.load_weights(b / "last", weights=name)
        assert wa.keys() == wb.keys() == set(TiedLM().state_dict())
        assert all(torch.equal(wa[k], wb[k]) for k in wa), name
    best = b / "best" / ck.WEIGHTS
    assert _file_keys(best) == {"embed.weight", "mix.weight", "mix.bias"}  # the tied matrix once
    sd, meta = ck.load_weights(best)
    model = TiedLM()
    model.load_state_dict(sd)
    assert _tied(model) and torch.equal(model.head.weight, sd["embed.weight"]) and meta["model"] == "tied_lm"
    from safetensors.torch import load_model

    other = TiedLM()
    load_model(other, str(best))  # safetensors' own reader of shared tensors reads it as well
    assert _tied(other) and torch.equal(other.embed.weight, model.embed.weight)


@pytest.mark.parametrize("name, kwargs, head, embedding", [
    ("blip_tiny_caption", {}, "lm_head.decoder.weight", "text_decoder.word_embeddings.weight"),
    ("llama_tiny", {"tie_word_embeddings": True}, "lm_head.weight", "embed_tokens.weight"),
])
def test_registered_models_with_tied_heads_round_trip(tmp_path, name, kwargs, head, embedding):
    torch.manual_seed(0)
    model = create_model(name, **kwargs)
    ck.save_checkpoint(tmp_path, "epoch-0001", model.state_dict(), {"epoch": 1}, {"model": name, "epoch": 1})
    assert head not in _file_keys(tmp_path / "last" / ck.WEIGHTS)
    sd, _ = ck.load_weights(tmp_path)
    fresh = create_model(name, **kwargs)
    fresh.load_state_dict(sd)
    assert fresh.get_parameter(head) is fresh.get_parameter(embedding)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in fresh.state_dict().items())


def test_views_that_overlap_in_part_are_written_as_copies(tmp_path):
    """A tensor that shares only part of another's memory (a slice) cannot be an alias: it gets its own copy."""
    w = torch.arange(12.0).reshape(3, 4)
    sd = {"w": w, "same": w, "rows": w[:2], "col": w[:, 1]}
    tensors, tied = ck.untie(sd)
    assert tied == {"same": "w"} and set(tensors) == {"w", "rows", "col"}
    assert tensors["rows"].untyped_storage().data_ptr() != w.untyped_storage().data_ptr()
    ck.save_checkpoint(tmp_path, "epoch-0001", sd, {"epoch": 1}, {"model": "m", "epoch": 1})
    back, _ = ck.load_weights(tmp_path)
    assert back.keys() == sd.keys() and all(torch.equal(back[k], v) for k, v in sd.items())


def test_a_tied_name_whose_tensor_is_missing_is_one_line(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "model.safetensors"
    save_file({"a": torch.zeros(2)}, str(path), metadata={"vitlab": json.dumps({"model": "m"}),
                                                          "tied": json.dumps({"b": "c"})})
    with pytest.raises(CheckpointError, match=r"records tied weights of \['c'\], which it does not hold"):
        ck.load_weights(path)


# ---------------------------------------------------------------- copied and broken run directories


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """A run stopped after its first of two epochs (3 steps an epoch, a checkpoint every 2 steps, 2 kept), and
    the same run trained straight through: (stopped run dir, straight run dir)."""
    out = tmp_path_factory.mktemp("stopped")
    fit(tiny_config(out / "a", epochs=2, save_every_steps=2, keep_last=2))
    fit(tiny_config(out / "b", epochs=2, save_every_steps=2, keep_last=2, stop_after=1))
    return out / "b" / "run", out / "a" / "run"


@pytest.mark.parametrize("record", [True, False], ids=["with-record", "links-only"])
def test_a_copied_run_without_links_resumes(stopped_run, tmp_path, capsys, record):
    """Links copied as directories (and, as a run saved before the record existed, no record): the copy resumes
    from its newest checkpoint, ends with the straight run's weights, and has its links back."""
    run, straight = stopped_run
    copy = shutil.copytree(run, tmp_path / "copy", symlinks=False)
    assert not (copy / "last").is_symlink() and (copy / "last").is_dir()
    if not record:
        (copy / ck.RECORD).unlink()
    assert ck.resume_checkpoint(copy) == copy / "checkpoints" / "epoch-0001"
    assert main(["train", "--resume", str(copy), "--quiet"]) == 0, capsys.readouterr().err
    assert os.readlink(copy / "last") == "checkpoints/epoch-0002"
    assert json.loads((copy / ck.RECORD).read_text())["last"] == "epoch-0002"
    wa, _ = ck.load_weights(straight / "last", weights="raw")
    wb, _ = ck.load_weights(copy / "last", weights="raw")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not [p for p in copy.iterdir() if p.name.startswith(".")]  # no directory moved aside is left


def _broken_missing_dir(copy):
    shutil.rmtree(copy / "checkpoints")


def _broken_missing_trainer(copy):
    for d in (copy / "checkpoints").iterdir():
        (d / ck.TRAINER).unlink()
    for ln in ("last", "best"):
        (copy / ln).unlink()


def _broken_description(copy):
    (copy / "last" / ck.META).write_text('{"model": ')


@pytest.mark.parametrize("damage, words", [
    (_broken_missing_dir, "has no complete checkpoint to resume from (no checkpoints/ directory)"),
    (_broken_missing_trainer, "lacks trainer.pt"),
    (_broken_description, "meta.json: it is not valid JSON (truncated or corrupt)"),
])
def test_a_run_that_cannot_resume_says_why_in_one_line(stopped_run, tmp_path, capsys, damage, words):
    run, _ = stopped_run
    copy = shutil.copytree(run, tmp_path / "copy", symlinks=True)
    damage(copy)
    before = sorted(p.name for p in copy.rglob("*"))
    capsys.readouterr()
    assert main(["train", "--resume", str(copy)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("vitlab: error: ") and str(copy) in err and words in err, err
    assert sorted(p.name for p in copy.rglob("*")) == before  # nothing written


# ---------------------------------------------------------------- atomic saves


def _save(run, name, step, links=("last",), keep_last=1):
    return ck.save_checkpoint(run, name, {"w": torch.full((2,), float(step))}, {"step": step},
                              {"model": "m", "step": step, "epoch": 0}, links=links, keep_last=keep_last)


def _last_step(run) -> int:
    return ck.load_trainer_state(ck.resume_checkpoint(run))["step"]


def test_a_save_killed_before_its_record_leaves_the_previous_one(tmp_path, monkeypatch):
    """The directory is in place but the record was not rewritten: the previous checkpoint is the last; the next
    save of that name replaces the orphan."""
    run = tmp_path / "run"
    _save(run, "step-1", 1, links=("last", "best"))
    real = ck.atomic_write

    def dies(path, data):
        if path.name == ck.RECORD:
            raise KeyboardInterrupt
        return real(path, data)

    monkeypatch.setattr(ck, "atomic_write", dies)
    with pytest.raises(KeyboardInterrupt):
        _save(run, "step-2", 2)
    monkeypatch.undo()
    assert (run / "checkpoints" / "step-2").is_dir() and _last_step(run) == 1
    assert os.readlink(run / "last") == "checkpoints/step-1"
    _save(run, "step-2", 2)
    assert _last_step(run) == 2 and os.readlink(run / "best") == "checkpoints/step-1"


def test_a_save_killed_before_its_links_resumes_from_the_record(tmp_path, monkeypatch):
    run = tmp_path / "run"
    _save(run, "step-1", 1)
    monkeypatch.setattr(ck, "_point", lambda link, target: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        _save(run, "step-2", 2)
    monkeypatch.undo()
    assert os.readlink(run / "last") == "checkpoints/step-1" and _last_step(run) == 2
    _save(run, "step-3", 3)
    assert os.readlink(run / "last") == "checkpoints/step-3"


def test_a_recorded_checkpoint_is_never_replaced_in_place(tmp_path, monkeypatch):
    """Saving a name the record holds writes beside it: until the new record, the old one stays whole."""
    run = tmp_path / "run"
    _save(run, "epoch-0001", 1)
    monkeypatch.setattr(ck, "atomic_write", lambda path, data: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        _save(run, "epoch-0001", 2)
    monkeypatch.undo()
    assert _last_step(run) == 1
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["epoch-0001", "epoch-0001.2"]
    assert _save(run, "epoch-0001", 3).name == "epoch-0001.2"  # the orphan beside it is replaced
    assert _last_step(run) == 3 and sorted(p.name for p in (run / "checkpoints").iterdir()) == ["epoch-0001.2"]


def test_keep_last_keeps_the_newest_by_step_not_by_file_time(tmp_path):
    """A copy (cp -r) gives every directory a new time; which checkpoints are newest comes from their steps."""
    run = tmp_path / "run"
    _save(run, "step-1", 1, keep_last=2)
    _save(run, "step-2", 2, keep_last=2)
    future = (run / "checkpoints" / "step-1" / ck.META).stat().st_mtime + 3600
    os.utime(run / "checkpoints" / "step-1" / ck.META, (future, future))
    _save(run, "step-3", 3, keep_last=2)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-2", "step-3"]
