"""The ``vitlab`` command line: a thin layer over the Python API (parse, call, print).

Each module of this package adds its subcommands through ``register(subparsers)``:

    vitlab models [PATTERN ...] [--json]     registered models with params, GMACs and input size   (models.py)
    vitlab info NAME                         a model's config record, structure and profile        (models.py)
    vitlab bench attention|models|ladder|tokens   benchmarks                                       (bench.py)

    vitlab train|eval|predict                training, and evaluation / prediction by the run's task (train.py)
    vitlab pretrain|probe                    self-supervised pre-training, linear / k-NN probes    (pretrain.py)
    vitlab analyze TOOL                      analysis tools: JSON + PNG                            (analyze.py)
    vitlab export MODEL|RUN --format F       ONNX / .pt2 / TorchScript, validated against eager    (export.py)
    vitlab zeroshot | vitlab retrieval       CLIP zero-shot classification and retrieval           (zeroshot.py,
                                                                                                    retrieval.py)

Plugins: ``vitlab --import MODULE ...`` or ``vitlab train --import MODULE ...`` (repeatable) imports a user's
module first, so the tasks, datasets, dense heads, SSL methods and models it registers are there; installed
packages are found through the entry-point group ``vitlab.plugins``.

User errors (bad flags, names, paths, data) print one line ``vitlab: error: ...`` and exit with code 2: the
parsers raise instead of printing argparse's usage block (``_dataclass_args.Parser``).
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

import vitlab
from vitlab.cli._dataclass_args import Parser
from vitlab.convert import CheckpointError

USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, CheckpointError)


def build_parser() -> Parser:
    p = Parser(prog="vitlab", description="Build, train, benchmark and analyse Vision Transformers.")
    p.add_argument("--version", action="version", version=f"vitlab {vitlab.__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    for mod in sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")):
        importlib.import_module(f"{__name__}.{mod}").register(sub)
    return p


def import_plugins(argv: list[str]) -> list[str]:
    """Import the modules named by ``--import MODULE`` / ``--import=MODULE`` anywhere in ``argv`` and the
    installed ``vitlab.plugins`` entry points; returns ``argv`` without the ``--import`` flags."""
    from vitlab.train.task import load_plugins

    rest, modules, i = [], [], 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--import":
            if i + 1 >= len(argv):
                raise ValueError("--import needs a module name")
            modules.append(argv[i + 1])
            i += 2
            continue
        if tok.startswith("--import="):
            modules.append(tok.partition("=")[2])
        else:
            rest.append(tok)
        i += 1
    if modules:
        sys.path.insert(0, "")  # a module beside the working directory, as `python -m` finds it
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise ValueError(f"--import {name}: {e}") from None
    load_plugins()
    return rest


def main(argv: list[str] | None = None) -> int:
    try:
        argv = import_plugins(list(sys.argv[1:] if argv is None else argv))
        args = build_parser().parse_args(argv)
        return args.func(args)
    except USER_ERRORS as e:  # user errors: one line, no traceback
        print(f"vitlab: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("vitlab: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
