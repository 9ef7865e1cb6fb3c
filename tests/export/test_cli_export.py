"""``vitlab export`` and ``vitlab predict --onnx``: files written and validated, int8 with the accuracy change, one
line and exit 2 on bad input or without the export extra; a CLIP run exports its image tower."""

from __future__ import annotations

import json
import sys

import numpy as np
import onnx
import pytest
import skimage.data
import torch
from PIL import Image

import vitlab.export as ex
from vitlab.cli import main
from vitlab.clip.zeroshot import load_clip
from vitlab.train import predict


def test_export_onnx_int8_and_predict(digits_run, tmp_path, capsys):
    out = tmp_path / "m.onnx"
    assert main(["export", str(digits_run), "--format", "onnx", "--int8", "--data", "digits", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "validation ok" in text and "real photos" in text
    assert "int8: wrote" in text and "int8 accuracy on digits test (270 images)" in text and "points" in text
    q = tmp_path / "m-int8.onnx"
    assert q.stat().st_size < out.stat().st_size
    ops = {n.op_type for n in onnx.load(str(q)).graph.node}
    assert "DynamicQuantizeLinear" in ops and "MatMulInteger" in ops  # the linears run in int8
    assert ex.read_onnx_meta(q) == ex.read_onnx_meta(out)

    img = tmp_path / "cat.png"
    Image.fromarray(skimage.data.chelsea()).save(img)
    assert main(["predict", "--onnx", str(out), str(img), str(img), "--topk", "3", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    want = predict(digits_run, [img, img], topk=3, optimize=False)
    for g, w in zip(got, want):  # ONNX Runtime with the file's preprocessing == eager with the checkpoint's
        assert g["image"] == str(img) and [lbl for lbl, _ in g["top"]] == [lbl for lbl, _ in w["top"]]
        np.testing.assert_allclose([p for _, p in g["top"]], [p for _, p in w["top"]], atol=1e-5)


def test_export_torchscript_json(digits_run, tmp_path, capsys):
    out = tmp_path / "m.pt"
    assert main(["export", str(digits_run), "--format", "torchscript", "--static-batch", "--out", str(out),
                 "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["ok"] and r["exporter"] == "torch.jit.trace" and list(r["max_abs_diff"]) == [
        "random 1x1x16x16", "real photos 1x1x16x16"]


@pytest.mark.parametrize("argv, words", [
    (["nope_model", "--format", "onnx"], "unknown model 'nope_model'"),
    (["vit_pico_patch8_3", "--format", "onnx"], "close matches: vit_pico_patch8_32"),
    (["vit_pico_patch8_32", "--format", "exported", "--int8"], "--int8 needs --format onnx"),
    (["vit_pico_patch8_32", "--format", "torchscript", "--dynamic-img-size"], "--dynamic-img-size needs"),
    (["mobilevit_xxs", "--format", "onnx", "--dynamic-img-size", "--img-size", "64", "64"], "single 64-pixel step"),
    (["levit_128s", "--format", "onnx", "--dynamic-img-size"], "levit_128s has no dynamic image size"),
    (["vit_pico_patch8_32", "--format", "onnx", "--img-size", "0", "32"], "must be positive"),
    (["vit_pico_patch8_32", "--format", "exported", "--opset", "17"], "--opset applies"),
])
def test_bad_input_one_line_exit_2(argv, words, tmp_path, capsys):
    assert main(["export", *argv, "--out", str(tmp_path / "f")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vitlab: error:") and words in err and err.count("\n") == 1
    assert not (tmp_path / "f").exists()


def test_missing_extra_names_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import onnxruntime now raises ImportError
    assert main(["export", "vit_pico_patch8_32", "--format", "onnx", "--out", str(tmp_path / "m.onnx")]) == 2
    assert main(["predict", "--onnx", str(tmp_path / "m.onnx"), "x.png"]) == 2
    err = capsys.readouterr().err
    assert err.count("pip install vitlab[export]") == 2 and "onnxruntime" in err


def test_predict_needs_one_source(capsys):
    assert main(["predict", "x.png"]) == 2
    assert "exactly one of --checkpoint" in capsys.readouterr().err


@pytest.mark.slow  # 15 s: a CLIP trained for one epoch, its image tower exported with a dynamic image size
def test_clip_run_exports_its_image_tower(tmp_path, capsys):
    run, out = tmp_path / "run", tmp_path / "clip.onnx"
    assert main(["train", "--task", "clip", "--output_dir", str(run), "--model", "clip_vit_pico_patch8",
                 "--model_kwargs.image_depth", "1", "--model_kwargs.text_depth", "1", "--epochs", "1",
                 "--batch_size", "128", "--threads", "1", "--quiet"]) == 0
    assert main(["export", str(run), "--format", "onnx", "--dynamic-img-size", "--out", str(out)]) == 0
    assert "exported its image tower" in capsys.readouterr().out
    meta = ex.read_onnx_meta(out)
    assert meta.output == "image_embedding" and meta.class_names[7] == "seven"
    x = ex.real_images(meta)
    got = ex.onnx_session(out).run(None, {"image": x.numpy()})[0]
    with torch.no_grad():  # the run's trained weights, as vitlab zeroshot loads them
        want = load_clip(str(run))[0].encode_image(x)
    torch.testing.assert_close(torch.from_numpy(got), want, atol=1e-5, rtol=0)
    assert main(["predict", "--onnx", str(out), "x.png"]) == 2
    err = capsys.readouterr().err
    assert "not class scores" in err and err.count("\n") == 1
