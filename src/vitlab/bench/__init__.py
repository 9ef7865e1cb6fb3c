"""Benchmarks: throughput, parameters and MACs measured the same way for every registered component.

``bench_attention`` reproduces Table IV of the LITv2 / HiLo supplementary (one attention layer per
mechanism); ``write_json``, ``plot`` and ``format_table`` save and show its rows.
"""

from vitlab.bench.attention import attention_cost, bench_attention, format_table, plot, write_json
from vitlab.bench.paper_table_iv import TABLE_IV, paper_row

__all__ = ["TABLE_IV", "attention_cost", "bench_attention", "format_table", "paper_row", "plot", "write_json"]
