"""``vitlab bench ladder``: the "optimization ladder" of Mboya's "Scaling ViTs across Training Compute" for training
one model, one rung at a time.

Rungs (each adds to the one before): fp32 eager (explicit-softmax attention) -> bf16 autocast -> fused
attention (SDPA) -> ``torch.compile`` -> channels-last and fused AdamW -> activation checkpointing at the
largest batch that fits -> FSDP2 over 2 processes (gloo on CPU, NCCL with >= 2 GPUs).

Every rung runs in a fresh process, so its peak memory is its own (CUDA: ``max_memory_allocated``; CPU: the
growth of the process's peak resident set while building and training the model) and no compile cache or
allocator state leaks from one rung into the next. Beside the measured peak we print the article's estimate
``M = P * 4 B / (32 / Q) * 1.2`` — an estimate of the memory to *serve* the weights at Q bits, so training
(weights + gradients + AdamW state + activations) must exceed it; the gap is the point of the ladder.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import resource
import socket
from dataclasses import asdict, dataclass, replace

import torch

from vitlab import _io
from vitlab.bench.timing import matmul_peak_tflops
from vitlab.profile import memory_estimate_gb, profile_model
from vitlab.timing import median_time


@dataclass(frozen=True)
class Rung:
    name: str
    bf16: bool = False
    fused_attn: bool = True
    compile: bool = False
    channels_last: bool = False
    fused_optimizer: bool = False
    grad_checkpointing: bool = False
    largest_batch: bool = False
    fsdp_procs: int = 0


def default_rungs() -> list[Rung]:
    r0 = Rung("fp32 eager", fused_attn=False)
    r1 = replace(r0, name="bf16 autocast", bf16=True)
    r2 = replace(r1, name="+ fused attention", fused_attn=True)
    r3 = replace(r2, name="+ torch.compile", compile=True)
    r4 = replace(r3, name="+ channels-last, fused AdamW", channels_last=True, fused_optimizer=True)
    r5 = replace(r4, name="+ activation checkpointing, largest batch", grad_checkpointing=True, largest_batch=True)
    r6 = replace(r2, name="FSDP2, 2 processes", fsdp_procs=2)
    return [r0, r1, r2, r3, r4, r5, r6]


def _set_fused_attention(model: torch.nn.Module, enabled: bool) -> None:
    for m in model.modules():
        if hasattr(m, "fused_attn"):
            m.fused_attn = enabled


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _train_steps(name: str, rung: Rung, device: torch.device, batch_size: int, warmup: int, runs: int,
                 rank_world: tuple[int, int] = (0, 1)) -> dict:
    """Build the model, train ``warmup + runs`` steps on random data, return the timing and memory."""
    import vitlab

    rank, world = rank_world
    base_rss = _current_rss_mb()  # the peak from here on is what building and training the model adds
    torch.manual_seed(0)
    model = vitlab.create_model(name)
    _set_fused_attention(model, rung.fused_attn)
    if rung.grad_checkpointing:
        model.set_grad_checkpointing(True)
    model = model.to(device)
    if rung.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if rung.fsdp_procs:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if rung.bf16 else None,
                                         reduce_dtype=torch.float32)
        for blk in getattr(model, "blocks", []):
            fully_shard(blk, mp_policy=mp_policy)
        fully_shard(model, mp_policy=mp_policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=rung.fused_optimizer or None)
    step_model = torch.compile(model) if rung.compile else model
    cfg = vitlab.get_model_config(name)
    local = batch_size // world
    x = torch.randn(local, *cfg.input_size, device=device)
    if rung.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, cfg.num_classes, (local,), device=device)
    autocast_bf16 = rung.bf16 and not rung.fsdp_procs  # FSDP2's policy casts the parameters itself
    model.train()

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast_bf16):
            out = step_model(x)
        outs = out if isinstance(out, tuple) else (out,)
        loss = sum(torch.nn.functional.cross_entropy(o.float(), y) for o in outs) / len(outs)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds = median_time(step, device, warmup=warmup, runs=runs)
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else _peak_rss_mb() - base_rss
    return {"step_s": seconds, "peak_mem_mb": peak, "batch_size": local * world, "rank": rank}


def _child(queue, name, rung, device, batch_size, warmup, runs) -> None:
    try:
        queue.put(_train_steps(name, rung, torch.device(device), batch_size, warmup, runs))
    except torch.cuda.OutOfMemoryError:
        queue.put({"error": "out of memory"})
    except Exception as e:  # reported in the row; the ladder goes on with the next rung
        queue.put({"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"})


def _fsdp_child(rank, world, port, queue, name, rung, device, batch_size, warmup, runs) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    backend = "nccl" if device == "cuda" else "gloo"
    dev = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
    if device == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        res = _train_steps(name, rung, dev, batch_size, warmup, runs, (rank, world))
        if rank == 0:
            queue.put(res)
    except Exception as e:
        if rank == 0:
            queue.put({"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"})
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_rung(name, rung, device, batch_size, warmup, runs) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    if rung.fsdp_procs:
        if device == "cuda" and torch.cuda.device_count() < rung.fsdp_procs:
            return {"error": f"needs {rung.fsdp_procs} GPUs, this machine has {torch.cuda.device_count()}"}
        port = _free_port()
        procs = [ctx.Process(target=_fsdp_child, args=(r, rung.fsdp_procs, port, queue, name, rung, device,
                                                         batch_size, warmup, runs)) for r in range(rung.fsdp_procs)]
    else:
        procs = [ctx.Process(target=_child, args=(queue, name, rung, device, batch_size, warmup, runs))]
    for p in procs:
        p.start()
    result = queue.get()
    for p in procs:
        p.join()
    return result


def _largest_batch(name, rung, device, batch_size, warmup, runs) -> tuple[dict, str]:
    """Double the batch until it no longer fits (CUDA), at most 16x; on the CPU there is no ceiling to probe,
    so the rung runs at twice the base batch."""
    if device != "cuda":
        return _run_rung(name, rung, device, 2 * batch_size, warmup, runs), "CPU: 2x batch, no memory ceiling"
    best, bs = None, batch_size
    while bs <= 16 * batch_size:
        res = _run_rung(name, rung, device, bs, warmup, runs)
        if "error" in res:
            break
        best, bs = res, 2 * bs
    if best is None:
        return res, "nothing fit"
    capped = best["batch_size"] >= 16 * batch_size
    return best, f"largest batch that fit: {best['batch_size']}" + (" (the 16x cap)" if capped else "")


def bench_ladder(name: str, device: str = "cpu", batch_size: int = 8, warmup: int = 2, runs: int = 5,
                 rungs: list[Rung] | None = None, progress: bool = True) -> list[dict]:
    """Climb the ladder for model ``name``; one row per rung."""
    import vitlab

    vitlab.get_model_config(name)  # a clear error for a bad name before spawning anything
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda asked for, but no CUDA device is available")
    prof = profile_model(name)
    dev = torch.device(device)
    peaks = {dt: matmul_peak_tflops(dev, dt) for dt in (torch.float32, torch.bfloat16)}
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    rows = []
    rungs = rungs or default_rungs()
    cols = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*cols, disable=not progress, transient=True) as bar:
        task = bar.add_task("ladder", total=len(rungs))
        for rung in rungs:
            bar.update(task, description=f"{name}: {rung.name}")
            if rung.largest_batch:
                res, note = _largest_batch(name, rung, device, batch_size, warmup, runs)
            else:
                res, note = _run_rung(name, rung, device, batch_size, warmup, runs), ""
            bits = 16 if rung.bf16 else 32
            row = {"rung": rung.name, "model": name, "device": device, "config": asdict(rung),
                   "memory_estimate_mb": round(memory_estimate_gb(int(prof.params_m * 1e6), bits) * 1e9 / 2**20, 1),
                   "note": note}
            if "error" in res:
                row.update(error=res["error"], img_per_s=None, peak_mem_mb=None, util=None, batch_size=None)
            else:
                tflops = 3 * 2 * prof.gmacs * 1e9 * res["batch_size"] / res["step_s"] / 1e12
                peak = peaks[torch.bfloat16 if rung.bf16 else torch.float32]
                row.update(batch_size=res["batch_size"], img_per_s=round(res["batch_size"] / res["step_s"], 2),
                           step_ms=round(res["step_s"] * 1e3, 2), peak_mem_mb=round(res["peak_mem_mb"], 1),
                           tflops=round(tflops, 4), util=round(tflops / peak, 4))
            rows.append(row)
            bar.advance(task)
    return rows


def write_json(rows: list[dict], path) -> None:
    _io.write_json(path, {"benchmark": "ladder", "torch": torch.__version__, "rows": rows})


def plot(rows: list[dict], path) -> None:
    """Bars of training images/s per rung, with the peak memory written on each bar."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 4.5))
    ax = fig.subplots()
    names = [r["rung"] for r in rows]
    vals = [r["img_per_s"] or 0 for r in rows]
    bars = ax.barh(names[::-1], vals[::-1], color="tab:blue")
    for b, r in zip(bars, rows[::-1]):
        label = r.get("error") or f"{r['img_per_s']:.1f} img/s, {r['peak_mem_mb']:.0f} MB, batch {r['batch_size']}"
        ax.text(b.get_width(), b.get_y() + b.get_height() / 2, " " + label, va="center", fontsize=8)
    ax.set_xlabel("training images / s")
    if rows:
        ax.set_title(f"optimization ladder: {rows[0]['model']} on {rows[0]['device']}")
    ax.set_xlim(0, max(vals + [1]) * 1.6)
    _io.write_png(path, fig, dpi=120)


def format_table(rows: list[dict]):
    from rich.table import Table

    t = Table(title="optimization ladder (training; the estimate M = P x 4B / (32/Q) x 1.2 serves weights only)")
    for c in ("rung", "batch", "img/s", "step ms", "peak MB", "estimate MB", "TFLOP/s", "util", "note"):
        t.add_column(c, justify="left" if c in ("rung", "note") else "right", no_wrap=c == "rung")
    for r in rows:
        if r.get("error"):
            t.add_row(r["rung"], "-", "-", "-", "-", f"{r['memory_estimate_mb']:.0f}", "-", "-", r["error"])
            continue
        t.add_row(r["rung"], str(r["batch_size"]), f"{r['img_per_s']:.1f}", f"{r['step_ms']:.0f}",
                  f"{r['peak_mem_mb']:.0f}", f"{r['memory_estimate_mb']:.0f}", f"{r['tflops']:.3f}",
                  f"{r['util']:.1%}", r["note"])
    return t
