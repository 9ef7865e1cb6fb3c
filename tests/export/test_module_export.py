"""Exporting a module from vitlab.create_model: the input size and preprocessing come from the model (its registry
config and its own size), through the one function the name path (``vitlab export NAME``) uses too; a bare
nn.Module without a size of its own still has to be given one."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

import vitlab
import vitlab.export as ex
from vitlab.cli import main


@pytest.mark.parametrize("name, kw", [
    ("deit_tiny_patch16_224", {}),  # crop 0.875 and the model's name, not ExportMeta's 0.9 and its class name
    ("vit_pico_patch8_32", {"in_chans": 3}),  # channels from the model, normalisation from the config
    ("swin_tiny_patch4_window7_224", None),
    ("levit_128s", None),
    ("clip_vit_base_patch16", None),  # the image tower's size, CLIP's normalisation
])
def test_module_and_name_give_the_same_meta(name, kw):
    kw = vitlab.get_model_config(name).smoke_kwargs if kw is None else kw
    model = vitlab.create_model(name, **kw)
    meta = ex.export_meta(model)
    assert meta == ex.load_source(name, **kw)[1]
    cfg = vitlab.get_model_config(name)
    assert (meta.model, meta.crop_pct, meta.mean, meta.std) == (name, cfg.crop_pct, cfg.mean, cfg.std)
    assert meta.img_size == (kw.get("img_size", cfg.input_size[1]),) * 2
    assert meta.in_chans == kw.get("in_chans", cfg.input_size[0])


def test_module_built_at_another_size_or_headless():
    meta = ex.export_meta(vitlab.create_model("deit_tiny_patch16_224", img_size=(32, 48), depth=1, num_classes=0))
    assert meta.img_size == (32, 48) and meta.num_classes == 0 and meta.crop_pct == 0.875
    assert ex.export_meta(vitlab.create_model("vit_pico_patch8_32"), img_size=64).img_size == (64, 64)


def test_onnx_and_exported_program_of_a_created_model_need_no_size(tmp_path):
    model = vitlab.create_model("deit_tiny_patch16_224", img_size=32, depth=1)
    r = ex.onnx(model, tmp_path / "m.onnx")
    assert r.ok, r.lines()
    meta = ex.read_onnx_meta(tmp_path / "m.onnx")
    assert (meta.model, meta.img_size, meta.crop_pct, meta.num_classes) == ("deit_tiny_patch16_224", (32, 32),
                                                                          0.875, 1000)
    r = ex.exported_program(model, tmp_path / "m.pt2", validate=False)
    module, meta_pt2 = ex.load_exported(tmp_path / "m.pt2")
    assert meta_pt2 == meta and module(torch.randn(3, 3, 32, 32)).shape == (3, 1000)


@pytest.mark.parametrize("fmt, suffix", [("onnx", "onnx"), ("exported", "pt2")])
def test_cli_and_python_embed_the_same_preprocessing(fmt, suffix, tmp_path, capsys):
    cli, py = tmp_path / f"cli.{suffix}", tmp_path / f"py.{suffix}"
    assert main(["export", "vit_pico_patch8_32", "--format", fmt, "--out", str(cli), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"]
    write = ex.onnx if fmt == "onnx" else ex.exported_program
    assert write(vitlab.create_model("vit_pico_patch8_32"), py, validate=False).path == str(py)
    read = ex.read_onnx_meta if fmt == "onnx" else (lambda p: ex.load_exported(p)[1])
    assert read(cli) == read(py)


class Sized(nn.Module):
    """A bare module that knows its input size (``img_size``), as vitlab's families do."""

    img_size = (8, 8)
    num_classes = 4

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3 * 8 * 8, 4)

    def forward(self, x):
        return self.fc(x.flatten(1))


def test_bare_module_uses_its_own_size_or_needs_one(tmp_path):
    r = ex.exported_program(Sized(), tmp_path / "m.pt2")
    assert r.ok and r.meta.img_size == (8, 8) and r.meta.model == "Sized" and r.meta.num_classes == 4
    with pytest.raises(ValueError, match=r"exporting a Linear \(no registry config, no img_size of its own\) needs "
                                         r"img_size=\(H, W\)"):
        ex.export_meta(nn.Linear(2, 2))
    assert ex.export_meta(nn.Linear(2, 2), img_size=(4, 6)).img_size == (4, 6)
