"""The README's model table is generated from the registry; it must be current."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_model_table_is_current():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_model_table.py"), "--check"], cwd=ROOT)
    assert proc.returncode == 0, "README model table is stale: run `make model-table`"
