"""Every registered model exports to ONNX (validated with ONNX Runtime) and to an ExportedProgram (validated through
torch.export.load) with a dynamic batch, and, where its family supports it, with a dynamic image size too (validated
at three sizes or more); the others refuse a dynamic image size with one line naming the model. Each family's
smallest config, built small (its smoke_kwargs), runs in the default suite; every
model at its default size runs under ``-m slow``. A CLIP exports its image tower (encode_image); dense models
(tasks segment, depth) are not exported."""

from __future__ import annotations

import onnx
import pytest

import vitlab
import vitlab.export as ex

EXPORTED = vitlab.list_models(task=("classify", "contrastive"))  # classifiers and CLIP's image tower
SMALLEST = ex.smallest_per_family()
# every family's smallest config in the default suite (2-13 s a family on a 2-core machine)
FAMILY_CASES = SMALLEST
# families with a dynamic image size. ViT, DeiT (distillation token), HaLViT, CaiT and CLIP's ViT image tower
# resample learned positions bicubically in the graph; in PVT, LITv2 and MobileViT the token grid stays symbolic
# through the stages (spatial reduction, HiLo windows, the MobileViT unfold) and PVT resamples its per-stage
# positions bilinearly. Swin, LeViT and EfficientFormer are built for one resolution and refuse.
DYNAMIC = {"vit", "deit", "halvit", "cait", "pvt", "litv2", "mobilevit", "clip"}
SMOKE_DYNAMIC_SIZE = {"mobilevit": 128}  # at its smoke size 64 the last grid is 1x1: refused (test_export.py)


def _kwargs(name: str, smoke: bool) -> dict:
    cfg = vitlab.get_model_config(name)
    if not smoke:
        return {}
    classes = {"num_classes": 10} if cfg.num_classes else {}  # a CLIP has no classifier
    return {**cfg.smoke_kwargs, **classes}


def _fits(name: str, **kw) -> None:
    reason = ex.too_big_to_export(name, **kw)
    if reason:
        pytest.skip(reason)


def _check(report: ex.ExportReport, batch_dynamic: bool = True) -> None:
    assert report.ok, "\n".join(report.lines())
    assert any(k.startswith("real photos") for k in report.diffs)
    if batch_dynamic:  # validated at other batch sizes than the traced one
        assert {k.split()[1].split("x")[0] for k in report.diffs if k.startswith("random")} >= {"1", "2", "3"}


def _sizes(report: ex.ExportReport) -> set[str]:
    return {k.split()[-1].split("x", 2)[2] for k in report.diffs}


@pytest.mark.parametrize("name", FAMILY_CASES)
def test_family_smallest_exports(name, tmp_path):
    kw = _kwargs(name, smoke=True)
    r = ex.onnx(name, tmp_path / "m.onnx", **kw)
    _check(r)
    assert r.exporter.startswith("dynamo"), r.notes  # no family needs the fall-back
    m = onnx.load(str(tmp_path / "m.onnx"))
    assert m.graph.input[0].type.tensor_type.shape.dim[0].dim_param  # symbolic batch
    meta = ex.read_onnx_meta(tmp_path / "m.onnx")
    assert meta.model == name
    if vitlab.get_model_config(name).family == "clip":  # the image tower: embeddings, not class scores
        assert meta.output == "image_embedding" and m.graph.output[0].name == "image_embedding"
        assert "image tower" in r.notes[0]
        with pytest.raises(ValueError, match="image embeddings .* not class scores"):
            ex.predict_onnx(tmp_path / "m.onnx", ["x.png"])
    else:
        assert meta.output == "logits" and m.graph.output[0].name == "logits"
    _check(ex.exported_program(name, tmp_path / "m.pt2", **kw))


@pytest.mark.slow
@pytest.mark.parametrize("name", EXPORTED)
def test_every_model_exports_at_default_size(name, tmp_path):
    _fits(name)
    _check(ex.onnx(name, tmp_path / "m.onnx"))
    _check(ex.exported_program(name, tmp_path / "m.pt2"))


def test_dynamic_families_cover_the_registry():
    families = {vitlab.get_model_config(n).family for n in EXPORTED}
    assert DYNAMIC <= families  # no family named here has left the registry
    assert {vitlab.get_model_config(n).family for n in SMALLEST} == families  # one model of each exported family


def _dynamic(name: str, tmp_path, **kw) -> None:
    r = ex.onnx(name, tmp_path / "m.onnx", dynamic_img_size=True, **kw)
    _check(r)
    assert r.exporter.startswith("dynamo"), r.notes
    assert len(_sizes(r)) >= 3  # three image sizes or more validated
    dims = onnx.load(str(tmp_path / "m.onnx")).graph.input[0].type.tensor_type.shape.dim
    assert all(d.dim_param for d in (dims[0], dims[2], dims[3]))  # batch, height, width symbolic
    assert ex.read_onnx_meta(tmp_path / "m.onnx").dynamic_img_size
    r = ex.exported_program(name, tmp_path / "m.pt2", dynamic_img_size=True, **kw)
    _check(r)
    assert len(_sizes(r)) >= 3


@pytest.mark.slow  # 10-90 s each on the 2-core CI
@pytest.mark.parametrize("name", [n for n in SMALLEST if vitlab.get_model_config(n).family in DYNAMIC])
def test_dynamic_img_size_every_family(name, tmp_path):
    family = vitlab.get_model_config(name).family
    kw = _kwargs(name, smoke=True)
    if family in SMOKE_DYNAMIC_SIZE:
        kw["img_size"] = SMOKE_DYNAMIC_SIZE[family]
    _dynamic(name, tmp_path, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("name", EXPORTED)
def test_every_model_dynamic_img_size_at_default_size(name, tmp_path):
    if vitlab.get_model_config(name).family not in DYNAMIC:  # refused before anything is traced or written
        with pytest.raises(ValueError, match=f"^{name}.*(dynamic image size|dynamic_img_size)") as e:
            ex.onnx(name, tmp_path / "m.onnx", dynamic_img_size=True)
        assert "\n" not in str(e.value) and not (tmp_path / "m.onnx").exists()
        return
    _fits(name)
    _dynamic(name, tmp_path)
