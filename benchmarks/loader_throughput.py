"""Loader throughput: training images/s through JPEG decode and vitlab's training transforms, for the same JPEGs
read as an image folder (vitlab's ``imagefolder:``), WebDataset shards (``wds:``, written by ``vitlab data pack``:
the files' own bytes), a Hugging Face dataset (``hf:``, a ``save_to_disk`` folder of the same bytes; map-style and
``streaming``), against torchvision's ``ImageFolder`` with the same transform, batch size and workers.

    python benchmarks/loader_throughput.py --out docs/bench/loader_throughput.json
    python benchmarks/loader_throughput.py --idx /usr/share/datasets/fashion-mnist --workers 0 2 4 --rounds 5
    python benchmarks/loader_throughput.py --images 64 --rounds 2 --workers 0 --img-size 32      (smoke)
    python benchmarks/loader_throughput.py --runs runs/demo runs/shards     (data-wait share of finished runs)

Images: ``--images`` JPEGs (quality 90) upscaled to ``--source-size`` pixels from Fashion-MNIST (``--idx DIR``, the
four IDX files, e.g. Debian's ``dataset-fashion-mnist``) or, without it, scikit-learn's digits (cycled), written
as 3-channel JPEGs in ``train/<class>/``. Transform: the ``imagenet`` preset's training pipeline (DeiT:
RandomResizedCrop, flip, RandAugment 2/9, erasing; ``vitlab.data.transforms.train_transform``) at ``--img-size``.

One measurement reads one epoch (every image once) from a fresh ``DataLoader`` (workers started, as each epoch of
training does) and divides the images by the wall time. Rounds alternate the loaders (rotated order each round, a
discarded warm-up round first, so the page cache is warm for all), per worker count; reported are the median
images/s and the median of each round's ratio to torchvision's (paired).

``--runs`` reads ``summary.json`` of finished training runs and prints their data-wait share (the fraction of
step time spent waiting for the loader, logged by the trainer).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader
from torchvision.transforms import v2

from vitlab._io import write_json
from vitlab.data import DataConfig, build
from vitlab.data.core import PRESETS
from vitlab.data.streaming import StreamImages
from vitlab.data.transforms import train_transform

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def source_images(n: int, idx: str | None) -> tuple[np.ndarray, np.ndarray]:
    """``n`` uint8 grey images (n, H, W) and labels: Fashion-MNIST from IDX files, else digits, cycled."""
    if idx:
        from vitlab.data.datasets import read_idx

        x = read_idx(next(Path(idx).glob("train-images-idx3-ubyte*")))
        y = read_idx(next(Path(idx).glob("train-labels-idx1-ubyte*")))
    else:
        from sklearn.datasets import load_digits

        d = load_digits()
        x, y = np.round(d.images * (255 / 16)).astype(np.uint8), d.target
    i = np.arange(n) % len(x)
    return x[i], y[i]


def write_folder(root: Path, n: int, size: int, idx: str | None) -> None:
    """``root/train/<class>/<i>.jpg`` and a small ``root/val`` (image folders need one)."""
    x, y = source_images(n + 20, idx)
    for i in range(len(x)):
        split = "train" if i < n else "val"
        folder = root / split / f"class{int(y[i]):02d}"
        folder.mkdir(parents=True, exist_ok=True)
        img = Image.fromarray(x[i]).convert("RGB").resize((size, size), Image.BILINEAR)
        img.save(folder / f"{i:06d}.jpg", quality=90)
    for c in {p.name for p in (root / "train").iterdir()} - {p.name for p in (root / "val").iterdir()}:
        src = next((root / "train" / c).iterdir())  # every train class needs a val folder
        (root / "val" / c).mkdir()
        (root / "val" / c / src.name).write_bytes(src.read_bytes())


def write_hf(root: Path, out: Path) -> None:
    """The image folder's JPEG bytes as a ``save_to_disk`` dataset (Image and ClassLabel features)."""
    import datasets as hfd

    classes = sorted(p.name for p in (root / "train").iterdir())
    splits = {}
    for split, name in (("train", "train"), ("val", "validation")):
        files = sorted((root / split).rglob("*.jpg"))
        splits[name] = hfd.Dataset.from_dict(
            {"image": [{"bytes": f.read_bytes(), "path": None} for f in files],
             "label": [classes.index(f.parent.name) for f in files]},
            features=hfd.Features({"image": hfd.Image(), "label": hfd.ClassLabel(names=classes)}))
    hfd.DatasetDict(splits).save_to_disk(str(out))


