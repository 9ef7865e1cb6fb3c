"""Regenerate the model table in README.md from the registry (so it never drifts from the code).

Usage: python scripts/gen_model_table.py [--check]   (--check exits 1 when the README is out of date)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vitlab.profile import model_rows

README = Path(__file__).resolve().parents[1] / "README.md"
START, END = "<!-- model-table:start -->", "<!-- model-table:end -->"


def render() -> str:
    lines = ["| model | family | task | params (M) | GMACs | input | published params (M) / GMACs / top-1 |",
             "|---|---|---|---:|---:|---|---|"]
    for r in model_rows():
        pub = " / ".join("-" if v is None else f"{v:g}" for v in
                         (r["published_params_m"], r["published_gmacs"], r["published_top1"]))
        lines.append(f"| `{r['name']}` | {r['family']} | {r['task']} | {r['params_m']:.2f} | {r['gmacs']:.2f} | "
                     f"{r['input_size'][1]}x{r['input_size'][2]} | {pub} |")
    return "\n".join(lines)


def updated(text: str) -> str:
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{render()}\n{END}{tail}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    text = README.read_text()
    new = updated(text)
    if args.check:
        return int(new != text)
    README.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
