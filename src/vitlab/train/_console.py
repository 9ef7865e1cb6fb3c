"""The console training writes to (progress bar, epoch lines); wide when writing to a pipe or a log."""

import sys

from rich.console import Console

console = Console(width=None if sys.stdout.isatty() else 160)
