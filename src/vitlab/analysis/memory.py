"""Memory: seed 004's estimate against a measured peak, and seed 001's attention-complexity table.

* Seed 004 ("Choosing the right GPU"): ``M = P * 4 B / (32 / Q) * 1.2``, P parameters, 4 bytes a parameter at
  32 bits, Q the bits a parameter is loaded with (32, 16, 8, 4), 1.2 for 20% overhead
  (:func:`vitlab.profile.memory_estimate_gb`). :func:`measure_memory` puts it beside what a real run takes:
  on the CPU the growth of the process's peak resident set (Linux ``VmHWM``, reset through
  ``/proc/self/clear_refs``) from just before the model is built to the end of the step, on CUDA
  ``torch.cuda.max_memory_allocated`` over the same span; for inference (``torch.inference_mode``) and for a
  training step (forward, cross-entropy, backward, AdamW step) at a given batch. fp32 is Q = 32, bf16 weights
  are Q = 16; vitlab has no 8- / 4-bit weights, so those two rows are estimates only.
* Seed 001 ("Attention Efficiency", ``attention_complexity_analysis``): tokens N = (img / patch)^2 and N^2
  attention scores per head at 224 / 384 / 512 / 1024; :func:`complexity_table` adds, for a model of width D
  with h heads, the attention MACs of one layer (``QK^T`` and ``AV``: 2 N^2 D) and the memory of one layer's
  attention maps (h N^2 fp32 values) when they are materialised.
"""

from __future__ import annotations

import gc
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BITS = (32, 16, 8, 4)
SEED001_SIZES = (224, 384, 512, 1024)
# seed 001's printed output: "M attention ops" (N^2, millions) per size
SEED001_PRINTED_M = {224: 0.04, 384: 0.33, 512: 1.05, 1024: 16.78}


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise ValueError(f"/proc/self/status has no {field}")


def _reset_cpu_peak() -> int:
    """Reset the peak RSS (``VmHWM``) to the current RSS; returns the current RSS in bytes."""
    if not os.path.exists("/proc/self/clear_refs"):
        raise ValueError("measuring the CPU peak needs Linux's /proc/self/clear_refs (VmHWM reset); use --device "
                         "cuda, or estimates only")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # 5: reset the peak resident set size to the current one (Linux >= 4.0)
    return _status_kb("VmRSS") * 1024


def _step(model: nn.Module, x: torch.Tensor, mode: str):
    if mode == "infer":
        model.eval()

        def infer():
            with torch.inference_mode():
                model(x)
        return infer
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    target = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)

    def train():
        out = model(x)
        logits = sum(out) / len(out) if isinstance(out, tuple) else out  # distilled models: two heads
        F.cross_entropy(logits.float(), target).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return train


def _check(mode: str, dtype: str, device: str = "cpu") -> None:
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device here")
    if mode not in ("infer", "train"):
        raise ValueError(f"mode must be 'infer' or 'train', got {mode!r}")
    if dtype not in ("fp32", "bf16"):
        raise ValueError(f"dtype must be fp32 or bf16 (Q = 32 or 16), got {dtype!r}")


def measure_memory(name: str, batch_size: int = 64, mode: str = "infer", device: str = "cpu",
                   dtype: str = "fp32", img_size: int | None = None, **create_kwargs) -> dict:
    """Build ``name`` on ``device`` and run one ``mode`` step ('infer' or 'train') at ``batch_size``; return the
    measured peak growth beside seed 004's estimate, and ``loaded_gb``, the growth once the model and the input
    batch are in memory, before the step (what the estimate's "loading" covers). Random-init weights (memory
    does not depend on the values)."""
    import vitlab
    from vitlab.profile import count_params, memory_estimate_gb

    _check(mode, dtype, device)
    dev = torch.device(device)
    cfg = vitlab.get_model_config(name)
    size = img_size or cfg.input_size[1]
    if img_size is not None:
        create_kwargs["img_size"] = img_size
    tdtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
    else:
        base = _reset_cpu_peak()
    x = torch.randn(batch_size, cfg.input_size[0], size, size, device=dev, dtype=tdtype)
    with torch.device(dev):
        model = vitlab.create_model(name, **create_kwargs).to(tdtype)
    if dev.type == "cuda":
        loaded = torch.cuda.memory_allocated(dev) - base
    else:
        loaded = _status_kb("VmRSS") * 1024 - base
    _step(model, x, mode)()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - base
    else:
        peak = _status_kb("VmHWM") * 1024 - base
    params = count_params(model)[0]
    input_bytes = x.numel() * x.element_size()
    del model, x
    gc.collect()
    q = 32 if dtype == "fp32" else 16
    est = {b: memory_estimate_gb(params, b) for b in BITS}
    return {"model": name, "mode": mode, "device": device, "dtype": dtype, "batch_size": batch_size,
            "img_size": size, "params": params, "weights_gb": params * (q // 8) / 1e9,
            "input_gb": input_bytes / 1e9, "loaded_gb": loaded / 1e9, "measured_peak_gb": peak / 1e9,
            "estimate_gb": est, "estimate_at_dtype_gb": est[q], "measured_over_estimate": peak / 1e9 / est[q]}


def complexity_table(embed_dim: int = 768, num_heads: int = 12, patch_size: int = 16,
                     sizes: tuple[int, ...] = SEED001_SIZES) -> list[dict]:
    """Seed 001's table, one row per image size: tokens, N^2 scores per head (and the seed's printed value),
    attention MACs of one layer (2 N^2 D: ``QK^T`` and ``AV``), one layer's fp32 attention maps (h N^2 x 4 B)."""
    rows = []
    for s in sizes:
        if s % patch_size:
            raise ValueError(f"image size {s} is not a multiple of the patch size {patch_size}")
        n = (s // patch_size) ** 2
        rows.append({"img_size": s, "tokens": n, "scores_per_head_m": n * n / 1e6,
                     "seed001_printed_m": SEED001_PRINTED_M.get(s) if patch_size == 16 else None,
                     "attention_gmacs_per_layer": 2 * n * n * embed_dim / 1e9,
                     "attention_map_mb_per_layer": num_heads * n * n * 4 / 2**20})
    return rows


def measure_memory_isolated(name: str, **kwargs) -> dict:
    """:func:`measure_memory` in a fresh Python process, so that memory the allocator kept from earlier work in
    this process cannot hide part of the peak (and one measurement cannot feed the next)."""
    import json
    import subprocess
    import sys

    _check(kwargs.get("mode", "infer"), kwargs.get("dtype", "fp32"), kwargs.get("device", "cpu"))
    code = ("import json, sys; from vitlab.analysis.memory import measure_memory; "
            "a = json.loads(sys.argv[1]); print(json.dumps(measure_memory(a.pop('name'), **a)))")
    proc = subprocess.run([sys.executable, "-c", code, json.dumps({"name": name, **kwargs})], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines() or ["no output"]
        raise ValueError(f"memory measurement of {name} failed: {lines[-1]}")
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    r["estimate_gb"] = {int(k): v for k, v in r["estimate_gb"].items()}
    return r
