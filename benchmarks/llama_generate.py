"""Generation speed of vitlab's Llama against transformers' ``LlamaForCausalLM.generate``, same weights, one
process: prefill and decode tokens/s, eager and optimized.

A ~100M-parameter Llama (``llama_100m``: dim 640, 12 layers, vocabulary 32,000) with random weights, fp32 on the
CPU by default (``--model``, ``--device``, ``--dtype`` for others: ``llama2_7b`` in bf16 on a GPU);
transformers' model is built from the same config, directly on the device in the dtype, and ours loads its
state dict (Touvron et al., 2023, "Llama 2"). For each batch size, every implementation generates N tokens
greedily from the same random prompts, never stopping early (random weights can emit the end-of-sequence id:
ours get ``eos_token_id=[]``, transformers ``eos_token_id=None`` and ``min_new_tokens=N``); each call is split
where its first token's logits exist (ours: the ``on_token`` callback; transformers': a logits processor, called
before its sampling, so the split favours it slightly): the prefill is the time to there, the decoding the time
from there to the last token's logits (on a GPU the benchmark synchronises the device at those two points only).
The calls of all implementations alternate
(round robin, order reversed every other run) after warm-up, and the figures are medians: prefill tokens/s =
batch x prompt / prefill, decode tokens/s = batch x (N - 1) / decoding. The ratios are transformers' time / ours
in the same run (medians, with their min-max over the runs; > 1: ours is faster). Whether each generated the
same tokens as transformers is recorded (in fp32 they do; in bf16 rounding can part greedy paths).

Implementations: ``vitlab`` (eager), ``vitlab_compiled`` (``vitlab.optimize.optimize(model)``, which for a Llama is
:func:`vitlab.optimize.llama.compile_llama`: prefill and decoding step compiled by Inductor with frozen weights, in
fp32 on the CPU the prompt's attention on vitlab's fused causal kernel and the linear layers' GEMMs on the fastest
of MKL's, oneDNN's and vitlab's packed kernel, measured at the first prompt and the first decoding step (recorded
as the row's ``gemm``), and a :class:`~vitlab.optimize.llama.CompiledLlama` that keeps its KV cache between calls),
``hf`` (eager, its dynamic cache), and with ``--hf-static`` ``hf_static`` (transformers' static cache with its own
``torch.compile`` of the decoding step: ``CompileConfig`` with its defaults, allowed on the CPU).

The targets: ``vitlab`` / ``hf`` >= 1.0 (eager against eager) and ``vitlab_compiled`` >= 1.3 (optimized).
``summary`` in the JSON states each ratio with its denominator: the optimized one against transformers eager
(``hf``, the target's denominator) and, with ``--hf-static``, against transformers' own compiled static-cache
generation (``hf_static``).

    python benchmarks/llama_generate.py --json llama_generate_cpu.json            # the figure (minutes)
    python benchmarks/llama_generate.py --model llama2_7b --device cuda --dtype bf16 --runs 3 \\
        --json llama2_7b_generate_cuda_bf16.json                                    # Llama-2-7B on a GPU
    python benchmarks/llama_generate.py --model llama_tiny --prompt-len 8 --new-tokens 4 --warmup 0 --runs 1 \\
        --batch-sizes 1 2 --no-compile                                              # smoke check (seconds)
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

import torch

import vitlab
from vitlab.bench.models import DTYPES
from vitlab.models.llama import Llama, hf_to_llama_state_dict, llama_to_hf_config
from vitlab.optimize.cpu import cpu_model, isa
from vitlab.timing import check_counts


def _models(cfg, device: torch.device, dtype: torch.dtype):
    """transformers' model with random weights, made on ``device`` in ``dtype`` (a 7B model is never
    materialised in fp32 on the host), and ours with the same weights."""
    import transformers

    hf_cfg = {k: v for k, v in llama_to_hf_config(cfg).items() if k not in ("architectures", "model_type")}
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_cfg)).eval()
    finally:
        torch.set_default_dtype(default)
    with torch.device("meta"):
        ours = Llama(cfg).to(dtype)
    ours.to_empty(device=device)
    ours.load_state_dict(hf_to_llama_state_dict(hf.state_dict(), cfg))
    ours.reset_rope(device)  # the RoPE table is not in the state dict; computed in fp32
    return hf, ours.eval()


TARGETS = {"eager": 1.0, "optimized": 1.3}
IMPLS = {
    "vitlab": "vitlab Llama.generate, eager (preallocated KV cache)",
    "vitlab_compiled": "vitlab.optimize.optimize(model, backend='compile'): prefill and decoding step compiled by "
                       "Inductor, weights frozen and prepacked, C++ wrapper, the prompt's attention on vitlab's fused "
                       "CPU kernel (fp32), the linear layers' GEMMs on the fastest of MKL's, oneDNN's and vitlab's "
                       "packed kernel as measured at each phase's first call (fp32 CPU; the row's 'gemm'); the KV "
                       "cache kept between calls",
    "hf": "transformers LlamaForCausalLM.generate, eager (its dynamic cache): the denominator of both targets",
    "hf_static": "transformers generate with cache_implementation='static' and its CompileConfig defaults, "
                 "allowed on the CPU (_compile_all_devices): transformers' own compiled decoding",
}


def _summary(rows: list[dict], impls: list[str]) -> list[dict]:
    """Each target ratio, per batch size and phase, with what it divides: ``ours`` is vitlab's implementation,
    ``denominator`` transformers'."""
    pairs = [("eager", "vitlab", "hf")]
    if "vitlab_compiled" in impls:
        pairs += [("optimized", "vitlab_compiled", "hf")] + (
            [("optimized", "vitlab_compiled", "hf_static")] if "hf_static" in impls else [])
    out = []
    for kind, ours, peer in pairs:
        for r in rows:
            if r["impl"] != ours:
                continue
            for phase in ("prefill", "decode"):
                ratio = r[f"{phase}_vs_{peer}"]
                lo, hi = r[f"{phase}_vs_{peer}_range"]
                out.append(dict(target=kind, ours=ours, denominator=peer, batch_size=r["batch_size"], phase=phase,
                                ratio=round(ratio, 3), min=round(lo, 3), max=round(hi, 3), goal=TARGETS[kind],
                                met=ratio >= TARGETS[kind]))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama_100m")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--no-compile", action="store_true", help="eager only (a quick check)")
    ap.add_argument("--hf-static", action="store_true", help="also transformers with its static cache")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    for b in args.batch_sizes:
        check_counts(b, args.warmup, args.runs)
    if args.new_tokens < 2:
        raise SystemExit("--new-tokens must be at least 2 (decode speed is measured past the first token)")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with torch.device("meta"):
        cfg = vitlab.create_model(args.model).config
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    cuda = device.type == "cuda"
    hf, ours = _models(cfg, device, DTYPES[args.dtype])
    from transformers import LogitsProcessorList
    params = sum(p.numel() for p in ours.parameters())
    fast = None
    if not args.no_compile:
        from vitlab.optimize import optimize

        fast = optimize(ours, backend="compile")

    stamps: list[float] = []  # when each new token's logits exist, in the current call

    def stamp(*a):
        if cuda and (not stamps or len(stamps) == args.new_tokens - 1):
            torch.cuda.synchronize()  # the first and the last token only: the split points
        stamps.append(time.perf_counter())
        return a[1] if len(a) == 2 else None  # as transformers' logits processor: the scores unchanged

    def gen(impl: str, ids: torch.Tensor, n: int):
        def call():
            with torch.no_grad():  # exactly n tokens on every side: no stop at the config's eos (eos_token_id=[])
                if impl == "vitlab":
                    return ours.generate(ids, n, eos_token_id=[], on_token=stamp)
                if impl == "vitlab_compiled":
                    return fast.generate(ids, n, eos_token_id=[], on_token=stamp)
                extra = {}
                if impl == "hf_static":
                    from transformers import CompileConfig

                    config = CompileConfig()
                    config._compile_all_devices = True  # transformers compiles on accelerators only unless told
                    extra = {"cache_implementation": "static", "compile_config": config}
                return hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                                   pad_token_id=0, attention_mask=torch.ones_like(ids),
                                   logits_processor=LogitsProcessorList([stamp]), **extra)[:, ids.shape[1]:]
        return call

    def split(call) -> tuple[float, float]:
        """(prefill s, decoding s) of one call."""
        stamps.clear()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        if len(stamps) != args.new_tokens:
            raise RuntimeError(f"expected {args.new_tokens} token times, got {len(stamps)}")
        return stamps[0] - t0, stamps[-1] - stamps[0]

    impls = ["vitlab", "hf"] + ([] if args.no_compile else ["vitlab_compiled"]) + (
        ["hf_static"] if args.hf_static else [])
    rows = []
    for b in args.batch_sizes:
        ids = torch.randint(3, cfg.vocab_size, (b, args.prompt_len)).to(device)
        outs = {impl: gen(impl, ids, args.new_tokens)() for impl in impls}
        same = {impl: bool(torch.equal(outs[impl], outs["hf"])) for impl in impls}
        calls = {i: gen(i, ids, args.new_tokens) for i in impls}
        for _ in range(args.warmup):  # after the first call above, which built the compiled graphs
            for call in calls.values():
                call()
        t1: dict[str, list[float]] = {i: [] for i in impls}
        tn: dict[str, list[float]] = {i: [] for i in impls}
        for r in range(args.runs):
            for impl in impls if r % 2 == 0 else impls[::-1]:
                p, d = split(calls[impl])
                t1[impl].append(p)
                tn[impl].append(d)
        for impl in impls:
            p = statistics.median(t1[impl])
            d = statistics.median(tn[impl])
            row = dict(impl=impl, batch_size=b, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                       prefill_s=p, decode_s=d, prefill_tok_s=b * args.prompt_len / p,
                       decode_tok_s=b * (args.new_tokens - 1) / d, same_tokens_as_hf=same[impl])
            # paired ratios: transformers' time / ours in the same run (> 1: ours is faster)
            for peer in ("hf", "hf_static"):
                if peer in impls:
                    for phase, t in (("prefill", t1), ("decode", tn)):
                        ratios = [h / o for o, h in zip(t[impl], t[peer])]
                        row[f"{phase}_vs_{peer}"] = statistics.median(ratios)
                        row[f"{phase}_vs_{peer}_range"] = [min(ratios), max(ratios)]
            if impl == "vitlab_compiled":  # which GEMM each phase ran (chosen by measurement at its first call)
                row["gemm"] = {phase: fast.compiled.gemms.get((b, prompt))  # None: no choice (not fp32 CPU)
                               for phase, prompt in (("prefill", True), ("decode", False))}
            rows.append(row)
    result = dict(benchmark="llama_generate", model=args.model, params=params,
                  dtype=str(DTYPES[args.dtype]).removeprefix("torch."),
                  device=torch.cuda.get_device_name(device) if cuda else "cpu", cpu=cpu_model(), isa=isa(),
                  threads=torch.get_num_threads(), torch=torch.__version__,
                  transformers=__import__("transformers").__version__, python=platform.python_version(),
                  warmup=args.warmup, runs=args.runs, rows=rows, implementations={i: IMPLS[i] for i in impls},
                  summary=_summary(rows, impls))
    where = result["device"] if cuda else f"{result['cpu']} ({result['isa']}), {result['threads']} threads"
    print(f"{args.model} ({params / 1e6:.1f}M params), {result['dtype']}, {where}; prompt {args.prompt_len}, "
          f"{args.new_tokens} new tokens, medians of "
          f"{args.runs} runs")
    print(f"{'impl':<16}{'batch':>6}{'prefill tok/s':>15}{'decode tok/s':>14}{'prefill x':>11}{'decode x':>10}"
          f"{'same tokens':>13}")
    for r in rows:
        print(f"{r['impl']:<16}{r['batch_size']:>6}{r['prefill_tok_s']:>15.1f}{r['decode_tok_s']:>14.1f}"
              f"{r['prefill_vs_hf']:>11.2f}{r['decode_vs_hf']:>10.2f}{str(r['same_tokens_as_hf']):>13}")
    for s in result["summary"]:
        print(f"{s['target']:<10} {s['ours']} / {s['denominator']:<10} batch {s['batch_size']} {s['phase']:<8}"
              f"{s['ratio']:6.2f}x [{s['min']:.2f}-{s['max']:.2f}] (goal {s['goal']}x: "
              f"{'met' if s['met'] else 'NOT met'})")
    if args.json:
        from vitlab._io import write_json

        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
