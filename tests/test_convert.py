"""Checkpoint loading: our files, timm's format, containers, clear errors, safe unpickling, the hub path."""

from __future__ import annotations

import json
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
    half = tmp_path / "half.pth"  # a torch.save file cut short: its reader's words
    torch.save({"w": torch.zeros(64, 64)}, half)
    half.write_bytes(half.read_bytes()[:2000])
    with pytest.raises(CheckpointError, match="half.pth: the file is truncated or corrupt"):
        read_state_dict(half)


@pytest.mark.parametrize("name, data", [("coco.json", b'{"images": []}'), ("im.png", b"\x89PNG\r\n\x1a\n"),
                                        ("empty.pth", b"")])
def test_a_file_that_is_no_weights_file_is_named_so(tmp_path, name, data):
    """Not a torch.save file at all (a data file passed by mistake): said so, not read as foreign pickled objects."""
    (tmp_path / name).write_bytes(data)
    with pytest.raises(CheckpointError, match=rf"{name} is not a weights file: expected a .safetensors file or a "
                                              rf"torch.save file of tensors \(.pth, .pt, .bin\)$"):
        read_state_dict(tmp_path / name)


def test_pretrained_offline_says_how_to_load_locally(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CheckpointError, match="checkpoint_path"):
        vitlab.create_model(NAME, pretrained=True)
    with pytest.raises(CheckpointError, match="no published weights"):
        vitlab.create_model("halvit_tiny_patch16_224", pretrained=True)


# Hugging Face save_pretrained directories: config.json and (sharded) weights


def _hf_dir(tmp_path, sharded: bool):
    import json

    tensors = {"a.weight": torch.randn(3, 4), "b.weight": torch.randn(5), "c.bias": torch.randn(2)}
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    if not sharded:
        save_file(tensors, str(tmp_path / "model.safetensors"))
        return tensors
    save_file({k: tensors[k] for k in ("a.weight",)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({k: tensors[k] for k in ("b.weight", "c.bias")}, str(tmp_path / "model-00002-of-00002.safetensors"))
    index = {"metadata": {}, "weight_map": {"a.weight": "model-00001-of-00002.safetensors",
                                            "b.weight": "model-00002-of-00002.safetensors",
                                            "c.bias": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    return tensors


@pytest.mark.parametrize("sharded", [False, True])
def test_read_hf_state_dict(tmp_path, sharded):
    from vitlab.convert import read_hf_state_dict

    tensors = _hf_dir(tmp_path, sharded)
    sd = read_hf_state_dict(tmp_path)
    assert sd.keys() == tensors.keys()
    for k, v in tensors.items():
        torch.testing.assert_close(sd[k], v)


def test_read_hf_config_refuses_another_architecture(tmp_path):
    from vitlab.convert import read_hf_config

    _hf_dir(tmp_path, False)
    llama = ("LlamaForCausalLM", "llama")
    assert read_hf_config(tmp_path, llama)["model_type"] == "llama"
    assert read_hf_config(tmp_path / "config.json", llama)["architectures"] == ["LlamaForCausalLM"]
    with pytest.raises(ValueError, match=r"describes LlamaForCausalLM, llama, not CLIPModel / clip$") as e:
        read_hf_config(tmp_path, ("CLIPModel", "clip"))
    assert "\n" not in str(e.value)
    # transformers builds the class of model_type: a BERT config keeping a Llama class name is still a BERT
    cfg = json.loads((tmp_path / "config.json").read_text())
    for edit in ({"model_type": "bert"}, {"architectures": ["BertModel"]}, {"model_type": None, "architectures": []}):
        (tmp_path / "config.json").write_text(json.dumps({**cfg, **edit}))
        with pytest.raises(ValueError, match=r"describes .*not LlamaForCausalLM / llama$"):
            read_hf_config(tmp_path, llama)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        read_hf_config(tmp_path / "nothing_here")


def test_hf_missing_or_truncated_shard_is_named(tmp_path):
    from vitlab.convert import read_hf_state_dict

    _hf_dir(tmp_path, True)
    shard = tmp_path / "model-00002-of-00002.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors: the file is truncated") as e:
        read_hf_state_dict(tmp_path)
    assert "\n" not in str(e.value)
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=r"shard .*model-00002-of-00002.safetensors named in "
                                                r"model.safetensors.index.json is missing"):
        read_hf_state_dict(tmp_path)


def test_hf_index_leaving_a_shard_out_is_refused(tmp_path):
    """An index whose weight_map no longer names one of the shards its file names count ("-of-00002"): the
    tensors of that shard would be missing, found here in one line rather than later as an absent key."""
    from vitlab.convert import read_hf_state_dict

    _hf_dir(tmp_path, True)
    index = tmp_path / "model.safetensors.index.json"
    cfg = json.loads(index.read_text())
    cfg["weight_map"] = {k: v for k, v in cfg["weight_map"].items() if v != "model-00002-of-00002.safetensors"}
    index.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"model.safetensors.index.json is incomplete: its shard names count 2 "
                                              r"shards, but it puts no tensor in model-00002-of-00002.safetensors$"):
        read_hf_state_dict(tmp_path)


def test_config_differences_name_each_differing_field_once():
    """The checks of config.json against a model (Llama, LLaVA, BLIP, CLIP) share one rule: values shown as repr,
    floats equal within a relative 1e-6 (a JSON round trip), a caller's own verdict where it gives one."""
    from vitlab.convert import config_differences

    pairs = {"dim": (64, 32), "heads": (4, 4), "eps": (1e-5, 1e-5 * (1 + 1e-9)), "theta": (5000.0, 10000.0),
             "act": ("gelu", "quick_gelu"), "layer": (2, -2, True), "ids": ([1], [1], False)}
    assert config_differences(pairs, "text_config.") == [
        "text_config.dim 64 (this model 32)", "text_config.theta 5000.0 (this model 10000.0)",
        "text_config.act 'gelu' (this model 'quick_gelu')", "text_config.ids [1] (this model [1])"]
    assert config_differences({"eps": (1e-6, 1e-5)}) == ["eps 1e-06 (this model 1e-05)"]
    assert config_differences({"eps": (1e-5, "1e-05")}) == ["eps 1e-05 (this model '1e-05')"]
    assert config_differences({}) == []
