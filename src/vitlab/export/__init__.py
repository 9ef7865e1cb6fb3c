"""Export and deployment: ONNX (validated with ONNX Runtime), ``torch.export`` ExportedPrograms (``.pt2``) and
TorchScript, each written atomically and then checked against eager PyTorch on random and real images.

    import vitlab.export
    r = vitlab.export.onnx("deit_tiny_patch16_224", "deit.onnx")         # dynamic batch, metadata embedded
    r.ok, r.max_abs_diff, r.lines()
    vitlab.export.exported_program("runs/RUN", "model.pt2")              # a vitlab-trained checkpoint
    vitlab.export.onnx(vitlab.create_model("deit_tiny_patch16_224"), "deit.onnx")   # a module: size from its config
    vitlab.export.export_meta(model)                                     # the preprocessing a file will embed
    vitlab.export.quantize_onnx("deit.onnx", "deit-int8.onnx", data="digits")   # dynamic int8 linears
    vitlab.export.predict_onnx("deit.onnx", ["cat.jpg"])                 # ONNX Runtime, preprocessing from the file

The ONNX path uses the dynamo exporter (``torch.onnx.export(..., dynamo=True)``: ``torch.export`` then
onnxscript's ATen-to-ONNX translation, the default since torch 2.9) and falls back to the TorchScript-based
exporter where it fails, saying so. ONNX needs the optional extra ``pip install vitlab[export]`` (onnx,
onnxscript, onnxruntime).
"""

from vitlab.export._export import (
    exported_program,
    load_exported,
    onnx,
    onnx_session,
    read_onnx_meta,
    require_onnx,
    torchscript,
)
from vitlab.export._quantize import predict_onnx, quantize_onnx
from vitlab.export._source import (
    ExportMeta,
    export_meta,
    image_model,
    is_model_name,
    load_source,
    num_params,
    real_images,
    smallest_per_family,
    too_big_to_export,
)
from vitlab.export._validate import FP32_ATOL, ExportReport

__all__ = ["FP32_ATOL", "ExportMeta", "ExportReport", "export_meta", "exported_program", "image_model",
           "is_model_name", "load_exported", "load_source", "num_params", "onnx", "onnx_session", "predict_onnx",
           "quantize_onnx", "read_onnx_meta", "real_images", "require_onnx", "smallest_per_family",
           "too_big_to_export", "torchscript"]
