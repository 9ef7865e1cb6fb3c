"""Start-up cost: ``import vitlab`` and ``vitlab --help`` import no capability, no plotting or peer library and not
even torch (the subcommands' parsers are built when the command line names one)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "src" / "vitlab"
# capability packages by convention (as tests/test_registry.py): the ones with Trainer tasks or models of their own
CAPABILITIES = sorted(p.name for p in PKG.iterdir() if (p / "tasks.py").exists() or (p / "model_configs.py").exists())
# heavy at import and needed by none of this: torch alone is most of a second and ~0.8 GB here
HEAVY = ("torch", "torchvision", "matplotlib", "transformers", "scipy", "sklearn", "skimage", "timm", "rich")


def _modules_after(code: str) -> set[str]:
    """The modules imported by running ``code`` in a fresh interpreter (a SystemExit from --help is fine)."""
    script = ("import json, sys\ntry:\n" + textwrap.indent(code, "    ")
              + "\nexcept SystemExit as e:\n    assert e.code == 0, e.code\nprint(json.dumps(sorted(sys.modules)))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return set(json.loads(proc.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("code", [
    "import vitlab",
    "import vitlab.cli; vitlab.cli.build_parser()",
    "from vitlab.cli import main; main(['--help'])",
])
def test_start_up_imports_no_capability_and_no_heavy_library(code):
    assert {"clip", "dense", "classify"} <= set(CAPABILITIES)
    loaded = _modules_after(code)
    caps = sorted(c for c in CAPABILITIES if f"vitlab.{c}" in loaded)
    heavy = sorted(h for h in HEAVY if h in loaded)
    assert not caps and not heavy, f"{code!r} imported {caps + heavy}"
    # the command line's own light modules only: its parser classes, no subcommand yet
    assert set(m for m in loaded if m.startswith("vitlab.")) <= {"vitlab.cli", "vitlab.cli._dataclass_args"}


def test_the_public_names_still_resolve_on_first_use():
    out = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import vitlab
        assert "create_model" in dir(vitlab) and callable(vitlab.optimize.optimize)
        print(vitlab.create_model("vit_pico_patch8_32").__class__.__name__, vitlab.is_model("deit_tiny_patch16_224"),
              vitlab.CheckpointError.__module__, vitlab.profile_model.__module__)
    """)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["VisionTransformer", "True", "vitlab.convert", "vitlab.profile"]
