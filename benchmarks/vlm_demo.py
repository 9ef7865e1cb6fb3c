"""The embedded vision-language demo: ``vitlab train --task vqa`` and ``--task caption`` from scratch on the offline
scenes (:mod:`vitlab.vlm.data`), each with the recipe the task defaults to (:meth:`vitlab.vlm.tasks._VLTask.defaults`)
on a small LLaVA-style model, over several seeds, beside the same model trained *blind* (every image replaced by
zeros, ``--blind``): what the image adds. Scored on the held-out test scenes, whose questions and reference
captions use templates training never sees: VQA accuracy (VQA v2's rule) per question kind, BLEU-4 and CIDEr-D.

    python benchmarks/vlm_demo.py                              # 3 seeds x {vqa, caption} x {seeing, blind}
    python benchmarks/vlm_demo.py --tasks vqa --threads 2 --out /tmp/vqa.json    # 6 runs: VQA only
    python benchmarks/vlm_demo.py --tasks vqa --seeds 0 --no-blind --threads 2   # one run
    python benchmarks/vlm_demo.py --smoke                      # seconds: checks the script runs, no figures

The seed sets the model's initialisation and the training stream; the scenes (``data.seed`` 0) and so the test
set are the same for every run. Each run records its wall time, process CPU time and the load average (a shared
machine stretches the wall time, not the CPU time). The claims checked and written under ``checks``: mean held-out
VQA accuracy >= 90% and >= 30 points above blind for every question kind; mean CIDEr-D >= 2x blind; every run
within 10 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from statistics import mean

SMOKE = {"epochs": 1, "batch_size": 8, "task_args.scenes_train": 16, "task_args.scenes_eval": 6,
         "model_kwargs": {"vision_depth": 1, "text_n_layers": 1}}
KINDS = ("count", "presence", "position", "class")


def run(task: str, seed: int, blind: bool, args, tmp: str) -> dict:
    from vitlab.train import TrainConfig, fit

    over = {"seed": seed, "threads": args.threads, "quiet": True, "task_args.blind": blind,
            "output_dir": str(Path(tmp) / f"{task}-{seed}-{blind}")}
    for key in ("epochs", "batch_size", "lr"):
        if getattr(args, key) is not None:
            over[key] = getattr(args, key)
    if args.smoke:
        over.update(SMOKE)
    cfg = TrainConfig.for_task(task).with_overrides(over)
    load0 = os.getloadavg()[0]
    t0, c0 = time.perf_counter(), time.process_time()
    s = fit(cfg)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    keys = ["test_accuracy", *(f"test_acc_{k}" for k in KINDS)] if task == "vqa" else ["test_bleu4", "test_cider"]
    return {"task": task, "seed": seed, "blind": blind, **{k: s.get(k) for k in keys}, "params_m": s["params_m"],
            "epochs": cfg.epochs, "batch_size": cfg.batch_size, "wall_s": wall, "cpu_s": cpu,
            "loadavg_1min": [load0, os.getloadavg()[0]]}


def summarise(rows: list[dict]) -> tuple[dict, dict]:
    means: dict = {}
    for r in rows:
        key = f"{r['task']}{'_blind' if r['blind'] else ''}"
        for k, v in r.items():
            if k.startswith("test_") and v is not None:
                means.setdefault(key, {}).setdefault(k, []).append(v)
    means = {g: {k: mean(v) for k, v in d.items()} for g, d in means.items()}
    checks = {"every_run_within_10_min": all(r["wall_s"] <= 600 for r in rows)}
    if "vqa" in means and "vqa_blind" in means:
        see, blind = means["vqa"], means["vqa_blind"]
        checks["vqa_accuracy_at_least_90"] = see["test_accuracy"] >= 90.0
        checks["vqa_30_points_over_blind_every_kind"] = all(
            see[f"test_acc_{k}"] - blind[f"test_acc_{k}"] >= 30.0 for k in KINDS)
    if "caption" in means and "caption_blind" in means:
        checks["cider_at_least_2x_blind"] = means["caption"]["test_cider"] >= 2 * means["caption_blind"]["test_cider"]
    return means, checks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", nargs="*", default=["vqa", "caption"], choices=["vqa", "caption"])
    ap.add_argument("--seeds", nargs="*", type=int, default=[0, 1, 2])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=None, help="default: the recipe's")
    ap.add_argument("--batch_size", type=int, default=None, help="default: the recipe's")
    ap.add_argument("--lr", type=float, default=None, help="at global batch 512 (default: the recipe's)")
    ap.add_argument("--no-blind", action="store_true", help="skip the blind baselines")
    ap.add_argument("--smoke", action="store_true", help="a seconds-long run of every step (no figures)")
    ap.add_argument("--out", default="docs/bench/vlm_demo.json")
    args = ap.parse_args()

    import torch

    from vitlab.train import TrainConfig

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for task in args.tasks:
            for seed in args.seeds:
                for blind in (False,) if args.no_blind else (False, True):
                    rows.append(run(task, seed, blind, args, tmp))
                    print(json.dumps(rows[-1]), flush=True)
    means, checks = summarise(rows)
    recipe = {t: TrainConfig.for_task(t).to_dict() for t in args.tasks}
    from vitlab.optimize.cpu import cpu_model, isa

    result = {"benchmark": "vlm_demo", "recipe": recipe, "threads": args.threads, "smoke": args.smoke,
              "cpu": cpu_model(), "isa": isa(), "torch": torch.__version__, "rows": rows, "means": means,
              "checks": checks}
    from vitlab._io import write_json

    write_json(args.out, result)
    print(json.dumps({"means": means, "checks": checks}, indent=2))


if __name__ == "__main__":
    main()
