"""The three exporters (ONNX, ExportedProgram ``.pt2``, TorchScript): trace with a dynamic batch (and, where the
model computes it exactly, a dynamic image size), write the file atomically with the preprocessing embedded, load
it back with its own runtime and compare with eager PyTorch."""

from __future__ import annotations

import contextlib
import io
import os
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn as nn
from torch.export import Dim

from vitlab._io import atomic_write, make_temp_dir
from vitlab.export._source import META_KEY, ExportMeta, export_meta, image_model, load_source
from vitlab.export._validate import FP32_ATOL, ExportReport, check_inputs, compare, outputs

EXTRA = "vitlab[export]"
TRACE_BATCH = 2  # > 1, so torch.export keeps the batch symbolic instead of specialising a size-1 dimension
MAX_BATCH = 4096
# a single ONNX protobuf must stay under 2 GiB: models whose weights come near it keep them in external data
_EXTERNAL_DATA_ABOVE = 2**31 - 2**27


def require_onnx() -> None:
    """ValueError naming the extra to install unless onnx, onnxscript and onnxruntime import."""
    missing = []
    for mod in ("onnx", "onnxscript", "onnxruntime"):
        try:
            __import__(mod)
        except ImportError:
            missing.append(mod)
    if missing:
        raise ValueError(f"ONNX export and inference need {', '.join(missing)}: pip install {EXTRA}")


def _prepare(model: nn.Module | str | os.PathLike, meta: ExportMeta | None, img_size, dynamic_batch: bool,
             dynamic_img_size: bool, model_kwargs: dict) -> tuple[nn.Module, ExportMeta]:
    if isinstance(model, nn.Module):
        module, output = image_model(model)
        meta = export_meta(model, img_size) if meta is None else replace(meta, output=output)
        module = module.eval()
    else:
        module, loaded = load_source(model, img_size=img_size, dynamic_img_size=dynamic_img_size, **model_kwargs)
        meta = meta or loaded
    meta = replace(meta, dynamic_batch=dynamic_batch, dynamic_img_size=dynamic_img_size)  # the caller's stays
    if dynamic_img_size:
        _check_dynamic_size(module, meta)
    return module, meta


def _check_dynamic_size(model: nn.Module, meta: ExportMeta) -> None:
    """Refuse a dynamic image size for a model built for one resolution."""
    model = getattr(model, "trunk", model)  # a CLIP image tower: its ViT decides
    if getattr(model, "dynamic_img_size", None) is False:  # families that are size-agnostic keep no flag
        raise ValueError(f"{meta.model} has no dynamic image size: export it at a fixed --img-size H W")


def size_multiple(model: nn.Module, meta: ExportMeta) -> int:
    """The smallest step in pixels by which the model accepts a larger input (patch size times downsampling)."""
    h, w = meta.img_size
    for m in (4, 8, 14, 16, 28, 32, 56, 64, 112, 128):
        if h % m or w % m:
            continue
        try:
            with torch.no_grad():
                model(torch.zeros(1, meta.in_chans, h + m, w + m))
            return m
        except (ValueError, RuntimeError):
            continue
    raise ValueError(f"{meta.model} takes no input larger than {h}x{w} by a patch multiple: no dynamic image size")


