"""Per-component runtime of transformer blocks (LeViT supplementary, Graham et al., 2021, Appendix A.1 and Table 1).

Table 1 times a DeiT-tiny block (C = 192, 3 heads of D = 64, GELU replaced by Hardswish "as otherwise it
dominates the runtime") against a LeViT-256 stage-1 block (C = 256, 4 heads of key dim D = 32, value dim 64,
MLP ratio 2) at 14 x 14 resolution on one CPU core, batch 1. :func:`levit_table1` does the same here: the
blocks of ``create_model('deit_tiny_patch16_224', act_layer='hardswish')`` (197 tokens: 14 x 14 patches + the
class token) and ``create_model('levit_256')`` with its BatchNorms folded (``fuse()``, its inference form; 196
tokens), one thread, each component run on its own with the block's real weights and inputs:

==========================  =================================================  =================================
row                         DeiT block                                         LeViT block
==========================  =================================================  =================================
LayerNorm                   norm1 + norm2                                      n/a (no LayerNorm)
Keys Q, K                   the Q and K rows of ``qkv``                        the Q and K rows of ``qkv``
Values V                    the V rows of ``qkv``                              the V rows of ``qkv``
Product QK^T                ``softmax(q k^T / sqrt(D))``                       ``softmax(q k^T / sqrt(D) + B)``
Product Attention AV        ``A v``                                            ``A v``
Attention projection        ``proj``                                           Hardswish + ``proj``
MLP                         fc1 + Hardswish + fc2                              ln1 + Hardswish + ln2
==========================  =================================================  =================================

The softmax (and LeViT's bias) is counted with QK^T, the table has no row for it. The components and the
whole block are timed round-robin in one loop (:func:`vitlab.timing.round_robin_times`), medians of
``runs`` >= 50 after warm-up; ``sum / total`` says how much the block spends outside the rows (residual adds,
reshapes, head split). :func:`block_timings` times the leaf modules of any block the same way.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from vitlab.timing import round_robin_times

# LeViT supplementary, Table 1: microseconds on an Intel Xeon E5-2698 CPU core, batch 1
PAPER_TABLE1 = {
    "deit_tiny": {"LayerNorm": 49, "Keys Q, K": 299, "Values V": 172, "Product QK^T": 228,
                  "Product Attention AV": 161, "Attention projection": 175, "MLP": 1390, "Total": 2474},
    "levit_256": {"LayerNorm": None, "Keys Q, K": 275, "Values V": 275, "Product QK^T": 159,
                  "Product Attention AV": 206, "Attention projection": 310, "MLP": 1140, "Total": 2365},
}
ROWS = ("LayerNorm", "Keys Q, K", "Values V", "Product QK^T", "Product Attention AV", "Attention projection", "MLP")


@contextlib.contextmanager
def _threads(n: int | None):
    old = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _time_round_robin(fns: dict[str, Callable[[], object]], warmup: int, runs: int) -> dict[str, dict]:
    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs}")
    with torch.inference_mode():
        times = round_robin_times(fns, torch.device("cpu"), warmup=warmup, runs=runs)
    out = {}
    for k, t in times.items():
        us = sorted(v * 1e6 for v in t)
        out[k] = {"median_us": statistics.median(us), "min_us": us[0], "p10_us": us[len(us) // 10],
                  "p90_us": us[(9 * len(us)) // 10]}
    return out


def _vit_components(blk: nn.Module, x: torch.Tensor) -> dict[str, Callable[[], object]]:
    """Table 1's rows for a pre-norm ``vitlab.attention.Block`` with ``msa`` attention; x (B, N, C)."""
    at = blk.attn
    B, N, C = x.shape
    h, d = at.num_heads, at.head_dim
    w, b = at.qkv.weight, at.qkv.bias
    y = blk.norm1(x)
    q, k, v = at.qkv(y).reshape(B, N, 3, h, d).permute(2, 0, 3, 1, 4).unbind(0)
    a = ((q * at.scale) @ k.transpose(-2, -1)).softmax(-1)
    o = (a @ v).transpose(1, 2).reshape(B, N, C)
    z = blk.norm2(x)
    return {
        "LayerNorm": lambda: (blk.norm1(x), blk.norm2(x)),
        "Keys Q, K": lambda: F.linear(y, w[: 2 * C], None if b is None else b[: 2 * C]),
        "Values V": lambda: F.linear(y, w[2 * C:], None if b is None else b[2 * C:]),
        "Product QK^T": lambda: ((q * at.scale) @ k.transpose(-2, -1)).softmax(-1),
        "Product Attention AV": lambda: a @ v,
        "Attention projection": lambda: at.proj(o),
        "MLP": lambda: blk.mlp(z),
    }


