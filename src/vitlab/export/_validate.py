"""Validation of an exported file against eager PyTorch: the same inputs (random images at the traced and at other
batch sizes and, with a dynamic image size, at other sizes; real photos), the largest absolute difference of
every output, pass or fail against a tolerance."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn as nn

from vitlab.export._source import ExportMeta, real_images

FP32_ATOL = 1e-4  # the bound for fp32 exports (ONNX Runtime / torch.export / TorchScript vs eager)


@dataclass
class ExportReport:
    """What an export wrote and how its file compared with eager PyTorch."""

    path: str
    format: str                      # 'onnx' | 'exported' | 'torchscript'
    exporter: str                    # e.g. 'dynamo (torch.onnx, onnxscript)', 'torch.export', 'torch.jit.trace'
    size_bytes: int
    meta: ExportMeta
    diffs: dict[str, float] = field(default_factory=dict)  # check -> max abs diff vs eager
    atol: float = FP32_ATOL
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def max_abs_diff(self) -> float:
        return max(self.diffs.values()) if self.diffs else float("nan")

    @property
    def ok(self) -> bool:
        return bool(self.diffs) and self.max_abs_diff <= self.atol

    def lines(self) -> list[str]:
        out = [f"wrote {self.path} ({self.size_bytes / 2**20:.1f} MiB, {self.format} via {self.exporter}, "
               f"{self.seconds:.1f} s)"]
        out += [f"  note: {n}" for n in self.notes]
        for name, d in self.diffs.items():
            out.append(f"  max abs diff vs eager, {name}: {d:.2e}")
        verdict = "ok" if self.ok else "FAILED"
        out.append(f"validation {verdict}: max abs diff {self.max_abs_diff:.2e} (tolerance {self.atol:.0e})")
        return out


def check_inputs(meta: ExportMeta, trace_batch: int, other_sizes: list[tuple[int, int]]) -> dict[str, torch.Tensor]:
    """Named validation inputs: random images at the traced batch, at batch 1 and 3 when the batch is dynamic,
    at ``other_sizes`` (dynamic image size), and the real photos."""
    g = torch.Generator().manual_seed(0)
    c, (h, w) = meta.in_chans, meta.img_size
    batches = [trace_batch] + ([1, 3] if meta.dynamic_batch else [])
    checks = {f"random {b}x{c}x{h}x{w}": torch.randn(b, c, h, w, generator=g) for b in dict.fromkeys(batches)}
    for hh, ww in other_sizes:
        checks[f"random 2x{c}x{hh}x{ww}"] = torch.randn(2, c, hh, ww, generator=g)
    photos = real_images(meta, n=3 if meta.dynamic_batch else trace_batch)
    checks[f"real photos {photos.shape[0]}x{c}x{h}x{w}"] = photos
    return checks


def outputs(out) -> list[np.ndarray]:
    items = out if isinstance(out, (tuple, list)) else [out]
    return [o.detach().float().cpu().numpy() if isinstance(o, torch.Tensor) else np.asarray(o) for o in items]


def compare(model: nn.Module, run: Callable[[torch.Tensor], list[np.ndarray]],
            checks: dict[str, torch.Tensor], notes: list[str]) -> dict[str, float]:
    """Max abs difference between ``run`` (the exported file) and eager ``model`` for each named input; an input
    the file cannot run (e.g. a size baked into the graph) counts as an infinite difference, its error in ``notes``."""
    diffs = {}
    for name, x in checks.items():
        with torch.no_grad():
            ref = outputs(model(x))
        try:
            got = run(x)
        except Exception as e:  # noqa: BLE001  the runtimes raise their own error types
            msg = str(e).strip().splitlines()
            notes.append(f"the exported file fails on {name}: {type(e).__name__}: {msg[-1] if msg else ''}"[:400])
            diffs[name] = float("inf")
            continue
        if len(got) != len(ref) or any(a.shape != b.shape for a, b in zip(got, ref)):
            raise RuntimeError(f"the exported model returns shapes {[a.shape for a in got]} on {name}, eager "
                               f"{[b.shape for b in ref]}")
        diffs[name] = float(max(np.abs(a - b).max() for a, b in zip(got, ref)))
    return diffs
