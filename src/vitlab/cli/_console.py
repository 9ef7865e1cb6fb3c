"""Kept for ``cli/bench.py``: the console lives in :mod:`vitlab._console` (one console for the whole package)."""

from vitlab._console import console

__all__ = ["console"]
