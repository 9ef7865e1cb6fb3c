"""The ``vitlab`` command line: a thin layer over the Python API (parse, call, print).

Each subcommand is listed in :data:`COMMANDS` with the module of this package whose ``register(subparsers)``
builds its parser:

    vitlab models [PATTERN ...] [--json]     registered models with params, GMACs and input size   (models.py)
    vitlab info NAME                         a model's config record, structure and profile        (models.py)
    vitlab bench attention|models|ladder|tokens   benchmarks                                       (bench.py)

    vitlab train|eval|predict                training, and evaluation / prediction by the run's task (train.py)
    vitlab pretrain|probe                    self-supervised pre-training, linear / k-NN probes    (pretrain.py)
    vitlab analyze TOOL                      analysis tools: JSON + PNG                            (analyze.py)
    vitlab export MODEL|RUN --format F       ONNX / .pt2 / TorchScript, validated against eager    (export.py)
    vitlab zeroshot | vitlab retrieval       CLIP zero-shot classification and retrieval           (zeroshot.py,
                                                                                                    retrieval.py)

Start-up is lazy: ``vitlab --help`` imports none of those modules (nor torch); a subcommand's parser is built when
the command line names it, so each command imports only what it uses.

Plugins: ``vitlab --import MODULE ...`` or ``vitlab train --import MODULE ...`` (repeatable) imports a user's
module first, so the tasks, datasets, dense heads, SSL methods and models it registers are there; installed
packages are found through the entry-point group ``vitlab.plugins``, loaded before a subcommand's parser is built.

User errors (bad flags, names, paths, data) print one line ``vitlab: error: ...`` and exit with code 2: the
parsers raise instead of printing argparse's usage block (``_dataclass_args.Parser``).
"""

from __future__ import annotations

import argparse
import importlib
import sys

import vitlab
from vitlab.cli._dataclass_args import Parser

USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError)  # and vitlab.convert.CheckpointError

# subcommand -> (the module of this package that registers it, its line in `vitlab --help`)
COMMANDS: dict[str, tuple[str, str]] = {
    "models": ("models", "list registered models with params, GMACs and input size"),
    "info": ("models", "a model's config, structure and profile"),
    "bench": ("bench", "benchmarks: attention layers, whole models, the optimization ladder"),
    "train": ("train", "train a model (default: the default model on digits, on the CPU)"),
    "eval": ("train", "evaluate a checkpoint with its task's metrics (top-1, mIoU, zero-shot, k-NN)"),
    "predict": ("train", "run a checkpoint on images: labels, masks or depth maps by its task"),
    "pretrain": ("pretrain", "self-supervised pre-training: MAE, SimCLR, MoCo v3, DINO, DINOv2"),
    "probe": ("pretrain", "linear probe or k-NN on a backbone's frozen features"),
    "analyze": ("analyze", "analysis tools: attention maps, spectra, biases, timings, memory"),
    "export": ("export", "export a model to ONNX / ExportedProgram / TorchScript and validate it"),
    "zeroshot": ("zeroshot", "zero-shot classification with a CLIP checkpoint: top-1 / top-5"),
    "retrieval": ("retrieval", "image-text retrieval with a CLIP checkpoint: recall@1/5/10 both ways"),
    "generate": ("generate", "continue a prompt with a Llama language model, streaming the tokens"),
    "data": ("data", "streaming datasets: pack WebDataset shards, describe wds: / hf: data"),
}


def command_parsers(module: str) -> dict[str, argparse.ArgumentParser]:
    """The parsers of the subcommands ``vitlab.cli.<module>`` registers, by name, built now (plugins first: a
    plugin's tasks add flags to ``vitlab train``)."""
    from vitlab.plugins import load_plugins

    load_plugins()
    sub = Parser(prog="vitlab").add_subparsers(parser_class=Parser)
    importlib.import_module(f"{__name__}.{module}").register(sub)
    return dict(sub.choices)


class _Placeholder(argparse.ArgumentParser):
    """A subcommand whose parser is not built yet: its name and help line are all ``vitlab --help`` needs."""


class _Commands(argparse._SubParsersAction):
    """The subcommands of ``vitlab``: a placeholder each (enough for ``--help`` and the choice check) until the
    command line names one, whose module then builds its real parser."""

    def __call__(self, parser, namespace, values, option_string=None):
        if isinstance(self.choices.get(values[0]), _Placeholder):
            self.choices.update(command_parsers(COMMANDS[values[0]][0]))
        super().__call__(parser, namespace, values, option_string)


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser, with every subcommand of :data:`COMMANDS` as a placeholder built on use."""
    p = Parser(prog="vitlab", description="Build, train, benchmark and analyse Vision Transformers.")
    p.register("action", "parsers", _Commands)
    p.add_argument("--version", action="version", version=f"vitlab {vitlab.__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Placeholder)
    for name, (_, text) in COMMANDS.items():
        sub.add_parser(name, help=text, add_help=False)
    return p


def import_plugins(argv: list[str]) -> list[str]:
    """Import the modules named by ``--import MODULE`` / ``--import=MODULE`` anywhere in ``argv``; returns ``argv``
    without the ``--import`` flags. (The ``vitlab.plugins`` entry points load with a subcommand's parser.)"""
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
    return rest


def _user_error(e: Exception) -> bool:
    """Whether ``e`` is the user's (a bad flag, name, path or file): one line, exit code 2, no traceback."""
    if isinstance(e, USER_ERRORS):
        return True
    convert = sys.modules.get("vitlab.convert")  # a CheckpointError can only come from there once it is loaded
    return convert is not None and isinstance(e, convert.CheckpointError)


def main(argv: list[str] | None = None) -> int:
    try:
        argv = import_plugins(list(sys.argv[1:] if argv is None else argv))
        args = build_parser().parse_args(argv)
        return args.func(args)
    except Exception as e:
        if not _user_error(e):
            raise
        print(f"vitlab: error: {e}", file=sys.stderr)  # user errors: one line, no traceback
        return 2
    except KeyboardInterrupt:
        print("vitlab: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
