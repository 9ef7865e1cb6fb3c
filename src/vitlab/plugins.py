"""Plugins: installed packages that extend vitlab through the entry-point group ``vitlab.plugins``.

Importing a plugin's module registers what it defines -- tasks, datasets, dense heads, SSL methods, models --
with the ordinary decorators. :func:`load_plugins` imports every installed one once; the training engine, the
SSL registry and the command line call it before they look a name up. Importing this module imports nothing else
of vitlab (nor torch), so the command line can load plugins before it builds a parser.
"""

from __future__ import annotations

_LOADED = False


def load_plugins() -> None:
    """Import the module of every entry point in the group ``vitlab.plugins`` (once per process)."""
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    from importlib.metadata import entry_points

    for ep in entry_points(group="vitlab.plugins"):
        ep.load()
