"""Self-supervised pre-training then frozen-feature probes: for each method, ``vitlab.train.fit``
of the pre-training task for a fixed wall-clock budget (``--epochs`` per method), then the linear probe (plain,
and MAE's BatchNorm variant) and DINO's k-NN on the test split; the same probes of the
randomly initialised backbone; and the raw-pixel logistic regression (scikit-learn, the floor). Each probe reads
the pre-logits of the last N blocks for each N of ``--blocks`` (1: the plain pre-logits; 4: DINO's protocol).

    python benchmarks/ssl_probe.py --data digits --out docs/bench/ssl_digits.json
    python benchmarks/ssl_probe.py --data fashion-mnist:/usr/share/datasets/fashion-mnist --methods simclr \\
        --epochs simclr=20 --budget_min 30 --threads 1 --workers 1 --model_kwargs '{"embed_dim": 96}' \\
        --task_args '{"global_scale": [0.5, 1.0]}' --out docs/bench/ssl_fashion_mnist_simclr_w96_s50.json
    python benchmarks/ssl_probe.py --reprobe --runs RUNS --out OLD.json     (add the probes OLD.json lacks)

Every method runs with the options in ``RECIPES``, updated by ``--task_args`` (above: a milder crop
scale for 28x28 images). Writes the JSON after every method, so a cut-short run keeps what it finished.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch

from vitlab._io import write_json, write_png
from vitlab.data import DataConfig, build
from vitlab.optimize import cpu
from vitlab.ssl.probe import probe
from vitlab.train import TrainConfig, fit, read_metrics

MODEL = "vit_pico_patch8_32"
# Small heads for a 64-wide backbone; the rest are the papers' defaults (temperatures, momenta, mask ratio).
RECIPES = {
    "mae": dict(lr=1.5e-3, task_args=dict(decoder_dim=64, decoder_depth=2, decoder_heads=4)),
    "simclr": dict(lr=4e-3, task_args=dict(proj_hidden_dim=256, proj_dim=64)),
    "mocov3": dict(lr=4e-3, task_args=dict(dim=64, mlp_dim=256)),
    "dino": dict(lr=4e-3, task_args=dict(out_dim=1024, hidden_dim=256, bottleneck_dim=64, local_crops=2,
                                         local_crop_size=16, warmup_teacher_temp_epochs=2)),
    "dinov2": dict(lr=4e-3, task_args=dict(out_dim=1024, hidden_dim=256, bottleneck_dim=64, local_crops=2,
                                           local_crop_size=16, warmup_teacher_temp_epochs=2)),
}


def raw_pixel_logreg(dataset: str) -> float:
    """Top-1 (%) of a multinomial logistic regression on the raw (normalised) test pixels."""
    from sklearn.linear_model import LogisticRegression

    b = build(DataConfig(dataset=dataset, img_size=32), in_chans=1)
    def arrays(ds):
        x = torch.stack([ds[i][0] for i in range(len(ds))]).flatten(1).numpy()
        y = [ds[i][1] for i in range(len(ds))]
        return x, y

    b.train.transform = b.eval_transform
    xtr, ytr = arrays(b.train)
    xte, yte = arrays(b.test)
    clf = LogisticRegression(max_iter=1000).fit(xtr, ytr)
    return 100.0 * clf.score(xte, yte)


def probes(ckpt: str, data: str, out_dir: Path, linear_epochs: int, blocks: list[int],
           have: dict | None = None, model_kwargs: dict | None = None) -> dict:
    """{protocol[_lastN]: {top1, top5}}: linear, linear+BN and k-NN on the pre-logits of the last N blocks for each
    N in ``blocks`` (N = 1: the plain pre-logits, no suffix); entries already in ``have`` are kept."""
    tag = ckpt.replace(":", "-").replace("/", "_")
    r = dict(have or {})
    for n in blocks:
        for name, kw in (("linear", dict(protocol="linear", epochs=linear_epochs)),
                         ("linear_bn", dict(protocol="linear", epochs=linear_epochs, bn=True)),
                         ("knn", dict(protocol="knn"))):
            key = name if n == 1 else f"{name}_last{n}"
            if key not in r:
                res = probe(ckpt, data, output=out_dir / f"probe-{tag}-{key}.json", blocks=n,
                            model_kwargs=model_kwargs, **kw)
                r[key] = {"top1": res["top1"], "top5": res["top5"]}
    return r


def plot(jsons: list[Path], png: Path) -> None:
    """Grouped bars of linear+BN and k-NN top-1 (plain pre-logits and last 4 blocks) for every method in ``jsons``
    (the same data; a method in several files: each file's row, labelled with its epochs, model kwargs, the
    task_args that differ from ``RECIPES`` and a non-zero seed), with the first file's random-init and raw-pixel
    levels as lines."""
    from matplotlib.figure import Figure

    keys = ("linear_bn", "knn", "linear_bn_last4", "knn_last4")
    rows, base = [], None
    for j in jsons:
        d = json.loads(j.read_text())
        base = base or d
        for m, r in d["methods"].items():
            extra = {k: v for k, v in r.get("task_args", {}).items() if RECIPES[m]["task_args"].get(k) != v}
            kw = "".join(f"\n{k}={v}" for k, v in {**d.get("model_kwargs", {}), **extra}.items())
            kw += f"\nseed {d['seed']}" if d.get("seed") else ""
            rows.append((f"{m}{kw}\n{r.get('epochs_done') or r['epochs']} ep, {r['pretrain_wall_s'] / 60:.0f} min", r))
    fig = Figure(figsize=(1.6 * len(rows) + 2, 4.2))
    ax = fig.add_subplot()
    w = 0.8 / len(keys)
    for i, k in enumerate(keys):
        xs = [x + (i - 1.5) * w for x in range(len(rows))]
        ax.bar(xs, [r[k]["top1"] if k in r else 0 for _, r in rows], w, label=k.replace("_", " "))
        ax.hlines(base["random_init"][k]["top1"], -0.5, len(rows) - 0.5, colors=f"C{i}", linestyles=":", lw=1)
    ax.axhline(base["raw_pixel_logreg_top1"], color="k", lw=1, ls="--", label="raw pixels, logistic regression")
    ax.set_xticks(range(len(rows)), [n for n, _ in rows], fontsize=8)
    ax.set_ylabel("test top-1 (%)")
    ax.set_ylim(max(0, min(base["random_init"][k]["top1"] for k in keys) - 10), 100)
    ax.set_title(f"{base['model']} on {base['data'].split(':')[0]}: frozen-feature probes (dotted: random init)",
                 fontsize=9)
    ax.legend(fontsize=7, ncol=3, loc="upper left")
    fig.tight_layout()
    write_png(png, fig, dpi=110)


def pretrain_within(cfg: TrainConfig, run: Path, budget_s: float | None) -> tuple[float, int]:
    """Pre-train ``cfg`` (its schedule spans ``cfg.epochs``) one epoch per ``fit`` call (exact resume), stopping
    before an epoch that would end past ``budget_s`` seconds (the longest epoch so far as the estimate). Returns
    (pre-training seconds, epochs done); the last completed epoch is the run's ``last`` checkpoint."""
    if budget_s is None:
        return fit(cfg)["wall_time_s"], cfg.epochs
    t0, longest = time.perf_counter(), 0.0
    for e in range(1, cfg.epochs + 1):
        t = time.perf_counter()
        fit(replace(cfg, stop_after=e, resume=str(run) if e > 1 else None))
        longest = max(longest, time.perf_counter() - t)
        if time.perf_counter() - t0 + longest > budget_s:
            return time.perf_counter() - t0, e
    return time.perf_counter() - t0, cfg.epochs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default="digits")
    ap.add_argument("--methods", nargs="+", default=list(RECIPES))
    ap.add_argument("--epochs", nargs="*", default=[], help="method=N (default 10)")
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--model_kwargs", type=json.loads, default={}, help='JSON, e.g. \'{"embed_dim": 96}\'')
    ap.add_argument("--task_args", type=json.loads, default={},
                    help='JSON merged into every method\'s task_args, e.g. \'{"global_scale": [0.5, 1.0]}\'')
    ap.add_argument("--seed", type=int, default=0, help="pre-training seed (initialisation and augmentation)")
    ap.add_argument("--batch_size", type=int, default=128)
    ap.add_argument("--linear_epochs", type=int, default=100)
    ap.add_argument("--blocks", type=int, nargs="+", default=[1, 4],
                    help="probe the pre-logits of the last N blocks for each N (4: DINO's protocol for ViT-S)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workers", type=int, default=0, help="data-loader worker processes (the views' augmentation)")
    ap.add_argument("--runs", default="/tmp/vitlab-ssl-runs")
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget_min", type=float, default=None,
                    help="cap each method's pre-training at this many minutes (stops after the last epoch that fits)")
    ap.add_argument("--baselines_from", default=None, help="a previous JSON of the same data: reuse its baselines")
    ap.add_argument("--plot", nargs="+", type=Path, default=None,
                    help="no pre-training: draw these result JSONs (same data) as bars into --out (a .png)")
    ap.add_argument("--reprobe", action="store_true",
                    help="no pre-training: add the probes --out lacks (e.g. a new --blocks) to its methods' runs")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    epochs = {k: int(v) for k, v in (e.split("=") for e in args.epochs)}
    out = Path(args.out)
    if args.plot:
        return plot(args.plot, out)
    runs = Path(args.runs)
    runs.mkdir(parents=True, exist_ok=True)
    result = {"data": args.data, "model": args.model, "model_kwargs": args.model_kwargs, "batch_size": args.batch_size,
              "seed": args.seed, "threads": args.threads, "workers": args.workers, "cpu": cpu.cpu_model(),
              "isa": cpu.isa(), "torch": torch.__version__, "methods": {}}

    def save():
        write_json(out, result)

    if args.reprobe:
        result = json.loads(out.read_text())
        result["random_init"] = probes(f"random:{result['model']}", result["data"], runs, args.linear_epochs,
                                       args.blocks, result["random_init"], result.get("model_kwargs"))
        for m, row in result["methods"].items():
            row.update(probes(str(runs / f"{m}-{result['data'].split(':')[0]}"), result["data"], runs,
                              args.linear_epochs, args.blocks, row))
        save()
        return
    t0 = time.perf_counter()
    if args.baselines_from:
        prev = json.loads(Path(args.baselines_from).read_text())
        if prev["data"] != args.data:
            raise SystemExit(f"{args.baselines_from} holds {prev['data']}, not {args.data}")
        if (prev["model"], prev.get("model_kwargs", {})) != (args.model, args.model_kwargs):
            raise SystemExit(f"{args.baselines_from} holds baselines of another backbone")
        result.update({k: prev[k] for k in ("raw_pixel_logreg_top1", "random_init")})
    else:
        result["raw_pixel_logreg_top1"] = raw_pixel_logreg(args.data)
    result["random_init"] = probes(f"random:{args.model}", args.data, runs, args.linear_epochs, args.blocks,
                                   result.get("random_init"), args.model_kwargs)
    result["baseline_s"] = time.perf_counter() - t0
    save()
    for m in args.methods:
        rec = dict(RECIPES[m], task_args={**RECIPES[m]["task_args"], **args.task_args})
        run = runs / f"{m}-{args.data.split(':')[0]}"
        cfg = TrainConfig(task=m, task_args=dict(rec["task_args"]), model=args.model,
                          model_kwargs=dict(args.model_kwargs),
                          data=DataConfig(dataset=args.data, num_workers=args.workers),
                          epochs=epochs.get(m, 10), batch_size=args.batch_size, lr=rec["lr"], warmup_epochs=1,
                          drop_path=0.0, threads=args.threads, seed=args.seed, quiet=True, output_dir=str(run))
        wall, done = pretrain_within(cfg, run, args.budget_min * 60 if args.budget_min else None)
        rows = read_metrics(run, "epoch")
        monitors = {k: rows[-1][k] for k in rows[-1] if k.startswith("val_")}
        result["methods"][m] = {"epochs": cfg.epochs, "epochs_done": done, "lr": cfg.lr, "task_args": rec["task_args"],
                                "pretrain_wall_s": wall, "final_train_loss": rows[-1]["train_loss"],
                                "monitors_last_epoch": monitors,
                                **probes(str(run), args.data, runs, args.linear_epochs, args.blocks)}
        save()
        print(m, json.dumps(result["methods"][m]), flush=True)


if __name__ == "__main__":
    main()
