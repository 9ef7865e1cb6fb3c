"""Markdown table of ``benchmarks/optimize_vs_timm.py`` results (one or more JSON files, e.g. both ISAs).

    python benchmarks/table_optimize_vs_timm.py docs/bench/optimize_vs_timm_xeon/*.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def table(paths: list[str]) -> str:
    lines = ["| model | ISA | `optimize` backend | optimize / timm+compile [min-max] | img/s optimize / timm+compile "
             "| eager / timm eager [min-max] | img/s eager / timm eager |",
             "|---|---|---|---|---|---|---|"]
    machines = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        m = data["machine"]
        machines.append(f"- `{path}`: CPU {m['cpu']}, ISA `{m['isa']}`, {m['threads']} threads, torch {m['torch']}, "
                        f"load average at start {m['loadavg_start']}; `{data['command']}` ({data['date']})")
        isa = m["isa"].split("+")[0]
        for r in data["results"]:
            o, e, ips = r["optimize_vs_timm_compile"], r["eager_vs_timm_eager"], r["img_per_s"]
            lines.append(
                f"| {r['model']} | {isa} | {r['backend']} | **{o['median']:.2f}x** [{o['min']:.2f}-{o['max']:.2f}] | "
                f"{ips['vitlab.optimize']:.1f} / {ips['timm+compile']:.1f} | {e['median']:.2f}x "
                f"[{e['min']:.2f}-{e['max']:.2f}] | {ips['vitlab eager']:.1f} / {ips['timm eager']:.1f} |")
    return "\n".join(lines + [""] + machines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", help="JSON files written by benchmarks/optimize_vs_timm.py --json")
    args = ap.parse_args(argv)
    missing = [p for p in args.results if not Path(p).is_file()]
    if missing:
        ap.error(f"no such file: {missing[0]}")
    print(table(args.results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
