"""Every family's smallest registered model (or, with ``--all``, every registered model) at its default size,
exported with a dynamic batch to ONNX (validated with ONNX Runtime) and to an ExportedProgram (validated through
``torch.export.load``): ok, max abs diff vs eager on random and real images, file size, export time.

    python benchmarks/export_families.py                  # writes docs/bench/export_families.json
    python benchmarks/export_families.py --all --threads 1   # every registered model, smallest first; a model that
                                                             # needs more memory than the machine has is recorded
                                                             # as skipped
    python benchmarks/export_families.py --models levit_128s swin_tiny_patch4_window7_224
    python benchmarks/export_families.py --smoke --out docs/bench/export_families_smoke.json   # reduced depth
                                                                     # and size (the config's smoke_kwargs)
    python benchmarks/export_families.py --smoke --dynamic-img-size --out docs/bench/export_dynamic_smoke.json
                                                   # symbolic height and width too, validated at 3+ sizes
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

import vitlab
import vitlab.export as ex
from vitlab._io import atomic_write
from vitlab.bench.attention import machine

# smoke sizes that are a single stride step (a 1x1 last grid, which torch.export specialises): the smallest size a
# dynamic image size covers instead
DYNAMIC_SMOKE_SIZE = {"mobilevit": 128}


def export_both(name: str, tmp: Path, dynamic_img_size: bool, kw: dict) -> dict:
    """ONNX and .pt2 results of one model (a refusal or an error recorded as such); the files are removed."""
    row = {}
    for fmt, fn, suffix in (("onnx", ex.onnx, ".onnx"), ("exported", ex.exported_program, ".pt2")):
        path = tmp / f"{name}{suffix}"
        try:
            r = fn(name, path, dynamic_img_size=dynamic_img_size, **kw)
            row["img_size"] = r.meta.img_size
            row[fmt] = {"ok": r.ok, "max_abs_diff": r.max_abs_diff, "diffs": r.diffs, "exporter": r.exporter,
                        "notes": r.notes, "size_mib": r.size_bytes / 2**20, "seconds": r.seconds}
            print("\n".join(r.lines()), flush=True)
        except ValueError as e:  # refused with a reason (no dynamic image size)
            row[fmt] = {"ok": False, "refused": str(e)}
            print(f"{name} {fmt}: refused: {e}", flush=True)
        except Exception as e:  # noqa: BLE001  recorded in the table as a failure
            row[fmt] = {"ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
            print(f"{name} {fmt}: FAILED {row[fmt]['error']}", flush=True)
        for f in (path, path.with_name(path.name + ".data")):  # .data: ONNX weights over 2 GiB
            f.unlink(missing_ok=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=None)
    p.add_argument("--all", action="store_true", help="every registered model, fewest parameters first")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--smoke", action="store_true", help="each model's smoke_kwargs (fewer blocks, smaller image)")
    p.add_argument("--dynamic-img-size", action="store_true", help="symbolic height and width (refusals recorded)")
    p.add_argument("--out", default="docs/bench/export_families.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    names = args.models or (sorted(vitlab.list_models(), key=ex.num_params) if args.all else ex.smallest_per_family())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            cfg = vitlab.get_model_config(name)
            kw = dict(cfg.smoke_kwargs) if args.smoke else {}
            if args.smoke and args.dynamic_img_size and cfg.family in DYNAMIC_SMOKE_SIZE:
                kw["img_size"] = DYNAMIC_SMOKE_SIZE[cfg.family]
            row = {"model": name, "family": cfg.family, "kwargs": kw, "params_m": ex.num_params(name, **kw) / 1e6}
            row["skipped"] = ex.too_big_to_export(name, **kw)
            if row["skipped"]:
                print(f"skipped: {row['skipped']}", flush=True)
            else:
                row.update(export_both(name, Path(tmp), args.dynamic_img_size, kw))
            rows.append(row)
            out = {"machine": machine(), "torch": torch.__version__,
                   "onnxruntime": __import__("onnxruntime").__version__, "rows": rows}
            atomic_write(args.out, json.dumps(out, indent=2).encode())  # after every model: a partial table survives
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