def _trace_plan(model: nn.Module, meta: ExportMeta) -> tuple[torch.Tensor, dict, list[tuple[int, int]]]:
    """(example input, dynamic_shapes, other sizes to validate at)."""
    h, w = meta.img_size
    dims: dict[int, object] = {}
    if meta.dynamic_batch:
        dims[0] = Dim("batch", min=1, max=MAX_BATCH)
    others: list[tuple[int, int]] = []
    if meta.dynamic_img_size:
        m = size_multiple(model, meta)
        if min(h, w) < 2 * m:
            # torch.export specialises sizes 0 and 1, so the symbolic grid starts at 2 steps of the stride
            raise ValueError(f"{meta.model} at {h}x{w} is a single {m}-pixel step high or wide; a dynamic image "
                             f"size covers {2 * m} pixels and more: export from --img-size {max(h, 2 * m)} "
                             f"{max(w, 2 * m)} or at a fixed size")
        dims[2], dims[3] = m * Dim("h_steps", min=2, max=4096 // m), m * Dim("w_steps", min=2, max=4096 // m)
        # trace at a size other than the model's own grid, so size-dependent code (position resampling) is in the
        # graph rather than skipped as it is at the default size; validate larger and, where the range allows, a
        # smaller size (position embeddings downsampled, where antialiasing matters)
        others = [(h + m, w + 2 * m), (h + 3 * m, w)] + ([(h - m, w)] if h >= 3 * m else [])
        h, w = others[0]
    x = torch.randn(TRACE_BATCH if meta.dynamic_batch else 1, meta.in_chans, h, w,
                    generator=torch.Generator().manual_seed(1))
    return x, dims, others


def _dynamic_shapes(dims: dict) -> tuple | None:
    return (dims,) if dims else None


@contextlib.contextmanager
def _quiet():
    """The exporters print progress lines and warnings on stdout/stderr; keep them for an error message only."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield buf


def _notes(meta: ExportMeta) -> list[str]:
    """What the report says before any check: which part of the model was exported, when not all of it."""
    if meta.output == "image_embedding":
        return [f"{meta.model} is a CLIP: exported its image tower (encode_image, unnormalised embeddings); the "
                "text tower takes token ids, not images, and is not part of the file"]
    return []


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


# ---------------------------------------------------------------------------------------------------- ONNX


def _onnx_bytes(model: nn.Module, x: torch.Tensor, dims: dict, opset: int, output: str, notes: list[str]):
    """(onnx ModelProto, exporter name): the dynamo exporter, else the TorchScript-based one (said in notes)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    shapes = _dynamic_shapes(dims)
    try:
        # math SDPA while tracing: the fused CPU kernel's output strides differ from those of the decomposition
        # the exporter runs later, and window attention's reshapes then meet an impossible view (Swin)
        with _quiet(), sdpa_kernel(SDPBackend.MATH), torch.no_grad():
            prog = torch.onnx.export(model, (x,), dynamo=True, opset_version=opset, dynamic_shapes=shapes,
                                     input_names=["image"], output_names=[output], verbose=False)
        return prog.model_proto, "dynamo (torch.export + onnxscript)"
    except Exception as e:  # noqa: BLE001  any exporter failure: try the other exporter, and say so
        notes.append(f"the dynamo exporter failed ({_first_line(e)}); fell back to the TorchScript-based exporter")
    import onnx

    axes = {}
    if 0 in dims:
        axes[0] = "batch"
    if 2 in dims:
        axes[2], axes[3] = "height", "width"
    buf = io.BytesIO()
    with _quiet(), torch.no_grad():
        torch.onnx.export(model, (x,), buf, dynamo=False, opset_version=opset, input_names=["image"],
                          output_names=[output], dynamic_axes={"image": axes} if axes else None)
    return onnx.load_from_string(buf.getvalue()), "TorchScript-based torch.onnx exporter (fall-back)"


def write_onnx(proto, path: Path, meta: ExportMeta | None = None) -> int:
    """Write an ONNX ModelProto atomically with ``meta`` in its metadata; returns the bytes written. Models over
    the 2 GiB protobuf limit keep their weights in ``path.data`` (replaced first, the ``.onnx`` last)."""
    import onnx

    if meta is not None:
        onnx.helper.set_model_props(proto, {META_KEY: meta.to_json()})
    path.parent.mkdir(parents=True, exist_ok=True)
    # the weights' size, tensor by tensor: ByteSize() of a whole model over 2 GiB fails to encode (EncodeError)
    if sum(t.ByteSize() for t in proto.graph.initializer) < _EXTERNAL_DATA_ABOVE:
        atomic_write(path, proto.SerializeToString())
        return path.stat().st_size
    tmp = make_temp_dir(path.parent)
    try:
        data = path.name + ".data"
        onnx.save_model(proto, str(tmp / path.name), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=data)
        os.replace(tmp / data, path.parent / data)
        os.replace(tmp / path.name, path)
    finally:
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()
    return path.stat().st_size + (path.parent / data).stat().st_size


def _unreadable_onnx(path: str | os.PathLike, reason: str) -> ValueError:
    """The one-line error for a file that does not load as an ONNX model. Every ONNX writer serialises the
    ModelProto's fields in order, so a model starts with field 1 (``ir_version``, the byte 0x08): such a file was an
    ONNX model and has been cut or damaged; any other is not an ONNX model."""
    with open(path, "rb") as f:
        starts_as_onnx = f.read(1) == b"\x08"
    if starts_as_onnx:
        return ValueError(f"{path} is truncated or corrupt: it starts as an ONNX model but {reason}")
    return ValueError(f"{path} is not an ONNX model: it {reason}")


def onnx_session(path: str | os.PathLike, threads: int | None = None):
    """An ONNX Runtime CPU session on ``path`` (all graph optimisations)."""
    require_onnx()
    import onnxruntime as ort
    from onnxruntime.capi.onnxruntime_pybind11_state import InvalidProtobuf

    if not Path(path).is_file():
        raise FileNotFoundError(f"ONNX file not found: {path}")
    opts = ort.SessionOptions()
    if threads:
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
    try:
        return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    except InvalidProtobuf:
        raise _unreadable_onnx(path, "does not parse in ONNX Runtime") from None


def read_onnx_meta(path: str | os.PathLike) -> ExportMeta:
    """The :class:`ExportMeta` embedded in an ONNX file by :func:`onnx`; a one-line ValueError naming the file when
    it is not an ONNX model, is truncated or corrupt, or was not written by vitlab."""
    require_onnx()
    import onnx
    from google.protobuf.message import DecodeError

    if not Path(path).is_file():
        raise FileNotFoundError(f"ONNX file not found: {path}")
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except DecodeError:
        raise _unreadable_onnx(path, "does not parse as an ONNX ModelProto") from None
    # protobuf parses any prefix that ends between two fields: a model cut there lacks its graph or its opsets
    if not proto.HasField("graph") or not proto.opset_import:
        raise _unreadable_onnx(path, f"has no {'graph' if not proto.HasField('graph') else 'opset imports'}")
    props = {p.key: p.value for p in proto.metadata_props}
    if META_KEY not in props:
        raise ValueError(f"{path} carries no vitlab metadata (it was not written by vitlab export)")
    return ExportMeta.from_json(props[META_KEY])


def _ort_runner(sess) -> Callable[[torch.Tensor], list]:
    name = sess.get_inputs()[0].name
    return lambda x: sess.run(None, {name: x.numpy()})


def onnx(model: nn.Module | str | os.PathLike, path: str | os.PathLike, *, img_size=None, dynamic_batch: bool = True,
         dynamic_img_size: bool = False, opset: int = 20, meta: ExportMeta | None = None, validate: bool = True,
         atol: float = FP32_ATOL, **model_kwargs) -> ExportReport:
    """Export to ONNX and validate with ONNX Runtime. ``opset`` 20 by default: LITv2's deformable convolution
    needs ONNX's DeformConv (opset 19+).

    ``model``: an ``nn.Module``, a registered model name (random weights; extra ``model_kwargs`` go to
    ``create_model``) or a run / checkpoint of ``vitlab train``. A module's input size and preprocessing are
    :func:`~vitlab.export.export_meta`'s (from its registry config and its own size; a bare module needs
    ``img_size`` or ``meta``), the same as for its name. The dynamo exporter runs first; where it fails the
    TorchScript-based exporter is used and the report's notes say so. The preprocessing (mean, std, size, class
    names) is embedded as JSON under the metadata key ``'vitlab'``."""
    require_onnx()
    t0 = time.perf_counter()
    module, meta = _prepare(model, meta, img_size, dynamic_batch, dynamic_img_size, model_kwargs)
    x, dims, others = _trace_plan(module, meta)
    notes = _notes(meta)
    proto, exporter = _onnx_bytes(module, x, dims, opset, meta.output, notes)
    size = write_onnx(proto, Path(path), meta)
    report = ExportReport(str(path), "onnx", exporter, size, meta, notes=notes, atol=atol)
    if validate:
        run = _ort_runner(onnx_session(path))
        report.diffs = compare(module, run, check_inputs(meta, x.shape[0], others), report.notes)
    report.seconds = time.perf_counter() - t0
    return report


# ------------------------------------------------------------------------------------ ExportedProgram, TorchScript


def exported_program(model: nn.Module | str | os.PathLike, path: str | os.PathLike, *, img_size=None,
                     dynamic_batch: bool = True, dynamic_img_size: bool = False, meta: ExportMeta | None = None,
                     validate: bool = True, atol: float = FP32_ATOL, **model_kwargs) -> ExportReport:
    """``torch.export`` the model to a ``.pt2`` (``torch.export.save``, the preprocessing in the extra file
    ``vitlab.json``) and validate it through ``torch.export.load``. Arguments as for :func:`onnx`."""
    t0 = time.perf_counter()
    module, meta = _prepare(model, meta, img_size, dynamic_batch, dynamic_img_size, model_kwargs)
    x, dims, others = _trace_plan(module, meta)
    with _quiet(), torch.no_grad():
        ep = torch.export.export(module, (x,), dynamic_shapes=_dynamic_shapes(dims))
    buf = io.BytesIO()
    torch.export.save(ep, buf, extra_files={f"{META_KEY}.json": meta.to_json()})
    atomic_write(path, buf.getvalue())
    report = ExportReport(str(path), "exported", "torch.export", Path(path).stat().st_size, meta, atol=atol,
                          notes=_notes(meta))
    if validate:
        loaded = load_exported(path)[0]
        report.diffs = compare(module, lambda t: outputs(loaded(t)), check_inputs(meta, x.shape[0], others),
                               report.notes)
    report.seconds = time.perf_counter() - t0
    return report


def load_exported(path: str | os.PathLike) -> tuple[nn.Module, ExportMeta]:
    """(callable module, ExportMeta) of a ``.pt2`` written by :func:`exported_program`."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"exported program not found: {path}")
    extra = {f"{META_KEY}.json": ""}
    ep = torch.export.load(path, extra_files=extra)
    return ep.module(), ExportMeta.from_json(extra[f"{META_KEY}.json"])


def torchscript(model: nn.Module | str | os.PathLike, path: str | os.PathLike, *, img_size=None,
                dynamic_batch: bool = True, meta: ExportMeta | None = None, validate: bool = True,
                atol: float = FP32_ATOL, **model_kwargs) -> ExportReport:
    """``torch.jit.trace`` the model to a TorchScript file (the preprocessing in the extra file ``vitlab.json``) and
    validate it through ``torch.jit.load``, at other batch sizes too (a trace can bake a size in: the check
    catches it). No dynamic image size: a trace fixes the size-dependent branches."""
    t0 = time.perf_counter()
    module, meta = _prepare(model, meta, img_size, dynamic_batch, False, model_kwargs)
    x, _, _ = _trace_plan(module, meta)
    with _quiet(), torch.no_grad():
        traced = torch.jit.trace(module, x, check_trace=False)
    buf = io.BytesIO()
    with _quiet():  # torch.jit's deprecation warnings: TorchScript is the format asked for
        torch.jit.save(traced, buf, _extra_files={f"{META_KEY}.json": meta.to_json()})
    atomic_write(path, buf.getvalue())
    report = ExportReport(str(path), "torchscript", "torch.jit.trace", Path(path).stat().st_size, meta, atol=atol,
                          notes=_notes(meta))
    if validate:
        with _quiet():
            loaded = torch.jit.load(str(path))
        report.diffs = compare(module, lambda t: outputs(loaded(t)), check_inputs(meta, x.shape[0], []), report.notes)
    report.seconds = time.perf_counter() - t0
    return report
