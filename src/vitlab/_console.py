"""The one rich console of vitlab (training progress and epoch lines, CLI tables); wide when writing to a pipe or
a log, so tables are not squeezed and one epoch stays one line."""

import sys

from rich.console import Console

console = Console(width=None if sys.stdout.isatty() else 160)
