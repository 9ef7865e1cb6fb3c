"""One rich console for every subcommand; wide when writing to a pipe or a log, so tables are not squeezed."""

import sys

from rich.console import Console

console = Console(width=None if sys.stdout.isatty() else 160)
