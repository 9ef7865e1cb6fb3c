"""Every registered model exports to ONNX (validated with ONNX Runtime) and to an ExportedProgram (validated through
torch.export.load) with a dynamic batch: each family's smallest config, built small (its smoke_kwargs, 10 classes),
in the default suite; every model at its default size under ``-m slow``."""

from __future__ import annotations

import os

import onnx
import pytest

import vitlab
import vitlab.export as ex

SMALLEST = ex.smallest_per_family()
# exporting is slow (6-30 s a family on the 2-core CI): the default suite keeps the two cheapest model classes
# (ViT, which DeiT shares, and HaLViT); the other families' smallest configs run under -m slow
QUICK = {"vit", "halvit"}
FAMILY_CASES = [pytest.param(n, marks=() if vitlab.get_model_config(n).family in QUICK else pytest.mark.slow)
                for n in SMALLEST]


def _check(report: ex.ExportReport, batch_dynamic: bool = True) -> None:
    assert report.ok, "\n".join(report.lines())
    assert any(k.startswith("real photos") for k in report.diffs)
    if batch_dynamic:  # validated at other batch sizes than the traced one
        assert {k.split()[1].split("x")[0] for k in report.diffs if k.startswith("random")} >= {"1", "2", "3"}


@pytest.mark.parametrize("name", FAMILY_CASES)
def test_family_smallest_exports(name, tmp_path):
    kw = {**vitlab.get_model_config(name).smoke_kwargs, "num_classes": 10}
    r = ex.onnx(name, tmp_path / "m.onnx", **kw)
    _check(r)
    assert r.exporter.startswith("dynamo"), r.notes  # no family needs the fall-back
    m = onnx.load(str(tmp_path / "m.onnx"))
    assert m.graph.input[0].type.tensor_type.shape.dim[0].dim_param  # symbolic batch
    assert ex.read_onnx_meta(tmp_path / "m.onnx").model == name
    _check(ex.exported_program(name, tmp_path / "m.pt2", **kw))


@pytest.mark.slow
@pytest.mark.parametrize("name", vitlab.list_models())
def test_every_model_exports_at_default_size(name, tmp_path):
    # eager weights, the traced program, the ONNX protobuf and the ONNX Runtime session each hold a copy
    need = 5 * vitlab.profile_model(name).weights_mb * 2**20
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if need > ram:
        pytest.skip(f"{name} needs ~{need / 2**30:.0f} GiB to export and validate; this machine has {ram / 2**30:.0f}")
    _check(ex.onnx(name, tmp_path / "m.onnx"))
    _check(ex.exported_program(name, tmp_path / "m.pt2"))
