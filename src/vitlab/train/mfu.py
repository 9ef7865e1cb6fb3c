"""The figures people watch on clusters: model FLOPs utilisation (MFU), throughput, step time, data-wait share and
peak memory of a training run.

MFU is the PaLM definition (Chowdhery et al., 2022, "PaLM", Appendix B): the model FLOPs a training step needs,
divided by the time it took and by the device's peak. The model's forward FLOPs come from the counter of
:mod:`vitlab.profile` (GMACs x 2, one multiply-add = two FLOPs) at one image of the run's input size; a training
step is 3x the forward (the backward pass costs twice the forward, Kaplan et al., 2020, "Scaling Laws for Neural
Language Models", Section 2.1), recomputation from activation checkpointing not counted (it is hardware FLOPs, not
model FLOPs). The peak is the vendor's dense tensor-core figure for the GPU and the step's dtype
(:data:`GPU_PEAK_TFLOPS`; bf16 / fp16 under AMP, tf32 when float32 matmuls may use it, fp32 otherwise), and on a
CPU the measured GEMM throughput of this process (:func:`cpu_peak_tflops`, a few large matmuls, cached per
dtype and thread count).

Tokens per image are the patch embedding's output tokens plus the model's prefix tokens (class, register,
distillation), read from the same counting forward; a model without a patch embedding reports no tokens/s.
"""

from __future__ import annotations

import functools
import resource
import sys
import time

import torch
import torch.nn as nn

# Dense (no sparsity) peak TFLOP/s per GPU and dtype from the vendors' datasheets. Keys are matched as
# substrings of torch.cuda.get_device_name(), the first match in this order (so "H100 PCIe" before "H100").
GPU_PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "B200": {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 80.0},
    "H200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2},
    "H100 NVL": {"bf16": 835.0, "fp16": 835.0, "tf32": 417.5, "fp32": 60.0},
    "H100": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},  # SXM5 (e.g. "H100 80GB HBM3")
    "H800": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "GH200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "A800": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "L40S": {"bf16": 362.1, "fp16": 362.1, "tf32": 183.0, "fp32": 91.6},
    "L40": {"bf16": 181.0, "fp16": 181.0, "tf32": 90.5, "fp32": 90.5},
    "L4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
    "A10G": {"bf16": 70.0, "fp16": 70.0, "tf32": 35.0, "fp32": 31.2},
    "A10": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2},
    "RTX 6000 Ada": {"bf16": 364.2, "fp16": 364.2, "tf32": 182.1, "fp32": 91.1},
    "RTX A6000": {"bf16": 154.8, "fp16": 154.8, "tf32": 77.4, "fp32": 38.7},
    "RTX 4090": {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6},
    "RTX 3090": {"bf16": 71.0, "fp16": 71.0, "tf32": 35.6, "fp32": 35.6},
    "V100": {"fp16": 125.0, "fp32": 15.7},
    "T4": {"fp16": 65.0, "fp32": 8.1},
    "MI300X": {"bf16": 1307.4, "fp16": 1307.4, "tf32": 653.7, "fp32": 163.4},
    "MI250X": {"bf16": 383.0, "fp16": 383.0, "fp32": 95.7},
}


def step_dtype(device: torch.device, amp: str) -> str:
    """The dtype a training step's matmuls run in: the AMP dtype, else tf32 where float32 matmuls may use tensor
    cores (``torch.backends.cuda.matmul.allow_tf32`` / ``set_float32_matmul_precision``), else fp32."""
    if amp in ("bf16", "fp16"):
        return amp
    if device.type == "cuda" and (torch.backends.cuda.matmul.allow_tf32
                                  or torch.get_float32_matmul_precision() != "highest"):
        return "tf32"
    return "fp32"


def gpu_peak_tflops(name: str, dtype: str) -> float | None:
    """The table's dense peak of GPU ``name`` (as ``torch.cuda.get_device_name`` gives it) in ``dtype``; None for
    a GPU or dtype the table lacks."""
    for key, peaks in GPU_PEAK_TFLOPS.items():
        if key in name:
            return peaks.get(dtype)
    return None


@functools.cache
def _measured_gemm_tflops(dtype: torch.dtype, threads: int, n: int) -> float:
    a = torch.randn(n, n, generator=torch.Generator().manual_seed(0)).to(dtype)
    b = a.t().contiguous()
    torch.mm(a, b)  # warm-up: the library's kernels, the pages of the output
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e12


def cpu_peak_tflops(dtype: str = "fp32", n: int = 1024) -> float:
    """This CPU's GEMM throughput in TFLOP/s: the best of three ``n x n`` matmuls in ``dtype`` with the process's
    current thread count, measured once per (dtype, threads) in a process (about a tenth of a second). It uses its
    own random generator, so training's random streams are untouched."""
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, torch.float32)
    return _measured_gemm_tflops(torch_dtype, torch.get_num_threads(), n)