def _levit_components(blk: nn.Module, x: torch.Tensor) -> dict[str, Callable[[], object]]:
    """Table 1's rows for a BatchNorm-folded ``LevitBlock`` (its ``qkv`` packs [q, k, v] per head)."""
    at = blk.attn
    B, N, _ = x.shape
    h, kd, vd = at.num_heads, at.key_dim, at.val_dim
    per = 2 * kd + vd
    rows = torch.arange(h * per).view(h, per)
    qk_rows, v_rows = rows[:, : 2 * kd].flatten(), rows[:, 2 * kd:].flatten()
    w, b = at.qkv.weight, at.qkv.bias
    w_qk, b_qk, w_v, b_v = w[qk_rows], b[qk_rows], w[v_rows], b[v_rows]  # contiguous copies: one GEMM each
    q, k, v = at.qkv(x).view(B, N, h, -1).transpose(1, 2).split([kd, kd, vd], dim=3)
    bias = at.get_attention_biases()
    a = ((q * at.scale) @ k.transpose(-2, -1) + bias).softmax(-1)
    o = (a @ v).transpose(1, 2).reshape(B, N, h * vd)
    return {
        "Keys Q, K": lambda: F.linear(x, w_qk, b_qk),
        "Values V": lambda: F.linear(x, w_v, b_v),
        "Product QK^T": lambda: ((q * at.scale) @ k.transpose(-2, -1) + at.get_attention_biases()).softmax(-1),
        "Product Attention AV": lambda: a @ v,
        "Attention projection": lambda: at.proj(o),
        "MLP": lambda: blk.mlp(x),
    }


def _check_levit_fused(blk: nn.Module) -> None:
    if not isinstance(blk.attn.qkv, nn.Linear):
        raise ValueError("time a LeViT block in its inference form: call model.fuse() first (BatchNorms folded)")


def component_timings(blk: nn.Module, x: torch.Tensor, warmup: int = 10, runs: int = 100,
                      threads: int | None = 1) -> dict:
    """Table 1's rows (microseconds, median / p10 / p90) and the whole block for a ViT ``Block`` (msa) or a
    fused ``LevitBlock``, on input ``x`` (B, N, C). ``threads``: torch intra-op threads while timing."""
    from vitlab.attention import Block, MultiHeadSelfAttention
    from vitlab.models import LevitBlock

    blk = blk.eval()
    with torch.inference_mode(), _threads(threads):
        if isinstance(blk, Block) and type(blk.attn) is MultiHeadSelfAttention:
            fns = _vit_components(blk, x)
        elif isinstance(blk, LevitBlock):
            _check_levit_fused(blk)
            fns = _levit_components(blk, x)
        else:
            raise ValueError(f"Table 1's components are defined for a ViT Block with msa attention and a LeViT "
                             f"block, not {type(blk).__name__}; block_timings() times any block's modules")
        fns["Total"] = lambda: blk(x)
        t = _time_round_robin(fns, warmup, runs)
    return {"tokens": x.shape[1], "dim": x.shape[2], "threads": threads, "runs": runs, **_summary(t)}


