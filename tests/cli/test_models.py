"""``vitlab info`` for a language model: the exact parameter count and the article's serving estimate, without
allocating the weights (the model is built on the ``meta`` device)."""

from __future__ import annotations

import resource

from vitlab.cli import main


def test_info_llama2_7b(capsys):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert main(["info", "llama2_7b"]) == 0
    out = capsys.readouterr().out
    assert "6,738,415,616" in out
    assert "serving estimate with the paper's 7B parameters: 33.6 GB fp32, 16.8 / 8.4 / 4.2 GB at 16 / 8 / 4 bits" \
        in out
    assert "family=llama  task=generate" in out and "context 4096 tokens  vocabulary 32000  dim 4096" in out
    grown_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kb < 2_000_000  # far below the 27 GB of fp32 weights
