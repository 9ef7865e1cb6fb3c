"""The ``vitlab`` command line: a thin layer over the Python API (parse, call, print).

Each module of this package adds its subcommands through ``register(subparsers)``:

    vitlab models [PATTERN ...] [--json]     registered models with params, GMACs and input size   (models.py)
    vitlab info NAME                         a model's config record, structure and profile        (models.py)
    vitlab bench attention|models|ladder|tokens   benchmarks                                       (bench.py)

    vitlab train|eval|predict                training and evaluation (any task: classify, ssl, dense, clip)  (train.py)
    vitlab pretrain|probe                    self-supervised pre-training, linear / k-NN probes    (pretrain.py)
    vitlab analyze TOOL                      analysis tools: JSON + PNG                            (analyze.py)
    vitlab export MODEL|RUN --format F       ONNX / .pt2 / TorchScript, validated against eager    (export.py)
    vitlab zeroshot | vitlab retrieval       CLIP zero-shot classification and retrieval           (zeroshot.py,
                                                                                                    retrieval.py)

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


def main(argv: list[str] | None = None) -> int:
    try:
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
