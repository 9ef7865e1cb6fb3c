"""The one rich console of vitlab (training progress and epoch lines, CLI tables) and the plain lines written
through it: wide when writing to a pipe or a log, so tables are not squeezed, and never wrapping a log line."""

import os
import sys

from rich.console import Console

console = Console(width=None if sys.stdout.isatty() else 160)


def say(msg: str) -> None:
    """``msg`` as one line on the console (never wrapped, so a path or a value is not cut in two in a log),
    flushed so a log file gets each line as it happens."""
    console.print(msg, highlight=False, markup=False, soft_wrap=True)
    console.file.flush()


def progress_interval() -> float:
    """Seconds between two plain progress lines when the output is not a terminal: ``VITLAB_PROGRESS_INTERVAL``,
    default 30 (0: a line every step)."""
    text = os.environ.get("VITLAB_PROGRESS_INTERVAL", "30")
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:  # also refuses nan
        raise ValueError(f"VITLAB_PROGRESS_INTERVAL must be a number of seconds >= 0, got {text!r}")
    return seconds


def clock(seconds: float) -> str:
    """A duration as ``M:SS`` or ``H:MM:SS``."""
    minutes, s = divmod(round(seconds), 60)
    h, m = divmod(minutes, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def metric_text(name: str, value: float) -> str:
    """One metric as every printout shows it: a percentage (``top1``, ``top5`` ...) with two decimals and ``%``,
    anything else (mIoU, a loss) with four significant digits."""
    return f"{value:.2f}%" if name.startswith("top") else f"{value:.4g}"
