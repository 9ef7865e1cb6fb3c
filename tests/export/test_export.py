"""vitlab.export's behaviour beyond the registry sweep: the TorchScript-exporter fall-back, validation that fails
when a file disagrees with eager, dynamic image size (exact or refused), exports of a trained run with its
metadata (int8 and ONNX Runtime prediction: test_cli_export.py)."""

from __future__ import annotations

import onnx
import pytest
import torch
import torch.nn as nn

import vitlab
import vitlab.export as ex
from vitlab.export import ExportMeta

PICO = dict(depth=1, num_classes=10)


def test_fallback_to_torchscript_exporter_is_stated(tmp_path, monkeypatch):
    real = torch.onnx.export

    def dynamo_broken(*args, dynamo=True, **kw):
        if dynamo:
            raise RuntimeError("simulated dynamo failure")
        return real(*args, dynamo=False, **kw)

    monkeypatch.setattr(torch.onnx, "export", dynamo_broken)
    r = ex.onnx("vit_pico_patch8_32", tmp_path / "m.onnx", **PICO)
    assert r.ok, r.lines()
    assert "fall-back" in r.exporter and "simulated dynamo failure" in r.notes[0]
    assert any("fell back" in line for line in r.lines())
    dim0 = onnx.load(str(tmp_path / "m.onnx")).graph.input[0].type.tensor_type.shape.dim[0]
    assert dim0.dim_param == "batch"


class BakedBatch(nn.Module):
    """Right at the traced batch only: ``int(...)`` turns the batch size into a trace constant."""

    num_classes = 4

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3 * 8 * 8, 4)

    def forward(self, x):
        return self.fc(x.flatten(1)) * int(x.shape[0])


def test_validation_fails_when_the_file_disagrees_with_eager(tmp_path):
    r = ex.torchscript(BakedBatch(), tmp_path / "m.pt", img_size=8)
    assert r.diffs["random 2x3x8x8"] == 0.0  # exact at the traced batch...
    assert r.diffs["random 3x3x8x8"] > 1e-4 and not r.ok  # ...and caught at another one
    assert r.lines()[-1].startswith("validation FAILED")


@pytest.mark.slow  # 12 s
def test_dynamic_img_size_exact_where_the_model_computes_it(tmp_path):
    # sin-cos positions are computed for the grid at hand: exact at every size
    r = ex.onnx("vit_pico_patch8_32", tmp_path / "m.onnx", dynamic_img_size=True, pos_embed="sincos", **PICO)
    assert r.ok, r.lines()
    sizes = {"x".join(k.split()[-1].split("x")[2:]) for k in r.diffs}
    assert sizes >= {"32x32", "40x48", "56x32"}  # the model's size and others, validated
    assert ex.read_onnx_meta(tmp_path / "m.onnx").dynamic_img_size


@pytest.mark.parametrize("name, words", [("vit_pico_patch8_32", "bicubic"), ("cait_xxs24_224", "bicubic"),
                                         ("swin_tiny_patch4_window7_224", "dynamic_img_size"),
                                         ("levit_128s", "has no dynamic image size")])
def test_dynamic_img_size_refused_with_a_reason(name, words, tmp_path):
    with pytest.raises(ValueError, match=words):
        ex.onnx(name, tmp_path / "m.onnx", dynamic_img_size=True, **vitlab.get_model_config(name).smoke_kwargs)
    assert not (tmp_path / "m.onnx").exists()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pvt_tiny", "litv2_s"])
def test_dynamic_img_size_with_a_baked_grid_fails_validation(name, tmp_path):
    # these forwards turn the token grid into Python ints (reshape to (B, C, h, w)), so the traced graph keeps the
    # traced size: validation at other sizes must reject the file instead of passing it as dynamic
    kw = {**vitlab.get_model_config(name).smoke_kwargs, "num_classes": 10}
    r = ex.onnx(name, tmp_path / "m.onnx", dynamic_img_size=True, **kw)
    assert not r.ok and any("fails on random 2x" in n for n in r.notes), r.lines()


def test_trained_run_at_another_size_carries_its_metadata(digits_run, tmp_path):
    r = ex.exported_program(digits_run, tmp_path / "m.pt2", img_size=(24, 32))  # pos embed resampled, eager
    assert r.ok, r.lines()
    module, meta = ex.load_exported(tmp_path / "m.pt2")
    assert meta.img_size == (24, 32) and meta.class_names == [str(i) for i in range(10)]
    assert meta.mean == r.meta.mean and meta.num_classes == 10
    assert module(torch.randn(5, meta.in_chans, 24, 32)).shape == (5, 10)


def test_meta_roundtrip_and_nn_module_needs_a_size(tmp_path):
    meta = ExportMeta(model="x", img_size=(24, 32), class_names=["a", "b"], num_classes=2)
    assert ExportMeta.from_json(meta.to_json()) == meta
    assert meta.transform()(torch.zeros(3, 50, 60, dtype=torch.uint8)).shape == (3, 24, 32)
    with pytest.raises(ValueError, match="img_size"):
        ex.exported_program(nn.Linear(2, 2), tmp_path / "m.pt2")
