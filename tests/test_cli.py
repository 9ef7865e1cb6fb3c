"""The command line: thin over the API, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

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


def test_every_command_is_listed_with_the_module_that_registers_it():
    """``vitlab --help`` lists :data:`COMMANDS` without importing their modules: the table and the modules'
    ``register`` must agree, and every module of the package must be in it."""
    import pkgutil

    from vitlab import cli

    modules = {m.name for m in pkgutil.iter_modules(cli.__path__) if not m.name.startswith("_")}
    assert {module for module, _ in cli.COMMANDS.values()} == modules
    for module in sorted(modules):
        assert set(cli.command_parsers(module)) == {n for n, (m, _) in cli.COMMANDS.items() if m == module}


def test_top_level_help_and_errors(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert all(f"    {name} " in out for name in ("models", "train", "predict", "retrieval"))
    assert main(["bogus"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("vitlab: error: argument command: invalid choice: 'bogus'") and len(err.splitlines()) == 1
    assert main([]) == 2 and "required: command" in capsys.readouterr().err


def test_a_named_command_builds_its_own_parser(capsys):
    with pytest.raises(SystemExit) as e:
        main(["predict", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: vitlab predict") and "--no-optimize" in out
    assert main(["info"]) == 2  # the subcommand's own parser: its one-line error names it
    assert capsys.readouterr().err == ("vitlab: error: the following arguments are required: name (see vitlab info "
                                       "--help)\n")
    assert main(["info", "deit_tiny_patch16_224", "--no-such-flag"]) == 2
    assert capsys.readouterr().err == "vitlab: error: unrecognized arguments: --no-such-flag (see vitlab --help)\n"
