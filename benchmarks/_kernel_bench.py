"""What the CPU-kernel benchmarks (``causal_attention_cpu.py``, ``packed_linear_cpu.py``) share: their command
line, the check that vitlab's kernels are built here, and the machine record of their JSON."""

from __future__ import annotations

import argparse
import platform

import torch

from vitlab.optimize import kernels
from vitlab.optimize.cpu import cpu_model, isa


def parse(doc: str, argv: list[str] | None) -> argparse.Namespace:
    """``--threads``, ``--warmup``, ``--runs``, ``--json``; torch's threads set; exit code 2 with one line where the
    kernels are not available."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not kernels.available():
        raise SystemExit(f"vitlab's CPU kernels are not available here: {kernels.status()}")
    print(f"{cpu_model()} ({isa()}), {torch.get_num_threads()} threads, kernel path {kernels.isa()}")
    return args


def meta(args: argparse.Namespace) -> dict:
    """The machine, versions and timing settings of a run."""
    return {"cpu": cpu_model(), "isa": isa(), "kernel_isa": kernels.isa(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(), "runs": args.runs,
            "warmup": args.warmup}
