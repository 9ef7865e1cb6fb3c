"""Start-up of the command line as a new user meets it: ``vitlab predict`` on two images of a tiny run with empty
caches against ``vitlab predict --no-optimize``, and ``vitlab --help``, with ``python -c "import torch"`` for
reference.

    python benchmarks/predict_startup.py                                   # 5 repeats
    python benchmarks/predict_startup.py --repeats 7 --json docs/bench/predict_startup.json

A run of the default model (``vit_pico_patch8_32`` on digits) is trained for one epoch in a temporary folder; the
images are two random 32 x 32 PNGs. Every repeat runs each command once in a fresh process, in an order reversed
every other repeat (a shared machine's drift falls on all alike), and gives it empty caches: ``VITLAB_CACHE_DIR``
(vitlab.optimize's choices, the HiLo kernels), ``TORCH_EXTENSIONS_DIR`` and ``TORCHINDUCTOR_CACHE_DIR`` in a new
folder. Both predictions must print the same labels. Prints the median and [min-max] wall seconds of each command.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from vitlab._io import atomic_write
from vitlab.optimize import cpu


def vitlab_command() -> list[str]:
    """The ``vitlab`` console script beside this interpreter (what a user runs), else ``python -m vitlab``."""
    script = Path(sys.executable).with_name("vitlab")
    return [str(script)] if script.exists() else [sys.executable, "-m", "vitlab"]


def run(cmd: list[str], cache: Path) -> tuple[float, subprocess.CompletedProcess]:
    """Wall seconds of ``cmd`` in a fresh process whose caches are the empty folder ``cache``."""
    shutil.rmtree(cache, ignore_errors=True)
    env = {**os.environ, "VITLAB_CACHE_DIR": str(cache), "TORCH_EXTENSIONS_DIR": str(cache / "torch_extensions"),
           "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor")}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    seconds = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return seconds, proc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5, help="runs of each command (median and min-max reported)")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the times and the machine as JSON")
    args = ap.parse_args()
    vitlab = vitlab_command()
    with tempfile.TemporaryDirectory(prefix="vitlab-startup-") as tmp:
        folder = Path(tmp)
        print("training a one-epoch run ...", flush=True)
        run([*vitlab, "train", "--epochs", "1", "--quiet", "--output_dir", str(folder / "run")], folder / "cache")
        rng = np.random.default_rng(0)
        images = []
        for name in ("two.png", "images.png"):
            Image.fromarray((rng.random((32, 32, 3)) * 255).astype(np.uint8)).save(folder / name)
            images.append(str(folder / name))
        predict = [*vitlab, "predict", "--checkpoint", str(folder / "run" / "best"), *images]
        commands = {"vitlab predict (2 images, empty cache)": predict,
                    "vitlab predict --no-optimize (2 images)": [*predict, "--no-optimize"],
                    "vitlab --help": [*vitlab, "--help"],
                    "python -c 'import torch'": [sys.executable, "-c", "import torch"]}
        times: dict[str, list[float]] = {name: [] for name in commands}
        notes = set()
        order = list(commands.items())
        for i in range(args.repeats):
            outputs = {}
            for name, cmd in order if i % 2 == 0 else order[::-1]:
                seconds, proc = run(cmd, folder / "cache")
                times[name].append(seconds)
                outputs[name] = proc.stdout
                notes.update(line for line in proc.stderr.splitlines() if line.strip())
            a, b = (outputs[n] for n in list(commands)[:2])
            if a != b:
                raise RuntimeError(f"the optimized prediction differs from eager:\n{a}\n---\n{b}")
            print(f"repeat {i + 1}/{args.repeats}: " + ", ".join(f"{n} {times[n][-1]:.2f} s" for n in commands),
                  flush=True)
    machine = dict(cpu=cpu.cpu_model(), isa=cpu.isa(), cores=os.cpu_count(), torch_threads=torch.get_num_threads(),
                   torch=torch.__version__, python=sys.version.split()[0],
                   load_average=[round(v, 2) for v in os.getloadavg()])
    print(f"\n{machine['cpu']}, ISA {machine['isa']}, {machine['cores']} cores, torch {machine['torch']}; "
          f"load average at the end {machine['load_average']}")
    rows = []
    for name, ts in times.items():
        row = dict(command=name, median_s=round(statistics.median(ts), 3), min_s=round(min(ts), 3),
                   max_s=round(max(ts), 3), times_s=[round(t, 3) for t in ts])
        rows.append(row)
        print(f"| {name} | {row['median_s']:.2f} [{row['min_s']:.2f}-{row['max_s']:.2f}] |")
    if notes:
        print("stderr lines seen:\n  " + "\n  ".join(sorted(notes)))
    if args.json:
        atomic_write(Path(args.json), (json.dumps(dict(machine=machine, repeats=args.repeats, rows=rows,
                                                       stderr=sorted(notes)), indent=1) + "\n").encode())
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
