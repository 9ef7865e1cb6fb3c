"""HiLo on the CPU, fp32 inference, the Table IV setting (dim 768, 12 heads, 14 x 14 map, s = 2, alpha = 0.9):
paired, alternating timings of every way vitlab can run it, against a plain paper-style HiLo (the official
LITv2 code, unfused, eager) and fused MSA (``vitlab.attention.create('msa', 768, 12)``, SDPA).

    python benchmarks/hilo_cpu.py                 # this machine's ISA
    python benchmarks/hilo_cpu.py --isa avx2      # AVX2 on an AVX-512 machine (re-runs itself with the env below)

``--isa avx2`` sets ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2`` (ATen's
vector kernels, oneDNN and MKL keep to AVX2) and ``TORCHINDUCTOR_CPP_MARCH=x86-64-v3`` (Inductor's generated C++
is built for AVX2 + FMA instead of ``-march=native``); vitlab's kernels follow ATen's capability and build their
AVX2 path (``-mavx2 -mfma``).

Every round times each variant once (``--calls`` forward passes, per-call time), in a rotating order; the
ratios are taken within a round (paired) and summarised by their median and quartiles over the rounds, after
``--warmup`` rounds. Writes ``docs/bench/hilo_cpu_<isa>.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path


def paper_hilo_class():
    """HiLo as the official LITv2 code writes it (ziplab/LITv2, ``classification/hilo.py``): unfused, eager,
    explicit softmax; the same parameter names as vitlab's HiLo, so the same state dict loads."""
    import torch
    import torch.nn as nn

    class PaperHiLo(nn.Module):
        def __init__(self, dim, num_heads=8, qkv_bias=False, qk_scale=None, window_size=2, alpha=0.5):
            super().__init__()
            head_dim = int(dim / num_heads)
            self.dim = dim
            self.l_heads = int(num_heads * alpha)
            self.l_dim = self.l_heads * head_dim
            self.h_heads = num_heads - self.l_heads
            self.h_dim = self.h_heads * head_dim
            self.ws = window_size
            if self.ws == 1:
                self.h_heads, self.h_dim, self.l_heads, self.l_dim = 0, 0, num_heads, dim
            self.scale = qk_scale or head_dim**-0.5
            if self.l_heads > 0:
                if self.ws != 1:
                    self.sr = nn.AvgPool2d(kernel_size=window_size, stride=window_size)
                self.l_q = nn.Linear(self.dim, self.l_dim, bias=qkv_bias)
                self.l_kv = nn.Linear(self.dim, self.l_dim * 2, bias=qkv_bias)
                self.l_proj = nn.Linear(self.l_dim, self.l_dim)
            if self.h_heads > 0:
                self.h_qkv = nn.Linear(self.dim, self.h_dim * 3, bias=qkv_bias)
                self.h_proj = nn.Linear(self.h_dim, self.h_dim)

        def hifi(self, x):
            B, H, W, C = x.shape
            h_group, w_group = H // self.ws, W // self.ws
            total_groups = h_group * w_group
            x = x.reshape(B, h_group, self.ws, w_group, self.ws, C).transpose(2, 3)
            qkv = self.h_qkv(x).reshape(B, total_groups, -1, 3, self.h_heads,
                                        self.h_dim // self.h_heads).permute(3, 0, 1, 4, 2, 5)
            q, k, v = qkv[0], qkv[1], qkv[2]
            attn = (q @ k.transpose(-2, -1)) * self.scale
            attn = attn.softmax(dim=-1)
            attn = (attn @ v).transpose(2, 3).reshape(B, h_group, w_group, self.ws, self.ws, self.h_dim)
            x = attn.transpose(2, 3).reshape(B, h_group * self.ws, w_group * self.ws, self.h_dim)
            return self.h_proj(x)

        def lofi(self, x):
            B, H, W, C = x.shape
            q = self.l_q(x).reshape(B, H * W, self.l_heads, self.l_dim // self.l_heads).permute(0, 2, 1, 3)
            if self.ws > 1:
                x_ = self.sr(x.permute(0, 3, 1, 2)).reshape(B, C, -1).permute(0, 2, 1)
                kv = self.l_kv(x_).reshape(B, -1, 2, self.l_heads, self.l_dim // self.l_heads).permute(2, 0, 3, 1, 4)
            else:
                kv = self.l_kv(x).reshape(B, -1, 2, self.l_heads, self.l_dim // self.l_heads).permute(2, 0, 3, 1, 4)
            k, v = kv[0], kv[1]
            attn = (q @ k.transpose(-2, -1)) * self.scale
            attn = attn.softmax(dim=-1)
            x = (attn @ v).transpose(1, 2).reshape(B, H, W, self.l_dim)
            return self.l_proj(x)

        def forward(self, x, H, W):
            B, N, C = x.shape
            x = x.reshape(B, H, W, C)
            if self.h_heads == 0:
                return self.lofi(x).reshape(B, N, C)
            if self.l_heads == 0:
                return self.hifi(x).reshape(B, N, C)
            return torch.cat((self.hifi(x), self.lofi(x)), dim=-1).reshape(B, N, C)

    return PaperHiLo


def _quartiles(xs: list[float]) -> dict:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return {"median": round(q[1], 4), "q1": round(q[0], 4), "q3": round(q[2], 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--isa", choices=["native", "avx2"], default="native")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--calls", type=int, default=2, help="forward passes per variant per round")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile variants")
    ap.add_argument("--only", default="", help="comma-separated variant names to run (plus paper_eager, msa_eager "
                    "and hilo_eager, the references)")
    ap.add_argument("--out", default=None, help="JSON path (default docs/bench/hilo_cpu_<isa>.json; '-': none)")
    args = ap.parse_args()
    from vitlab.optimize import cpu as cpu_info
    from vitlab.optimize.compiled import compile_inference

    cpu_info.rerun_under(args.isa)

    import torch

    import vitlab.attention as A
    from vitlab.optimize import kernels
    from vitlab.optimize.hilo import swap_hilo

    torch.manual_seed(0)
    dim, heads, H, W, B = 768, 12, 14, 14, args.batch
    hw = (H, W)
    hilo = A.create("hilo", dim, heads).eval()  # s = 2, alpha = 0.9: 10 Lo-Fi, 2 Hi-Fi heads
    paper = paper_hilo_class()(dim, heads, qkv_bias=True, window_size=2, alpha=0.9).eval()
    paper.load_state_dict(hilo.state_dict())
    msa = A.create("msa", dim, heads).eval()
    kern = copy.deepcopy(hilo)
    swapped = swap_hilo(kern)

    variants = {
        "paper_eager": lambda x: paper(x, H, W),
        "msa_eager": lambda x: msa(x, hw),
        "hilo_eager": lambda x: hilo(x, hw),
    }
    if swapped:
        variants["hilo_kernels"] = lambda x: kern(x, hw)
    if not args.no_compile:
        opts = cpu_info.inductor_options()  # as vitlab.optimize's compile backend: freezing, the SIMD width stated
        c_hilo = compile_inference(copy.deepcopy(hilo), opts)
        c_paper = compile_inference(copy.deepcopy(paper), opts)
        c_msa = compile_inference(copy.deepcopy(msa), opts)
        variants["hilo_compiled"] = lambda x: c_hilo(x, hw)
        variants["paper_compiled"] = lambda x: c_paper(x, H, W)
        variants["msa_compiled"] = lambda x: c_msa(x, hw)
        if swapped:  # the kernels are opaque to Dynamo: graph breaks around them, the rest compiled
            c_kern = torch.compile(copy.deepcopy(kern))
            variants["hilo_kernels_compiled"] = lambda x: c_kern(x, hw)
    if args.only:
        keep = {"paper_eager", "msa_eager", "hilo_eager", *args.only.split(",")}
        variants = {k: v for k, v in variants.items() if k in keep}

    x = torch.randn(B, H * W, dim)
    errors, compile_s = {}, {}
    with torch.inference_mode():
        ref = hilo(x, hw)
        for name, fn in variants.items():
            t0 = time.perf_counter()
            out = fn(x)
            compile_s[name] = round(time.perf_counter() - t0, 2)
            if not name.startswith("msa"):
                errors[name] = float((out - ref).abs().max())
        times = {name: [] for name in variants}
        names = list(variants)
        for r in range(args.warmup + args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]  # rotate: no variant always runs first
            for name in order:
                fn = variants[name]
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    fn(x)
                dt = (time.perf_counter() - t0) / args.calls
                if r >= args.warmup:
                    times[name].append(dt)

    res = {}
    for name in names:
        t = times[name]
        res[name] = {
            "img_per_s": _quartiles([B / s for s in t]),
            "speedup_vs_paper_eager": _quartiles([p / s for p, s in zip(times["paper_eager"], t)]),
            "speedup_vs_msa_eager": _quartiles([m / s for m, s in zip(times["msa_eager"], t)]),
        }
        res[name]["speedup_vs_hilo_eager"] = _quartiles([h / s for h, s in zip(times["hilo_eager"], t)])
        if "msa_compiled" in times:
            res[name]["speedup_vs_msa_compiled"] = _quartiles([m / s for m, s in zip(times["msa_compiled"], t)])
        res[name]["max_abs_diff_vs_hilo_eager"] = errors.get(name)
        res[name]["first_call_s"] = compile_s[name]
        res[name]["seconds_per_call"] = [round(s, 5) for s in t]

    cpu = cpu_info.cpu_model()
    meta = {
        "what": "HiLo layer (dim 768, 12 heads, 14x14, s=2, alpha=0.9), fp32 CPU inference, forward only",
        "batch": B, "rounds": args.rounds, "warmup_rounds": args.warmup, "calls_per_round": args.calls,
        "isa_requested": args.isa, "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "env": cpu_info.isa_caps(), "cpu": cpu, "isa": cpu_info.isa(), "threads": torch.get_num_threads(),
        "torch": torch.__version__, "kernels": kernels.status(),
        "command": " ".join(["python", *sys.argv]),
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
    }
    print(f"# {meta['what']}\n# batch {B}, {cpu}, ATen {meta['aten_cpu_capability']}, {meta['threads']} threads, "
          f"torch {torch.__version__}, kernels: {meta['kernels']}")
    print(f"# median [q1, q3] over {args.rounds} paired rounds")
    cols = ["img_per_s", "speedup_vs_paper_eager", "speedup_vs_msa_eager", "speedup_vs_msa_compiled",
            "speedup_vs_hilo_eager"]
    print(f"{'variant':24s}" + "".join(f"{c:>26s}" for c in cols) + f"{'max|diff|':>11s}")
    for name, r in res.items():
        cells = []
        for c in cols:
            q = r.get(c)
            cells.append(f"{q['median']:9.3f} [{q['q1']:.3f}, {q['q3']:.3f}]" if q else "-")
        diff = r["max_abs_diff_vs_hilo_eager"]
        print(f"{name:24s}" + "".join(f"{c:>26s}" for c in cells) + (f"{diff:11.1e}" if diff is not None else ""))
    isa_name = "avx2" if args.isa == "avx2" else meta["aten_cpu_capability"].lower()
    out = args.out or f"docs/bench/hilo_cpu_{isa_name}.json"
    if out != "-":
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps({"meta": meta, "results": res}, indent=1) + "\n")
        print(f"# wrote {out}")


if __name__ == "__main__":
    main()
