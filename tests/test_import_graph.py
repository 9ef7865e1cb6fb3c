"""No import cycles among vitlab's modules, lazy (function-level) imports included; ``TYPE_CHECKING`` blocks are
left out. The graph is read with ``ast`` from the source, then every module is imported for real."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = SRC / "vitlab"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The vitlab modules ``name`` imports (anywhere in the file but under ``if TYPE_CHECKING:``)."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()

    def visit(node):
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "vitlab":
                    out.add(a.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] == "vitlab":
                for a in node.names:
                    sub = f"{mod}.{a.name}"
                    out.add(sub if sub in known else mod)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    out.discard(name)
    return {m for m in out if m in known}


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, set(mods)) for name, path in mods.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None for a DAG."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(n: str):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                c = dfs(m)
                if c:
                    return c
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            c = dfs(n)
            if c:
                return c
    return None


def test_graph_reader_sees_lazy_imports_and_skips_type_checking():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}}
    assert find_cycle(g) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    graph = import_graph()
    assert "vitlab.registry" in graph["vitlab"] and "vitlab.train.trainer" in graph["vitlab.train"]


def test_vitlab_imports_form_a_dag():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("name", sorted(_modules()))
def test_every_module_imports(name):
    importlib.import_module(name)


def test_no_global_state_changed_at_import_or_by_plots(tmp_path):
    """Importing every module leaves the umask, torch's FLOP registry and matplotlib's backend alone; plots (the
    training curves, the benchmark figures) use the object API (no pyplot); counting registers nothing globally."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import importlib, os, sys
        def boom(*a):
            raise AssertionError("os.umask called")
        os.umask = boom
        import matplotlib
        backend = dict.__getitem__(matplotlib.rcParams, "backend")  # get_backend() would resolve it
        from torch.utils.flop_counter import flop_registry
        before = set(flop_registry)
        for name in {sorted(m for m in _modules() if m != "vitlab.__main__")!r}:
            importlib.import_module(name)
        assert set(flop_registry) == before, "FLOP formulas registered at import"
        import torch
        from vitlab._io import atomic_write
        from vitlab.profile import count_macs
        from vitlab.train.plots import confusion_png, curves_png
        atomic_write({str(tmp_path / "x.bin")!r}, b"x")
        rows = [{{"epoch": 1, "train_loss": 1.0, "val_loss": 1.0, "val_top1": 50.0, "ema_val_top1": 40.0}}]
        assert curves_png(rows)[:4] == b"\\x89PNG"
        assert confusion_png(torch.eye(3, dtype=torch.long), ["a", "b", "c"], "t")[:4] == b"\\x89PNG"
        from vitlab.bench import ladder, models
        ladder.plot([{{"rung": "eager", "img_per_s": 3.0, "peak_mem_mb": 9.0, "batch_size": 2, "model": "m",
                      "device": "cpu"}}], {str(tmp_path / "l.png")!r})
        models.plot([{{"impl": "vitlab", "gmacs": 1.0, "img_per_s": 3.0, "model": "m", "mode": "eager",
                      "device": "cpu", "dtype": "fp32", "batch_size": 2}}], {str(tmp_path / "m.png")!r})
        q = torch.randn(1, 2, 4, 8)
        count_macs(lambda x: torch.nn.functional.scaled_dot_product_attention(x, x, x), q)
        assert set(flop_registry) == before, "FLOP formulas registered by counting"
        assert "matplotlib.pyplot" not in sys.modules, "pyplot imported"
        assert dict.__getitem__(matplotlib.rcParams, "backend") == backend, "matplotlib backend switched"
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                       env={**__import__("os").environ, "PYTHONPATH": str(SRC)})
    assert r.returncode == 0, r.stderr[-3000:]
