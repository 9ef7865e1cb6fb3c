"""Start-up of the command line as a new user meets it: ``vitlab predict`` on two images of a tiny run with empty
caches against ``vitlab predict --no-optimize``, and ``vitlab --help``, with ``python -c "import torch"`` for
reference.

    python benchmarks/predict_startup.py                                   # 5 repeats
    python benchmarks/predict_startup.py --repeats 7 --json startup.json   # times, peak memory, machine

A run of the default model (``vit_pico_patch8_32`` on digits) is trained for one epoch in a temporary folder; the
images are two random 32 x 32 PNGs. Every repeat runs each command once in a fresh process, in an order reversed
every other repeat (a shared machine's drift falls on all alike), and gives it empty caches: ``VITLAB_CACHE_DIR``
(vitlab.optimize's choices, the HiLo kernels), ``TORCH_EXTENSIONS_DIR`` and ``TORCHINDUCTOR_CACHE_DIR`` in a new
folder. Both predictions must print the same labels. Prints the median and [min-max] wall seconds of each command
and its median peak resident memory (Linux's ``wait4``). This process imports nothing but the standard library
(the images and the machine's description come from child processes): a child's peak memory counts its parent's
until it starts its program.
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

from vitlab._io import atomic_write

IMAGES = """
import sys
import numpy as np
from PIL import Image
rng = np.random.default_rng(0)
for path in sys.argv[1:]:
    Image.fromarray((rng.random((32, 32, 3)) * 255).astype(np.uint8)).save(path)
"""
MACHINE = """
import json, os, sys, torch
from vitlab.optimize import cpu
print(json.dumps(dict(cpu=cpu.cpu_model(), isa=cpu.isa(), cores=os.cpu_count(), torch_threads=torch.get_num_threads(),
                      torch=torch.__version__, python=sys.version.split()[0])))
"""


def vitlab_command() -> list[str]:
    """The ``vitlab`` console script beside this interpreter (what a user runs), else ``python -m vitlab``."""
    script = Path(sys.executable).with_name("vitlab")
    return [str(script)] if script.exists() else [sys.executable, "-m", "vitlab"]


def run(cmd: list[str], cache: Path) -> tuple[float, float, str, str]:
    """``cmd`` in a fresh process whose caches are the empty folder ``cache``: (wall seconds, peak resident MB,
    stdout, stderr)."""
    shutil.rmtree(cache, ignore_errors=True)
    env = {**os.environ, "VITLAB_CACHE_DIR": str(cache), "TORCH_EXTENSIONS_DIR": str(cache / "torch_extensions"),
           "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor")}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(proc.pid, 0)  # the child's own peak memory, which subprocess.run does not give
        seconds = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: tell the Popen object
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{stderr[-3000:]}")
    return seconds, usage.ru_maxrss / 1024, stdout, stderr


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5, help="runs of each command (median and min-max reported)")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the times and the machine as JSON")
    args = ap.parse_args()
    vitlab = vitlab_command()
    with tempfile.TemporaryDirectory(prefix="vitlab-startup-") as tmp:
        folder = Path(tmp)
        print("training a one-epoch run ...", flush=True)  # with empty caches too: nothing of a user's is read
        run([*vitlab, "train", "--epochs", "1", "--quiet", "--output_dir", str(folder / "run")], folder / "cache")
        images = [str(folder / "two.png"), str(folder / "images.png")]
        subprocess.run([sys.executable, "-c", IMAGES, *images], check=True)
        predict = [*vitlab, "predict", "--checkpoint", str(folder / "run" / "best"), *images]
        commands = {"vitlab predict (2 images, empty cache)": predict,
                    "vitlab predict --no-optimize (2 images)": [*predict, "--no-optimize"],
                    "vitlab --help": [*vitlab, "--help"],
                    "python -c 'import torch'": [sys.executable, "-c", "import torch"]}
        times: dict[str, list[float]] = {name: [] for name in commands}
        rss: dict[str, list[float]] = {name: [] for name in commands}
        notes = set()
        order = list(commands.items())
        for i in range(args.repeats):
            outputs = {}
            for name, cmd in order if i % 2 == 0 else order[::-1]:
                seconds, mb, outputs[name], stderr = run(cmd, folder / "cache")
                times[name].append(seconds)
                rss[name].append(mb)
                notes.update(line for line in stderr.splitlines() if line.strip())
            a, b = (outputs[n] for n in list(commands)[:2])
            if a != b:
                raise RuntimeError(f"the optimized prediction differs from eager:\n{a}\n---\n{b}")
            print(f"repeat {i + 1}/{args.repeats}: " + ", ".join(f"{n} {times[n][-1]:.2f} s" for n in commands),
                  flush=True)
    machine = json.loads(subprocess.run([sys.executable, "-c", MACHINE], check=True, capture_output=True,
                                        text=True).stdout)
    machine["load_average"] = [round(v, 2) for v in os.getloadavg()]
    print(f"\n{machine['cpu']}, ISA {machine['isa']}, {machine['cores']} cores, torch {machine['torch']}; "
          f"load average at the end {machine['load_average']}")
    print("| command | seconds, median [min-max] | peak MB |")
    rows = []
    for name, ts in times.items():
        row = dict(command=name, median_s=round(statistics.median(ts), 3), min_s=round(min(ts), 3),
                   max_s=round(max(ts), 3), times_s=[round(t, 3) for t in ts],
                   peak_rss_mb=round(statistics.median(rss[name]), 1))
        rows.append(row)
        print(f"| {name} | {row['median_s']:.2f} [{row['min_s']:.2f}-{row['max_s']:.2f}] | {row['peak_rss_mb']:.0f} |")
    if notes:
        print("stderr lines seen:\n  " + "\n  ".join(sorted(notes)))
    if args.json:
        atomic_write(Path(args.json), (json.dumps(dict(machine=machine, repeats=args.repeats, rows=rows,
                                                       stderr=sorted(notes)), indent=1) + "\n").encode())
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
