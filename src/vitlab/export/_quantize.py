"""Deployment on ONNX Runtime: dynamic int8 quantization of the linear layers and top-k prediction with the
preprocessing read from the file.

Dynamic quantization (ONNX Runtime's ``quantize_dynamic``): the weights of every MatMul / Gemm (the linear
layers) are stored as int8 with one scale per tensor; activations are quantized to uint8 on the fly per batch
from their observed range, so no calibration data is needed (Jacob et al., 2018, "Quantization and Training of
Neural Networks for Efficient Integer-Arithmetic-Only Inference", Section 2: r = S (q - Z)).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import torch

from vitlab._io import make_temp_dir
from vitlab.export._export import onnx_session, read_onnx_meta, require_onnx, write_onnx
from vitlab.export._source import ExportMeta, real_images


def quantize_onnx(src: str | os.PathLike, dst: str | os.PathLike, data: str | None = None, split: str = "test",
                  batch_size: int = 64, max_images: int | None = None) -> dict:
    """Write ``dst``: ``src`` with int8 dynamic quantization of its MatMul / Gemm weights (metadata kept).

    Returns the file sizes, the max abs difference of the logits on the real photos and, with ``data`` (any
    ``vitlab train`` dataset: 'digits', 'imagefolder:PATH', ...), the top-1 of both files on its ``split`` and the
    change."""
    require_onnx()
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    src, dst = Path(src), Path(dst)
    meta = read_onnx_meta(src)
    if data is not None:
        _need_classifier(meta, src, "a top-1 accuracy")
    tmp = make_temp_dir(dst.parent if dst.parent.exists() else Path.cwd())
    try:
        previous = logging.root.manager.disable
        logging.disable(logging.WARNING)  # onnxruntime logs advice (pre-process the graph); the result is measured
        try:
            quantize_dynamic(src, tmp / "q.onnx", weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul", "Gemm"])
        finally:
            logging.disable(previous)
        size = write_onnx(onnx.load(str(tmp / "q.onnx")), dst, meta)
    finally:
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()
    fp32, int8 = onnx_session(src), onnx_session(dst)
    photos = real_images(meta).numpy()
    name = fp32.get_inputs()[0].name
    result = {"fp32_path": str(src), "int8_path": str(dst), "fp32_bytes": src.stat().st_size, "int8_bytes": size,
              "max_abs_diff_real": float(np.abs(fp32.run(None, {name: photos})[0]
                                                - int8.run(None, {name: photos})[0]).max())}
    if data is not None:
        a = onnx_top1(fp32, meta, data, split, batch_size, max_images)
        b = onnx_top1(int8, meta, data, split, batch_size, max_images)
        result.update(dataset=data, split=split, num_images=a["num_images"], top1_fp32=a["top1"],
                      top1_int8=b["top1"], top1_change=b["top1"] - a["top1"],
                      prediction_agreement=float(np.mean(a["pred"] == b["pred"])) * 100)
    return result


def _need_classifier(meta: ExportMeta, path, what: str) -> None:
    if meta.output != "logits":
        raise ValueError(f"{path} returns {meta.output.replace('_', ' ')}s ({meta.model}), not class scores: "
                         f"{what} needs a classifier")


def onnx_top1(sess, meta: ExportMeta, data: str, split: str = "test", batch_size: int = 64,
              max_images: int | None = None) -> dict:
    """Top-1 (%) of an ONNX Runtime session on a vitlab dataset, preprocessed as ``meta`` says."""
    from vitlab.data import DataConfig, build, check_num_classes

    if meta.img_size[0] != meta.img_size[1]:
        raise ValueError(f"accuracy is measured on square crops; this file was exported at {meta.img_size}")
    bundle = build(DataConfig(dataset=data, img_size=meta.img_size[0], crop_pct=meta.crop_pct), mean=meta.mean,
                   std=meta.std, in_chans=meta.in_chans)
    check_num_classes(bundle, meta.num_classes, what="the ONNX model")
    if split == "test" and bundle.test is None:
        split = "val"
    name = sess.get_inputs()[0].name
    preds, labels = [], []
    for x, y in bundle.loader(split, batch_size=batch_size):
        preds.append(sess.run(None, {name: x.numpy()})[0].argmax(-1))
        labels.append(y.numpy())
        if max_images and sum(len(p) for p in preds) >= max_images:
            break
    pred, label = np.concatenate(preds)[:max_images], np.concatenate(labels)[:max_images]
    return {"top1": float((pred == label).mean() * 100), "num_images": int(len(label)), "pred": pred}


def predict_onnx(path: str | os.PathLike, images: list[str | os.PathLike], topk: int = 5) -> list[dict]:
    """For each image: ``{"image": path, "top": [(label, probability), ...]}`` from ONNX Runtime, with vitlab's eval
    preprocessing (size, crop, mean, std) and the class names read from the file's metadata."""
    from vitlab.data import check_image_files, load_image

    meta = read_onnx_meta(path)  # a bad file or a missing runtime is named before the images
    _need_classifier(meta, path, "predict")
    check_image_files(images)
    tf = meta.transform()
    x = torch.stack([tf(load_image(p, meta.in_chans)) for p in images])
    sess = onnx_session(path)
    name = sess.get_inputs()[0].name
    if meta.dynamic_batch:
        logits = sess.run(None, {name: x.numpy()})[0]
    else:  # a fixed-batch file (batch 1): one image at a time
        logits = np.concatenate([sess.run(None, {name: x[i:i + 1].numpy()})[0] for i in range(len(images))])
    probs = torch.from_numpy(logits).float().softmax(-1)
    labels = meta.labels()
    top = probs.topk(min(topk, probs.shape[-1]), dim=-1)
    return [{"image": str(p), "top": [(labels[i], float(v)) for v, i in zip(top.values[j].tolist(),
                                                                              top.indices[j].tolist())]}
            for j, p in enumerate(images)]
