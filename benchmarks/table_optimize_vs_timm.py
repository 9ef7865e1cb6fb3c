"""Markdown table of ``benchmarks/optimize_vs_timm.py`` results (one or more JSON files, e.g. both ISAs).

    python benchmarks/table_optimize_vs_timm.py docs/bench/optimize_vs_timm_avx512.json \\
        docs/bench/optimize_vs_timm_avx2.json
"""

from __future__ import annotations

import json
import sys


def table(paths: list[str]) -> str:
    lines = ["| model | ISA | `optimize` backend | optimize / timm+compile [min-max] | img/s optimize / timm+compile "
             "| eager / timm eager [min-max] | img/s eager / timm eager |",
             "|---|---|---|---|---|---|---|"]
    machines = []
    for path in paths:
        data = json.load(open(path))
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


if __name__ == "__main__":
    print(table(sys.argv[1:]))
