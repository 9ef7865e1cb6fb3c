"""The device's own matmul peak, so a benchmark's utilisation is against what this machine reaches in this run
(on the CPU in fp32 including oneDNN's matmul, which :func:`vitlab.optimize.optimize` may pick)."""

from __future__ import annotations

import torch

from vitlab.optimize.onednn import onednn_linear_available
from vitlab.timing import time_once


def matmul_peak_tflops(device: torch.device, dtype: torch.dtype, n: int | None = None, runs: int = 10) -> float:
    """TFLOP/s of a large square matrix product in ``dtype`` on ``device``: the best of ``runs`` after warm-up
    (a peak, so the fastest run; utilisation is measured against it). On the CPU in fp32 the faster of ATen's
    BLAS and oneDNN's matmul counts, since ``vitlab.optimize`` may run the latter."""
    n = n or (8192 if device.type == "cuda" else 2048)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    products = [lambda: a @ b]
    with torch.inference_mode():
        if device.type == "cpu" and dtype == torch.float32 and onednn_linear_available():
            products.append(lambda: torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], ""))
        best = float("inf")
        for product in products:
            for _ in range(3):
                product()
            best = min(best, min(time_once(product, device) for _ in range(runs)))
    return 2 * n**3 / best / 1e12
