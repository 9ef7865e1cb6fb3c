"""The command line: thin over the API, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

from vitlab.cli import main


def test_models_json(capsys):
    assert main(["models", "deit_tiny*", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == ["deit_tiny_distilled_patch16_224", "deit_tiny_patch16_224"]
    assert rows[1]["params_m"] == 5.72 and rows[1]["input_size"] == [3, 224, 224]


def test_models_table_and_info(capsys):
    assert main(["models", "halvit_base*"]) == 0
    assert "halvit_base_patch16_224" in capsys.readouterr().out
    assert main(["info", "vit_tiny_patch16_224"]) == 0
    out = capsys.readouterr().out
    assert "GMACs" in out and "5.72" in out


def test_unknown_model_is_one_line_error():
    proc = subprocess.run([sys.executable, "-m", "vitlab", "info", "vit_bse_patch16_224"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        proc.stderr.strip()] and "close matches: vit_base_patch16_224" in proc.stderr
    assert "Traceback" not in proc.stderr
