"""The studies of the LITv2 / HiLo supplementary (Pan et al., 2022), re-run on the machine at hand.

* :func:`window_study`, Table II (Section C): LITv2-S with HiLo window size s = 2 .. 7 in stage 3
  (``local_ws=(0, 0, s, 1)``): parameters, GMACs (counted on the padded maps the windows really use, so the
  padding cost the paper mentions is included), inference throughput, train / test peak memory and, given a
  dataset and a number of epochs, test top-1 after training with ``vitlab.train.fit``.
* :func:`pooled_queries_study`, Table III (Section D): LITv2-S against
  ``create_model('litv2_s', pooled_queries=True)`` (Lo-Fi queries from the pooled map, output resized back
  bilinearly): parameters, GMACs and throughput, the two timed paired in one loop.

Throughputs are medians of round-robin runs (:func:`vitlab.timing.round_robin_times`); the paper's
numbers (an A100 / RTX 3090 at batch 64, ImageNet or CIFAR-100 training) are returned beside ours.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import torch

from vitlab.timing import round_robin_times

# LITv2 supplementary, Table II (CIFAR-100, LITv2-S): s -> params M, GFLOPs, img/s, train GB, test GB, top-1 %
PAPER_TABLE2 = {2: (27, 3.7, 1476, 5.1, 1.2, 85.1), 3: (27, 3.7, 1437, 5.1, 1.2, 84.6),
                4: (27, 3.8, 1417, 5.1, 1.2, 84.4), 5: (27, 3.7, 1434, 5.1, 1.2, 84.6),
                6: (27, 3.9, 1413, 5.2, 1.2, 84.8), 7: (27, 3.6, 1442, 4.9, 1.2, 84.8)}
TABLE2_KEYS = ("params_m", "gflops", "img_per_s", "train_memory_gb", "test_memory_gb", "top1")
# LITv2 supplementary, Table III (ImageNet-1K): params M, GFLOPs, img/s, top-1 %
PAPER_TABLE3 = {"litv2_s": (28, 3.7, 1471, 82.0), "litv2_s pooled queries": (28, 3.5, 1084, 81.9)}


def _throughputs(models: dict[str, torch.nn.Module], x: torch.Tensor, warmup: int, runs: int) -> dict[str, float]:
    for m in models.values():
        m.eval()

    def call(m):
        return lambda: m(x)

    with torch.inference_mode():
        times = round_robin_times({k: call(m) for k, m in models.items()}, x.device, warmup=warmup, runs=runs)
    return {k: x.shape[0] / statistics.median(t) for k, t in times.items()}


def _profile(name: str, img_size: int, kwargs: dict) -> tuple[float, float]:
    from vitlab.profile import profile_model

    p = profile_model(name, img_size=img_size, activations=False, **kwargs)
    return p.params_m, p.gmacs


def window_study(windows=(2, 3, 4, 5, 6, 7), model: str = "litv2_s", img_size: int = 224, batch_size: int = 8,
                 warmup: int = 1, runs: int = 5, memory: bool = True, epochs: int = 0, dataset: str = "digits",
                 train_img_size: int | None = None, train_batch_size: int = 32, lr: float | None = None,
                 output_dir: str | None = None, model_kwargs: dict | None = None, progress=None) -> dict:
    """Table II for ``model`` (a LITv2) with stage-3 window s in ``windows``. ``epochs`` > 0 also trains each one
    on ``dataset`` at ``train_img_size`` (a multiple of 32) and reports its test top-1. ``progress(msg)`` is told
    what runs. Returns {'rows': [...], 'paper': PAPER_TABLE2, 'settings': {...}}."""
    import vitlab
    from vitlab.analysis.memory import measure_memory_isolated

    if vitlab.get_model_config(model).family != "litv2":
        raise ValueError(f"the window study varies HiLo's window: {model} is no LITv2 (litv2_s, litv2_m, litv2_b)")
    if any(int(s) < 1 for s in windows):
        raise ValueError(f"window sizes must be >= 1, got {list(windows)}")
    say = progress or (lambda msg: None)
    base = dict(model_kwargs or {})
    rows, models = [], {}
    for s in windows:
        kw = {**base, "local_ws": (0, 0, int(s), 1)}
        params_m, gmacs = _profile(model, img_size, kw)
        rows.append({"window": int(s), "params_m": params_m, "gmacs": gmacs})
        models[str(s)] = vitlab.create_model(model, img_size=img_size, **kw)
    say(f"timing {len(models)} models at batch {batch_size}, {img_size}px ({runs} round-robin runs)")
    x = torch.randn(batch_size, 3, img_size, img_size)
    tput = _throughputs(models, x, warmup, runs)
    del models
    for row in rows:
        s = row["window"]
        row["img_per_s"] = tput[str(s)]
        kw = {**base, "local_ws": [0, 0, s, 1]}
        if memory:
            say(f"s={s}: memory (inference and a training step, batch {batch_size}) in fresh processes")
            for mode, key in (("train", "train_memory_gb"), ("infer", "test_memory_gb")):
                row[key] = measure_memory_isolated(model, batch_size=batch_size, mode=mode, img_size=img_size,
                                                   **kw)["measured_peak_gb"]
        if epochs > 0:
            say(f"s={s}: training {epochs} epoch(s) on {dataset}")
            row["top1"] = _train_top1(model, kw, dataset, epochs, train_img_size, train_batch_size, lr,
                                      None if output_dir is None else str(Path(output_dir) / f"window{s}"))
    settings = dict(model=model, img_size=img_size, batch_size=batch_size, runs=runs, memory=memory, epochs=epochs,
                    dataset=dataset if epochs else None, train_img_size=train_img_size, model_kwargs=base,
                    threads=torch.get_num_threads())
    return {"rows": rows, "paper": {s: dict(zip(TABLE2_KEYS, v)) for s, v in PAPER_TABLE2.items()},
            "settings": settings}


def _train_top1(model: str, kw: dict, dataset: str, epochs: int, img_size: int | None, batch_size: int,
                lr: float | None, output_dir: str | None) -> float:
    from vitlab.data import DataConfig
    from vitlab.train import fit
    from vitlab.train.config import TrainConfig

    cfg = TrainConfig(model=model, model_kwargs={k: list(v) if isinstance(v, tuple) else v for k, v in kw.items()},
                      data=DataConfig(dataset=dataset, img_size=img_size), epochs=epochs, batch_size=batch_size,
                      warmup_epochs=min(1.0, epochs / 2), output_dir=output_dir, quiet=True,
                      **({} if lr is None else {"lr": lr}))
    return float(fit(cfg)["test_top1"])


def pooled_queries_study(model: str = "litv2_s", img_size: int = 224, batch_size: int = 8, warmup: int = 1,
                         runs: int = 10, model_kwargs: dict | None = None) -> dict:
    """Table III: ``model`` with and without ``pooled_queries=True``: params (M), GMACs, img/s (paired), and the
    paper's row beside each. Returns {'rows': [...], 'speed_ratio' (pooled / standard img/s), 'paper'}."""
    import vitlab

    if vitlab.get_model_config(model).family != "litv2":
        raise ValueError(f"pooled queries are a HiLo option: {model} is no LITv2 (litv2_s, litv2_m, litv2_b)")
    base = dict(model_kwargs or {})
    variants = {"standard": base, "pooled queries": {**base, "pooled_queries": True}}
    rows, models = [], {}
    for label, kw in variants.items():
        params_m, gmacs = _profile(model, img_size, kw)
        rows.append({"variant": label, "params_m": params_m, "gmacs": gmacs})
        models[label] = vitlab.create_model(model, img_size=img_size, **kw)
    tput = _throughputs(models, torch.randn(batch_size, 3, img_size, img_size), warmup, runs)
    for row in rows:
        row["img_per_s"] = tput[row["variant"]]
    return {"rows": rows, "speed_ratio": tput["pooled queries"] / tput["standard"],
            "settings": dict(model=model, img_size=img_size, batch_size=batch_size, runs=runs, model_kwargs=base,
                             threads=torch.get_num_threads()),
            "paper": {k: dict(zip(("params_m", "gflops", "img_per_s", "top1"), v)) for k, v in PAPER_TABLE3.items()}}
