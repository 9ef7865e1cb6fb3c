"""Timing honestly: synchronised wall-clock medians after warm-up, paired A/B timing and round robins (the
ratios of runs taken moments apart cancel the drift of a noisy, shared machine). Shared by ``vitlab bench``,
``vitlab analyze`` and the scripts under ``benchmarks/``."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_once(fn: Callable[[], object], device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def check_counts(batch_size: int, warmup: int, runs: int) -> None:
    """Refuse in one line a batch size or a number of timed runs below 1, or a negative warmup: they would
    time nothing (or fail deep inside a model on an empty batch)."""
    for name, value, least in (("batch size", batch_size, 1), ("runs", runs, 1), ("warmup", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")


def median_time(fn: Callable[[], object], device: torch.device, warmup: int = 3, runs: int = 10) -> float:
    """Median seconds of ``fn()`` over ``runs`` timed calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    return statistics.median(time_once(fn, device) for _ in range(runs))


def paired_times(fn_a: Callable[[], object], fn_b: Callable[[], object], device: torch.device, warmup: int = 3,
                 runs: int = 10) -> tuple[float, float, float]:
    """Alternate A and B in one process; return (median A s, median B s, median of the per-pair B/A ratios).

    Pairing cancels the drift of a noisy machine: each ratio compares two runs taken moments apart."""
    for _ in range(warmup):
        fn_a()
        fn_b()
    ta, tb = [], []
    for i in range(runs):  # alternate which goes first, so neither always runs on a warmer cache
        first, second = (fn_a, fn_b) if i % 2 == 0 else (fn_b, fn_a)
        t1, t2 = time_once(first, device), time_once(second, device)
        a, b = (t1, t2) if i % 2 == 0 else (t2, t1)
        ta.append(a)
        tb.append(b)
    return statistics.median(ta), statistics.median(tb), statistics.median(b / a for a, b in zip(ta, tb))


def round_robin_times(fns: dict[str, Callable[[], object]], device: torch.device, warmup: int = 3,
                      runs: int = 10) -> dict[str, list[float]]:
    """Every run calls each of ``fns`` once, the order reversed every other run (no implementation always runs
    on a warmer cache); returns each one's per-run seconds. Ratios of the same run are paired: they compare
    calls taken moments apart, which cancels the drift of a noisy, shared machine."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    order = list(fns.items())
    for i in range(runs):
        for name, fn in order if i % 2 == 0 else order[::-1]:
            times[name].append(time_once(fn, device))
    return times


def paired_ratio(times: dict[str, list[float]], ours: str, peer: str) -> tuple[float, float, float]:
    """(median, min, max) over the runs of ``peer``'s time / ``ours``'s time (> 1: ours is faster)."""
    r = [b / a for a, b in zip(times[ours], times[peer])]
    return statistics.median(r), min(r), max(r)