def loaders(root: Path, img_size: int, batch: int, workers: int) -> dict:
    """name -> a function making a fresh DataLoader over one epoch of the training images."""
    from torchvision.datasets import ImageFolder

    from vitlab.data import hf, wds

    p = PRESETS["imagenet"]
    t = train_transform(img_size, scale=p["scale"], hflip=p["hflip"], randaugment=p["randaugment"], rand_num_ops=2,
                        rand_magnitude=9, color_jitter=p["color_jitter"], reprob=p["reprob"], mean=MEAN, std=STD)
    tv = ImageFolder(str(root / "folder" / "train"), transform=v2.Compose([v2.PILToTensor(), t]))
    cfg = DataConfig(f"imagefolder:{root / 'folder'}", img_size=img_size, preset="imagenet")
    folder = build(cfg, mean=MEAN, std=STD).train
    folder.transform = t
    hf_map = build(DataConfig(f"hf:{root / 'hf'}", img_size=img_size, preset="imagenet"), mean=MEAN, std=STD).train
    hf_map.transform = t
    shards = StreamImages(wds.read_split("train", str(root / "shards")), 3, t)
    shards.batch_size = batch
    stream = StreamImages(hf.read_split("train", str(root / "hf"), streaming=True), 3, t)
    stream.batch_size = batch
    kw = dict(batch_size=batch, num_workers=workers, drop_last=False)
    return {
        "torchvision ImageFolder": lambda: DataLoader(tv, shuffle=True, **kw),
        "imagefolder:": lambda: DataLoader(folder, shuffle=True, **kw),
        "wds: (shards)": lambda: DataLoader(shards, **kw),
        "hf: (save_to_disk)": lambda: DataLoader(hf_map, shuffle=True, **kw),
        "hf: streaming": lambda: DataLoader(stream, **kw),
    }


def epoch_rate(make) -> tuple[float, int]:
    t0 = time.perf_counter()
    n = sum(len(y) for _, y in make())
    return n / (time.perf_counter() - t0), n


def measure(root: Path, args) -> list[dict]:
    rows = []
    for workers in args.workers:
        make = loaders(root, args.img_size, args.batch, workers)
        names = list(make)
        rates: dict[str, list[float]] = {k: [] for k in names}
        counts: dict[str, int] = {}
        for r in range(args.rounds + 1):
            order = names[r % len(names):] + names[: r % len(names)]
            for name in order:
                rate, n = epoch_rate(make[name])
                counts[name] = n
                if r:  # round 0 warms the page cache and the imports
                    rates[name].append(rate)
        base = rates[names[0]]
        for name in names:
            rows.append({"loader": name, "workers": workers, "images": counts[name],
                         "img_per_s": statistics.median(rates[name]), "rounds": rates[name],
                         "vs_torchvision": statistics.median(a / b for a, b in zip(rates[name], base))})
    return rows


def data_wait(runs: list[str]) -> list[dict]:
    out = []
    for run in runs:
        path = Path(run) / "summary.json"
        if not path.is_file():
            raise SystemExit(f"{path}: not a finished run (no summary.json)")
        s = json.loads(path.read_text())
        share = s.get("data_wait", s.get("data_wait_share"))
        out.append({"run": run, "dataset": s.get("dataset"), "data_wait_share": share,
                    "train_img_per_s": s.get("train_img_per_s"), "epochs": s.get("epochs_done", s.get("epochs"))})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--source-size", type=int, default=128, help="pixels of the written JPEGs")
    ap.add_argument("--img-size", type=int, default=224, help="the training transform's output size")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 2, 4])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shard-size", type=int, default=500)
    ap.add_argument("--idx", default=None, help="a folder of Fashion-MNIST IDX files (default: scikit-learn digits)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the main process")
    ap.add_argument("--runs", nargs="+", default=None, help="report the data-wait share of these runs and stop")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.runs:
        rows = data_wait(args.runs)
        for r in rows:
            share = "n/a" if r["data_wait_share"] is None else f"{100 * r['data_wait_share']:.1f}%"
            print(f"{r['run']:40s} {str(r['dataset']):40s} data wait {share}")
        if args.out:
            write_json(args.out, {"runs": rows})
        return
    torch.set_num_threads(args.threads)
    from vitlab.data.wds import pack

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_folder(root / "folder", args.images, args.source_size, args.idx)
        pack(f"imagefolder:{root / 'folder'}", root / "shards", shard_size=args.shard_size)
        write_hf(root / "folder", root / "hf")
        rows = measure(root, args)
    print(f"{'loader':26s} {'workers':>7s} {'images':>7s} {'img/s':>9s} {'vs torchvision':>15s}")
    for r in rows:
        print(f"{r['loader']:26s} {r['workers']:7d} {r['images']:7d} {r['img_per_s']:9.1f} "
              f"{r['vs_torchvision']:14.2f}x")
    result = {"images": args.images, "source": "fashion-mnist" if args.idx else "digits",
              "source_size": args.source_size, "img_size": args.img_size, "batch": args.batch,
              "rounds": args.rounds, "threads": args.threads, "torch": torch.__version__, "rows": rows}
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
