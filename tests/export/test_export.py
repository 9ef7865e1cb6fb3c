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
from vitlab.layers import resample_abs_pos_embed

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


def test_weights_over_the_protobuf_limit_go_to_external_data(tmp_path, monkeypatch):
    # ViT-H/14's 2.5 GB of weights, in small: every model counts as one over the 2 GiB limit of a single protobuf
    monkeypatch.setattr("vitlab.export._export._EXTERNAL_DATA_ABOVE", 0)
    r = ex.onnx("vit_pico_patch8_32", tmp_path / "m.onnx", **PICO)
    assert r.ok, r.lines()  # ONNX Runtime loads the weights from m.onnx.data
    data = tmp_path / "m.onnx.data"
    assert data.stat().st_size > (tmp_path / "m.onnx").stat().st_size and r.size_bytes == sum(
        f.stat().st_size for f in tmp_path.iterdir())
    assert ex.read_onnx_meta(tmp_path / "m.onnx").model == "vit_pico_patch8_32"


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
    assert sizes >= {"32x32", "40x48", "56x32", "24x32"}  # the model's size and others, validated
    assert ex.read_onnx_meta(tmp_path / "m.onnx").dynamic_img_size


def test_bicubic_resampling_exports_exactly_for_a_symbolic_size(tmp_path):
    # resample_abs_pos_embed under torch.export: bicubic (antialiased, as ViT's dynamic_img_size) as two matmuls,
    # so the graph has no Resize and ONNX Runtime matches F.interpolate at the default grid and others
    pos = torch.randn(1, 1 + 16 * 16, 8, generator=torch.Generator().manual_seed(0))

    class Resample(nn.Module):  # the input's size is the new grid
        def forward(self, x):
            return resample_abs_pos_embed(pos, x.shape[-2:], (16, 16)) + x.sum()

    r = ex.onnx(Resample(), tmp_path / "m.onnx", meta=ExportMeta(model="resample", img_size=(16, 16), in_chans=1),
                dynamic_batch=False, dynamic_img_size=True, validate=False)  # traced at 20x24, in steps of 4
    assert "Resize" not in {n.op_type for n in onnx.load(str(tmp_path / "m.onnx")).graph.node}
    sess = ex.onnx_session(r.path)
    for hw in [(16, 16), (20, 24), (8, 12), (36, 8)]:  # same grid, up, down (antialiased), mixed
        got = sess.run(None, {"image": torch.zeros(1, 1, *hw).numpy()})[0]
        want = resample_abs_pos_embed(pos, hw, (16, 16))  # eager: F.interpolate(mode="bicubic", antialias=True)
        torch.testing.assert_close(torch.from_numpy(got), want, atol=1e-5, rtol=0, msg=str(hw))


@pytest.mark.slow  # 20 s; the resampling itself through ONNX Runtime: the test above
def test_dynamic_img_size_learned_positions_exact(tmp_path):
    # a learned position embedding of std 1 (not 0.02), so a wrong resampling could not hide in the tolerance
    model = vitlab.create_model("vit_pico_patch8_32", dynamic_img_size=True, **PICO).eval()
    with torch.no_grad():
        model.pos_embed.normal_(generator=torch.Generator().manual_seed(0))
    meta = ExportMeta(model="vit_pico_patch8_32", img_size=(32, 32), in_chans=1, num_classes=10)
    r = ex.onnx(model, tmp_path / "m.onnx", meta=meta, dynamic_img_size=True)
    assert r.ok and r.exporter.startswith("dynamo"), r.lines()
    assert {k.split()[-1] for k in r.diffs} >= {"2x1x32x32", "2x1x40x48", "2x1x56x32", "2x1x24x32"}  # 24: down


@pytest.mark.parametrize("name, kw, words", [
    ("swin_tiny_patch4_window7_224", {}, "dynamic_img_size"),
    ("efficientformer_l1", {}, "has no dynamic image size"),
    ("levit_128s", {}, "has no dynamic image size"),
    ("mobilevit_xxs", {"img_size": 64}, "single 64-pixel step"),  # its last grid would be 1x1: a specialised size
])
def test_dynamic_img_size_refused_with_a_reason(name, kw, words, tmp_path):
    kw = {**vitlab.get_model_config(name).smoke_kwargs, **kw}
    with pytest.raises(ValueError, match=words):
        ex.onnx(name, tmp_path / "m.onnx", dynamic_img_size=True, **kw)
    assert not (tmp_path / "m.onnx").exists()


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
