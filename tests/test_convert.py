"""Checkpoint loading: our files, timm's format, containers, clear errors, safe unpickling, the hub path."""

from __future__ import annotations

import pickle

import pytest
import torch
from safetensors.torch import save_file

import vitlab
from vitlab.convert import CheckpointError, read_state_dict

NAME = "vit_tiny_patch16_224"


def _model(**kw):
    return vitlab.create_model(NAME, img_size=32, depth=2, **kw).eval()


def _same(a, b):
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(a(x), b(x))


@pytest.mark.parametrize("suffix", [".safetensors", ".pth", ".bin"])
def test_round_trip_own_checkpoint(tmp_path, suffix):
    src = _model()
    path = tmp_path / f"w{suffix}"
    if suffix == ".safetensors":
        save_file(src.state_dict(), str(path))
    else:
        torch.save(src.state_dict(), path)
    _same(src, vitlab.create_model(NAME, img_size=32, depth=2, checkpoint_path=str(path)).eval())


def test_containers_and_prefixes(tmp_path):
    src = _model()
    wrapped = {"model": {f"module.{k}": v for k, v in src.state_dict().items()}, "epoch": 3}
    path = tmp_path / "ckpt.pth"
    torch.save(wrapped, path)
    _same(src, vitlab.create_model(NAME, img_size=32, depth=2, checkpoint_path=str(path)).eval())


def test_missing_and_unexpected_keys_are_named(tmp_path):
    sd = _model().state_dict()
    sd.pop("blocks.1.mlp.fc2.weight")
    sd["extra.thing"] = torch.zeros(1)
    path = tmp_path / "bad.pth"
    torch.save(sd, path)
    with pytest.raises(CheckpointError, match=r"missing keys \['blocks.1.mlp.fc2.weight'\].*unexpected keys "
                                              r"\['extra.thing'\]"):
        vitlab.create_model(NAME, img_size=32, depth=2, checkpoint_path=str(path))
    vitlab.create_model(NAME, img_size=32, depth=2, checkpoint_path=str(path), strict=False)


def test_classifier_of_another_size_is_dropped_with_warning(tmp_path):
    src = _model()
    path = tmp_path / "w.pth"
    torch.save(src.state_dict(), path)
    with pytest.warns(UserWarning, match="1000 classes, the model 10"):
        m = vitlab.create_model(NAME, img_size=32, depth=2, num_classes=10, checkpoint_path=str(path))
    torch.testing.assert_close(m.blocks[0].attn.qkv.weight, src.blocks[0].attn.qkv.weight)


class _Evil:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_pickled_code_is_refused(tmp_path):
    path = tmp_path / "evil.pth"
    with open(path, "wb") as f:
        pickle.dump({"w": _Evil()}, f)
    with pytest.raises(CheckpointError, match="cannot read checkpoint"):
        read_state_dict(path)


def test_missing_and_corrupt_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="checkpoint not found"):
        read_state_dict(tmp_path / "nope.pth")
    bad = tmp_path / "corrupt.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="cannot read checkpoint"):
        read_state_dict(bad)


def test_pretrained_offline_says_how_to_load_locally(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CheckpointError, match="checkpoint_path"):
        vitlab.create_model(NAME, pretrained=True)
    with pytest.raises(CheckpointError, match="no published weights"):
        vitlab.create_model("halvit_tiny_patch16_224", pretrained=True)
