"""Token merging / pruning: the headline numbers, written as JSON (and PNG) under an output folder.

    python benchmarks/tokens.py speed --device cpu --out docs/bench   # deit_small r 0/13, vit_base r 0/16, fp32 b32
    python benchmarks/tokens.py speed --device cuda --dtype bf16 --batch-size 256 --out docs/bench
    python benchmarks/tokens.py accuracy --fmnist DIR --out docs/bench      # Fashion-MNIST at patch 2 (196 tokens)
    python benchmarks/tokens.py accuracy --device cpu --out docs/bench      # digits at 28 px, patch 2 (196 tokens)

``speed`` runs :func:`vitlab.bench.tokens.bench_tokens` (every setting timed in round robin in one process, paired
ratios to r = 0). ``accuracy`` trains a model at patch 2 on 28 x 28 images (196 patches + the class token) with
``vitlab train`` -- on Fashion-MNIST (the four ``*-ubyte.gz`` files in DIR, built as an image folder: train 55,000 /
val 5,000 held out of the training set / test 10,000) a DeiT-Ti-shaped model on a GPU, or without ``--fmnist``
on the embedded digits a 6-block pico ViT on the CPU -- measures off-the-shelf ToMe over r and pruning without
training, fine-tunes EViT 0.7 from the trained weights (and, as the control, the unpruned model alike), and
scores everything on the test split.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch

from vitlab._io import write_json, write_png
from vitlab.bench import tokens as bt
from vitlab.data import DataConfig
from vitlab.train import TrainConfig, fit

CLASSES = ["tshirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "boot"]


def speed(args) -> None:
    out = Path(args.out)
    for name, r in (("deit_small_patch16_224", 13), ("vit_base_patch16_224", 16)):
        rows = bt.bench_tokens(name, [0, r], device=args.device, dtype=args.dtype, batch_size=args.batch_size,
                               warmup=args.warmup, runs=args.runs, progress=False)
        tag = f"tokens_{name.split('_')[0]}_{name.split('_')[1]}_{args.device}_{args.dtype}_b{args.batch_size}"
        bt.write_json(rows, out / f"{tag}.json")
        for row in rows:
            print(json.dumps({k: row[k] for k in ("model", "setting", "img_per_s", "speedup_vs_r0",
                                                  "speedup_spread", "gmacs", "peak_mem_mb")}), flush=True)


def _read_idx(path: Path) -> np.ndarray:
    with gzip.open(path, "rb") as f:
        data = f.read()
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def _write_split(job) -> None:
    from PIL import Image

    root, images, labels, index = job
    for img, y, i in zip(images, labels, index, strict=True):
        Image.fromarray(img).save(root / CLASSES[y] / f"{i:05d}.png")  # named by the image's index in its IDX file


def build_fmnist(src: Path, root: Path, n_train: int = 55000, n_val: int = 5000, train_start: int | None = None,
                 test: bool = True) -> Path:
    """Fashion-MNIST as ``root/{train,val[,test]}/<class>/*.png``: val is the first ``n_val`` of a fixed (seed 0)
    permutation of the 60,000 training images, train the ``n_train`` after ``train_start`` (default: right after
    val) in that permutation, test the whole 10,000-image test set."""
    if (root / "val").exists():
        return root
    xtr, ytr = _read_idx(src / "train-images-idx3-ubyte.gz"), _read_idx(src / "train-labels-idx1-ubyte.gz")
    perm = np.random.default_rng(0).permutation(len(xtr))
    start = n_val if train_start is None else train_start
    splits = {"train": (xtr, ytr, perm[start: start + n_train]), "val": (xtr, ytr, perm[:n_val])}
    if test:
        xte, yte = _read_idx(src / "t10k-images-idx3-ubyte.gz"), _read_idx(src / "t10k-labels-idx1-ubyte.gz")
        splits["test"] = (xte, yte, np.arange(len(xte)))
    jobs = []
    for split, (x, y, idx) in splits.items():
        for c in CLASSES:
            (root / split / c).mkdir(parents=True, exist_ok=True)
        for s in range(0, len(idx), 2000):
            part = idx[s: s + 2000]
            jobs.append((root / split, x[part], y[part], part))
    with ProcessPoolExecutor(min(4, os.cpu_count() or 1)) as pool:
        list(pool.map(_write_split, jobs))
    return root


def subset(args) -> None:
    """The CPU accuracy check's folders: the base run's (train / val / the full test set) and the fine-tuning's
    (a part of the same training images, a smaller val, no test: the bench scores the test set)."""
    src, work = Path(args.fmnist), Path(args.work)
    print(build_fmnist(src, work / f"fmnist{args.n_train // 1000}k", args.n_train, args.n_val))
    print(build_fmnist(src, work / f"fmnist_ft{args.n_ft // 1000}k", args.n_ft, args.n_val // 2,
                       train_start=args.n_val, test=False))


def _plot_accuracy(rows: list[dict], path: Path, title: str) -> None:
    """Top-1 against the share of r = 0's GMACs (the runs' img/s come from different processes and loads)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    tome = sorted((r for r in rows if r["setting"].startswith(("tome", "r=0")) and "(" not in r["setting"]),
                  key=lambda r: -r["gmacs_share"])
    ax.plot([r["gmacs_share"] for r in tome], [r["top1"] for r in tome], marker="o", label="ToMe off the shelf")
    for r in rows:
        if r not in tome:
            ax.plot(r["gmacs_share"], r["top1"], marker="^", linestyle="none", color="tab:green")
        ax.annotate(r["setting"], (r["gmacs_share"], r["top1"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("GMACs / GMACs at r = 0")
    ax.set_ylabel("top-1 (%)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    write_png(path, fig)


def report(args) -> None:
    """One summary of the two ``vitlab bench tokens`` JSONs (the base run's settings, the EViT-fine-tuned run's):
    top-1 and GMACs of every setting against the base model's r = 0, and the speed-accuracy PNG."""
    base = json.loads(Path(args.base_json).read_text())["rows"]
    tuned = [dict(r, setting=f"{r['setting']} (EViT-fine-tuned weights)")
             for r in json.loads(Path(args.ft_json).read_text())["rows"]]
    if args.control_json:  # the unpruned model fine-tuned alike: what the fine-tuning alone does
        tuned += [dict(r, setting=f"{r['setting']} (fine-tuned alike without pruning)")
                  for r in json.loads(Path(args.control_json).read_text())["rows"]]
    if args.sweep_json:  # more ToMe r on the same base weights (another process: its img/s are its own)
        tuned += [dict(r, speedup_vs_r0=None) for r in json.loads(Path(args.sweep_json).read_text())["rows"][1:]]
    ref = base[0]
    rows = []
    for r in base + tuned:
        rows.append(dict(setting=r["setting"], gmacs=r["gmacs"], gmacs_closed_form=r["gmacs_closed_form"],
                         gmacs_share=round(r["gmacs"] / ref["gmacs"], 4), tokens_out=r["tokens_out"],
                         top1=r["top1"], delta_top1=round(r["top1"] - ref["top1"], 3),
                         speedup_vs_r0=r["speedup_vs_r0"] if r in base else None))
    out = Path(args.out)
    summary = {"model": ref["model"], "data": args.data, "split": "test", "rows": rows}
    write_json(out / f"{args.tag}_summary.json", summary)
    _plot_accuracy(rows, out / f"{args.tag}_accuracy.png", f"{ref['model']} ({args.data}, test split)")
    for r in rows:
        print(json.dumps(r), flush=True)


MODEL_KW = dict(patch_size=2)  # 28 / 2 = 14 x 14 = 196 patches + the class token


def accuracy(args) -> None:
    out = Path(args.out)
    if args.fmnist:
        root = build_fmnist(Path(args.fmnist), Path(args.work) / "fmnist")
        data = DataConfig(f"imagefolder:{root}", img_size=28, preset="tiny", num_workers=args.workers,
                          batch_size=512)
        model, kw = "deit_tiny_patch16_224", dict(MODEL_KW, in_chans=1)
    else:
        data = DataConfig("digits", img_size=28)
        model, kw = "vit_pico_patch8_32", dict(MODEL_KW, depth=args.depth, embed_dim=args.embed_dim,
                                               num_heads=args.heads, global_pool=args.pool)
    amp = "bf16" if args.device == "cuda" else "none"
    common = dict(model=model, model_kwargs=kw, data=data, batch_size=args.batch_size, amp=amp,
                  device=args.device, quiet=True, drop_path=0.1, threads=args.threads)
    t0 = time.time()
    if args.base:  # a base run trained before with the same settings
        base = json.loads((Path(args.base) / "summary.json").read_text())
    else:
        base = fit(TrainConfig(**common, epochs=args.epochs, lr=args.lr, warmup_epochs=2,
                               output_dir=str(Path(args.work) / "base")))
    print(f"base: test top1 {base['test_top1']:.2f} ({time.time() - t0:.0f}s)", flush=True)
    ckpt = str(Path(base["run_dir"]) / "last" / "model.safetensors")
    ft_kw = dict(common, model_kwargs=dict(kw, checkpoint_path=ckpt))
    evit = fit(TrainConfig(**ft_kw, epochs=args.ft_epochs, lr=args.lr / 4, warmup_epochs=0,
                           task_args={"prune": "evit:0.7"},
                           output_dir=str(Path(args.work) / "evit")))
    same = fit(TrainConfig(**ft_kw, epochs=args.ft_epochs, lr=args.lr / 4, warmup_epochs=0,
                           output_dir=str(Path(args.work) / "same")))  # the same fine-tuning without pruning
    print(f"evit 0.7 fine-tuned: {evit['test_top1']:.2f}; unpruned fine-tuned alike: {same['test_top1']:.2f}",
          flush=True)
    rows = bt.bench_tokens(None, args.r, prune=["evit:0.7,0.5", "topk:0.7"], checkpoint=base["run_dir"],
                           split="test", device=args.device, dtype=amp if amp != "none" else "fp32",
                           batch_size=args.batch_size, warmup=2, runs=args.runs, progress=False)
    rows += [dict(r, checkpoint="evit-finetuned") for r in bt.bench_tokens(
        None, [0], prune=["evit:0.7"], checkpoint=evit["run_dir"], split="test", device=args.device,
        dtype=amp if amp != "none" else "fp32", batch_size=args.batch_size, warmup=2, runs=args.runs,
        progress=False)]
    summary = {"base_test_top1": base["test_top1"], "evit_finetuned_test_top1": evit["test_top1"],
               "unpruned_finetuned_test_top1": same["test_top1"], "epochs": args.epochs,
               "ft_epochs": args.ft_epochs, "lr": args.lr, "model": model, "model_kwargs": kw,
               "data": data.dataset}
    tag = "fmnist" if args.fmnist else "digits28"
    bt.write_json(rows, out / f"tokens_{tag}_accuracy.json")
    bt.plot(rows[:-2], out / f"tokens_{tag}_accuracy.png")
    write_json(out / f"tokens_{tag}_summary.json", summary)
    for row in rows:
        print(json.dumps({k: row.get(k) for k in ("setting", "checkpoint", "top1", "gmacs", "img_per_s",
                                                  "speedup_vs_r0")}), flush=True)
    print(json.dumps(summary), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("speed")
    s.add_argument("--device", default="cpu")
    s.add_argument("--dtype", default="fp32")
    s.add_argument("--batch-size", type=int, default=32)
    s.add_argument("--warmup", type=int, default=3)
    s.add_argument("--runs", type=int, default=10)
    s.add_argument("--out", default="docs/bench")
    a = sub.add_parser("accuracy")
    a.add_argument("--fmnist", help="folder with the four Fashion-MNIST *-ubyte.gz files (default: digits)")
    a.add_argument("--device", default="cuda")
    a.add_argument("--depth", type=int, default=6, help="digits: the pico ViT's depth")
    a.add_argument("--embed-dim", type=int, default=64, help="digits: its width")
    a.add_argument("--heads", type=int, default=4, help="digits: its heads")
    a.add_argument("--pool", default="token", help="digits: its global_pool (token, avg)")
    a.add_argument("--threads", type=int, default=None)
    a.add_argument("--batch-size", type=int, default=256)
    a.add_argument("--runs", type=int, default=10)
    a.add_argument("--work", default="/tmp/tokens_acc")
    a.add_argument("--base", help="reuse this trained base run (same settings) instead of training one")
    a.add_argument("--out", default="docs/bench")
    a.add_argument("--epochs", type=int, default=30)
    a.add_argument("--ft-epochs", type=int, default=5)
    a.add_argument("--lr", type=float, default=2e-3)  # at global batch 512 (vitlab's convention)
    a.add_argument("--workers", type=int, default=12)
    a.add_argument("--r", type=lambda s: [int(v) for v in s.split(",")], default=[0, 4, 8, 12, 14, 16])
    b = sub.add_parser("subset", help="Fashion-MNIST folders for the CPU accuracy check")
    b.add_argument("--fmnist", required=True, help="folder with the four Fashion-MNIST *-ubyte.gz files")
    b.add_argument("--work", default="/tmp/tokens_acc")
    b.add_argument("--n-train", type=int, default=12000)
    b.add_argument("--n-val", type=int, default=1000)
    b.add_argument("--n-ft", type=int, default=4000)
    c = sub.add_parser("report", help="summary JSON + PNG of the base run's and the fine-tuned run's bench JSONs")
    c.add_argument("--base-json", required=True)
    c.add_argument("--ft-json", required=True)
    c.add_argument("--control-json", help="bench JSON of the unpruned model fine-tuned alike")
    c.add_argument("--sweep-json", help="bench JSON of more ToMe r on the base weights")
    c.add_argument("--data", default="fashion-mnist")
    c.add_argument("--tag", default="tokens_fmnist")
    c.add_argument("--out", default="docs/bench")
    args = p.parse_args()
    torch.manual_seed(0)
    {"speed": speed, "accuracy": accuracy, "subset": subset, "report": report}[args.cmd](args)


if __name__ == "__main__":
    main()