def _summary(t: dict[str, dict]) -> dict:
    """Medians (Table 1's statistic) with their p10-p90 spread, and the fastest run of each: on a shared machine
    a long run is preempted more often than a short one, so the fastest runs compare the components with the
    whole block more fairly than the medians do."""
    comp = {k: v["median_us"] for k, v in t.items() if k != "Total"}
    comp_min = {k: v["min_us"] for k, v in t.items() if k != "Total"}
    total, total_min = t["Total"]["median_us"], t["Total"]["min_us"]
    return {"components_us": comp, "total_us": total, "sum_us": sum(comp.values()),
            "sum_over_total": sum(comp.values()) / total,
            "spread_us": {k: [v["p10_us"], v["p90_us"]] for k, v in t.items()},
            "components_min_us": comp_min, "total_min_us": total_min,
            "sum_over_total_min": sum(comp_min.values()) / total_min}


def levit_table1(warmup: int = 10, runs: int = 100, threads: int | None = 1, seed: int = 0) -> dict:
    """LeViT supplementary Table 1 measured here, beside the paper's numbers (random-init weights: timing does not
    depend on their values). Returns {'deit_tiny': {...}, 'levit_256': {...}, 'paper': PAPER_TABLE1}, each with
    :func:`component_timings`' fields."""
    import vitlab

    if runs < 50:
        raise ValueError(f"Table 1 is a median of >= 50 runs; got runs={runs}")
    torch.manual_seed(seed)
    deit = vitlab.create_model("deit_tiny_patch16_224", act_layer="hardswish").eval()
    levit = vitlab.create_model("levit_256").eval().fuse()
    x_deit = torch.randn(1, 197, 192)  # 14 x 14 patches + the class token
    x_levit = torch.randn(1, 196, 256)  # 14 x 14, LeViT-256 stage 1
    out = {"deit_tiny": component_timings(deit.blocks[0], x_deit, warmup, runs, threads),
           "levit_256": component_timings(levit.stages[0].blocks[0], x_levit, warmup, runs, threads)}
    for key in ("components_us", "components_min_us"):  # LeViT has no LayerNorm: Table 1's "n/a"
        out["levit_256"][key] = {"LayerNorm": None, **out["levit_256"][key]}
    out["paper"] = PAPER_TABLE1
    return out


def block_timings(model: nn.Module, x: torch.Tensor, block: int = 0, warmup: int = 10, runs: int = 100,
                  threads: int | None = 1) -> dict:
    """Any model: the ``block``-th ``blocks.<i>`` module's leaf modules (linears, norms, activations, ...) each
    on its own recorded input, and the whole block; microseconds, median of ``runs``. ``rest_us`` is what the
    block spends outside its leaf modules (attention products and softmax, residual adds, reshapes). ``x`` is
    the model input (the block's own input is recorded in one forward)."""
    from vitlab.analysis._common import pick
    from vitlab.analysis.spectrum import find_blocks

    blocks = find_blocks(model)
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no modules named blocks.<i> to time")
    name, blk = pick(blocks, block, "block", "blocks")
    calls: dict[str, tuple] = {}

    def keep(key):
        def hook(mod, args, kwargs):
            calls.setdefault(key, (mod, args, kwargs))
        return hook

    handles = [blk.register_forward_pre_hook(keep(""), with_kwargs=True)]
    for n, m in blk.named_modules():
        if n and not list(m.children()) and not isinstance(m, (nn.Dropout, nn.Identity)):
            handles.append(m.register_forward_pre_hook(keep(n), with_kwargs=True))
    model.eval()
    try:
        with torch.inference_mode():
            model(x)
    finally:
        for h in handles:
            h.remove()
    fns = {(k or "Total"): (lambda m=m, a=a, kw=kw: m(*a, **kw)) for k, (m, a, kw) in calls.items()}
    with _threads(threads):
        t = _time_round_robin(fns, warmup, runs)
    out = {"block": name, "threads": threads, "runs": runs, **_summary(t)}
    out["rest_us"] = out["total_us"] - out["sum_us"]
    return out