def peak_tflops(device: torch.device, amp: str) -> tuple[float | None, str]:
    """(peak TFLOP/s of one ``device`` for a step under ``amp``, where the figure comes from)."""
    dtype = step_dtype(device, amp)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return gpu_peak_tflops(name, dtype), f"{name} {dtype} datasheet"
    if device.type == "cpu":
        return cpu_peak_tflops(dtype), f"measured CPU GEMM {dtype}, {torch.get_num_threads()} threads"
    return None, f"no peak known for {device.type}"


def model_flops(model: nn.Module, in_chans: int, img_size: int, device: torch.device) -> tuple[int, int | None]:
    """(forward FLOPs of ``model`` on one ``in_chans x img_size x img_size`` image, tokens per image or None).
    FLOPs are the counter's multiply-adds x 2 (:func:`vitlab.profile.count_macs`); the model runs once in eval
    mode on ``device`` with a zero image (no random stream is drawn)."""
    from vitlab.profile import count_macs

    tokens: list[int] = []
    embed = getattr(model, "patch_embed", None)
    hook = None
    if isinstance(embed, nn.Module):
        def grab(_module, _inputs, out):
            out = out[0] if isinstance(out, (tuple, list)) else out
            tokens.append(int(out.shape[1]) if out.dim() == 3 else int(out.shape[-2] * out.shape[-1]))

        hook = embed.register_forward_hook(grab)
    was_training = model.training
    model.eval()
    try:
        x = torch.zeros(1, in_chans, img_size, img_size, device=device)
        macs = count_macs(model, x)
    finally:
        model.train(was_training)
        if hook is not None:
            hook.remove()
    n_tokens = tokens[0] + int(getattr(model, "num_prefix_tokens", 0) or 0) if tokens else None
    return 2 * macs, n_tokens


def peak_memory_gb(device: torch.device) -> dict[str, float]:
    """Peak memory so far: CUDA allocated and reserved on a GPU (``torch.cuda.max_memory_*``), the process's peak
    resident set (``getrusage``) on a CPU, in GB (1e9 bytes)."""
    if device.type == "cuda":
        return {"peak_mem_allocated_gb": torch.cuda.max_memory_allocated(device) / 1e9,
                "peak_mem_reserved_gb": torch.cuda.max_memory_reserved(device) / 1e9}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return {"peak_rss_gb": rss * (1 if sys.platform == "darwin" else 1024) / 1e9}


class Meter:
    """Per-step figures of a run: images/s, tokens/s, step time, data-wait share, MFU and peak memory; and the
    run's totals for ``summary.json``. ``train_flops`` is one sample's training FLOPs (3x forward), ``peak``
    one device's peak FLOP/s."""

    def __init__(self, device: torch.device, world_size: int, train_flops: float | None, tokens: int | None,
                 peak: float | None):
        self.device, self.world = device, world_size
        self.train_flops, self.tokens, self.peak = train_flops, tokens, peak
        self.steps, self.samples, self.time, self.wait = 0, 0, 0.0, 0.0

    def step(self, samples: int, step_time: float, wait: float) -> dict[str, float]:
        """The figures of one optimiser step that saw ``samples`` images on this process in ``step_time`` seconds,
        ``wait`` of which went to waiting for the loader."""
        self.steps += 1
        self.samples += samples
        self.time += step_time
        self.wait += wait
        return {**self._rates(samples, step_time, wait), "step_time_s": step_time, **peak_memory_gb(self.device)}

    def _rates(self, samples: int, seconds: float, wait: float) -> dict[str, float]:
        seconds = max(seconds, 1e-12)
        img_s = samples * self.world / seconds
        out = {"img_per_s": img_s}
        if self.tokens:
            out["tokens_per_s"] = img_s * self.tokens
        out["data_wait"] = wait / seconds
        if self.train_flops and self.peak:
            out["mfu"] = img_s * self.train_flops / (self.peak * self.world)
        return out

    def mark(self) -> tuple[int, int, float, float]:
        """The counts so far, for :meth:`totals` of what follows (an epoch's figures)."""
        return self.steps, self.samples, self.time, self.wait

    def totals(self, since: tuple[int, int, float, float] = (0, 0, 0.0, 0.0)) -> dict[str, float]:
        """The figures over the steps this process timed since the :meth:`mark` ``since`` (default: the whole run;
        ``step_time_s``: the mean step)."""
        steps, samples = self.steps - since[0], self.samples - since[1]
        seconds, wait = self.time - since[2], self.wait - since[3]
        if not steps:
            return {}
        return {**self._rates(samples, seconds, wait), "step_time_s": seconds / steps, **peak_memory_gb(self.device)}
