"""vitlab's import graph: every import points down the layers of ``docs/CONTRIBUTING.md`` (never up, never
sideways between capabilities or between the measuring packages), and no module imports one that imports it back.
Lazy (function-level) imports and ``vitlab.NAME`` attribute uses count; ``TYPE_CHECKING`` blocks are left out.
The graph is read with ``ast`` from the source, then every module is imported for real."""

from __future__ import annotations

import ast
import functools
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


@functools.cache
def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _dotted(node: ast.expr) -> str | None:
    """``a.b.c`` for a chain of attributes on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


def _from_module(name: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    """The absolute module of ``from X import ...`` in module ``name`` (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The vitlab modules ``name`` imports (anywhere in the file but under ``if TYPE_CHECKING:``)."""
    tree = _parse(path)
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
        elif isinstance(node, ast.Attribute):  # ``vitlab.optimize.optimize(...)`` after ``import vitlab``
            dotted = _dotted(node)
            while dotted and dotted.split(".")[0] == "vitlab" and dotted not in known:
                dotted = dotted.rpartition(".")[0]
            if dotted:
                out.add(dotted)
        elif isinstance(node, ast.ImportFrom):
            mod = _from_module(name, is_pkg, node)
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


# The layers, bottom first: a module may import its own package, the packages of its layer when the layer says so,
# and every layer below. "" is the ``vitlab`` package itself (it resolves the registry's, the profiler's and the
# checkpoint loader's names on first use). Packages that do not exist yet have their place already.
LAYERS: list[tuple[str, tuple[str, ...], bool]] = [  # (layer, vitlab's top-level modules and packages, sideways)
    ("utilities", ("_io", "_console", "plugins"), True),
    ("layers", ("layers",), False),
    ("attention", ("attention",), False),
    ("models", ("models", "registry", "profile", "timing", "convert", ""), True),  # + counting, timing, key maps
    ("data", ("data", "text"), False),  # datasets and tokenizers, below the engine that reads them
    ("engine", ("train",), False),
    ("optimize", ("optimize",), False),
    ("capabilities", ("ssl", "dense", "clip", "vlm", "tome", "prune", "classify"), False),
    ("measure, draw, ship", ("bench", "analysis", "export"), False),
    ("command line", ("cli", "__main__"), True),
]
RANK = {pkg: (i, layer, sideways) for i, (layer, pkgs, sideways) in enumerate(LAYERS) for pkg in pkgs}


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """One line per import that points up or sideways, and per module whose package has no layer."""
    bad = []
    for a in sorted(graph):
        pa = _package(a)
        if pa not in RANK:
            bad.append(f"{a}: vitlab.{pa} has no place in LAYERS")
            continue
        for b in sorted(graph[a]):
            pb = _package(b)
            if pb == pa or pb not in RANK:
                continue  # its own package; an unplaced one is reported as a module of its own
            (ra, layer, sideways), (rb, _, _) = RANK[pa], RANK[pb]
            if rb < ra or (rb == ra and sideways):
                continue
            where = f"sideways within {layer}" if rb == ra else f"up from {layer} to {RANK[pb][1]}"
            bad.append(f"{a} -> {b} ({where})")
    return bad


def test_layer_check_catches_upward_and_sideways_imports():
    graph = {"vitlab.layers.mlp": {"vitlab.attention.msa"},              # up
             "vitlab.tome.patch": {"vitlab.ssl.base"},                   # sideways between capabilities
             "vitlab.analysis.timings": {"vitlab.bench.timing"},         # sideways between measuring packages
             "vitlab.train.evaluate": {"vitlab.optimize"},               # the engine reaching up
             "vitlab.data.core": {"vitlab.train.task"},                  # data below the engine
             "vitlab.newpkg": set(),                                     # unplaced
             "vitlab.models.deit": {"vitlab.registry", "vitlab.models.vision_transformer", "vitlab.layers"},
             "vitlab.registry": {"vitlab.convert"},                      # beside models
             "vitlab.bench.tokens": {"vitlab.tome.patch", "vitlab.timing", "vitlab._io"},
             "vitlab.cli.bench": {"vitlab.cli", "vitlab.bench", "vitlab"}}
    bad = layer_violations(graph)
    assert [line.split(" ")[0] for line in bad] == [
        "vitlab.analysis.timings", "vitlab.data.core", "vitlab.layers.mlp", "vitlab.newpkg:", "vitlab.tome.patch",
        "vitlab.train.evaluate"], bad


def test_imports_point_down_the_layers():
    """docs/CONTRIBUTING.md's layers, held: a module imports only down (or within its layer where the layer allows
    it), and every top-level module or package of vitlab has its place in LAYERS."""
    bad = layer_violations(import_graph())
    assert not bad, "imports against the layers of docs/CONTRIBUTING.md:\n" + "\n".join(bad)


# The packages above the models that must reach a model only through ``vitlab.models`` (its re-exported names and
# the token interface), never through a family's module.
ABOVE_MODELS = ("ssl", "dense", "clip", "vlm", "tome", "prune", "classify", "bench", "analysis", "export")


def family_imports(graph: dict[str, set[str]]) -> set[str]:
    """``a -> b`` for every module a of a package above the models importing a module b of ``vitlab.models``
    (a family's, or a private one: ``vitlab.models`` itself is the public face)."""
    return {f"{a} -> {b}" for a in graph if _package(a) in ABOVE_MODELS for b in graph[a]
            if b.startswith("vitlab.models.")}


def test_capabilities_reach_models_through_their_public_names():
    """docs/CONTRIBUTING.md: token merging, pruning, SSL, dense, CLIP, vision-language models and the measuring
    packages use ``vitlab.models``'s names and the token interface, never a family module."""
    assert family_imports({"vitlab.tome.patch": {"vitlab.models", "vitlab.registry"},
                           "vitlab.ssl.mae": {"vitlab.models.vision_transformer"},
                           "vitlab.export.onnx": {"vitlab.models._base"},
                           "vitlab.models.deit": {"vitlab.models.vision_transformer"}}) == {
        "vitlab.ssl.mae -> vitlab.models.vision_transformer", "vitlab.export.onnx -> vitlab.models._base"}
    found = family_imports(import_graph())
    assert not found, "import the name from vitlab.models instead:\n" + "\n".join(sorted(found))


# The utility modules every package shares: private by name (not part of the user's API), public to vitlab.
SHARED_UTILITIES = ("_io", "_console")


def _private(dotted: str) -> bool:
    """Whether ``vitlab.a.b...`` names a private (``_name``, not ``__dunder__``) module or member, the shared
    utility modules themselves left out."""
    parts = dotted.split(".")[1:]
    if parts and parts[0] in SHARED_UTILITIES:
        parts = parts[1:]
    return any(p.startswith("_") and not p.startswith("__") for p in parts)


def private_uses(name: str, path: Path) -> set[str]:
    """``name -> vitlab.x.y._z`` for every private module or member of another vitlab package that ``name``
    imports or reaches as an attribute of an imported name (``HiLo._forward``, ``vitlab.models._base.X``)."""
    tree = _parse(path)
    own = _package(name)
    is_pkg = path.name == "__init__.py"
    bound: dict[str, str] = {}  # local name -> the vitlab name it was imported as
    out: set[str] = set()

    def other(dotted: str) -> bool:
        return dotted.split(".")[0] == "vitlab" and _package(dotted) != own

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if other(a.name) and _private(a.name):
                    out.add(a.name)
                if a.name.split(".")[0] == "vitlab":
                    bound[a.asname or "vitlab"] = a.name if a.asname else "vitlab"
        elif isinstance(node, ast.ImportFrom):
            mod = _from_module(name, is_pkg, node)
            for a in node.names:
                full = f"{mod}.{a.name}"
                if other(full) and _private(full):
                    out.add(full)
                if mod.split(".")[0] == "vitlab":
                    bound[a.asname or a.name] = full
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner:  # the whole chain, once
            dotted = _dotted(node)
            head, _, rest = (dotted or "").partition(".")
            if head in bound and rest:
                full = f"{bound[head]}.{rest}"
                if other(full) and _private(full):
                    out.add(full)
    return {f"{name} -> {u}" for u in out}


def test_private_names_stay_in_their_package(tmp_path):
    """docs/CONTRIBUTING.md: a package uses another's public names only, never a ``_private`` module or member
    (a private name may change with its package); the shared utility modules (``vitlab._io``,
    ``vitlab._console``) are public to every package."""
    src = tmp_path / "m.py"
    src.write_text("import vitlab\nfrom vitlab import _io\nfrom vitlab._io import atomic_write, _fsync_dir\n"
                   "from vitlab.attention.hilo import HiLo\nfrom vitlab.models._base import TokenModel\n"
                   "from vitlab.analysis._common import pick\nfrom . import _common\n"
                   "HiLo._forward, HiLo.hifi, HiLo.__name__, vitlab.optimize._core.x, _io.atomic_write\n")
    assert private_uses("vitlab.analysis.m", src) == {f"vitlab.analysis.m -> {u}" for u in (
        "vitlab._io._fsync_dir", "vitlab.attention.hilo.HiLo._forward", "vitlab.models._base.TokenModel",
        "vitlab.optimize._core.x")}
    found = set().union(*(private_uses(n, p) for n, p in _modules().items()))
    assert not found, "use (or make) a public name of the other package:\n" + "\n".join(sorted(found))


def test_graph_reader_sees_lazy_imports_and_skips_type_checking(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("from typing import TYPE_CHECKING\nimport vitlab\nif TYPE_CHECKING:\n    import vitlab.cli\n"
                   "def f(m):\n    from vitlab.bench import timing\n    return vitlab.optimize.optimize(m)\n")
    known = {"vitlab", "vitlab.bench", "vitlab.bench.timing", "vitlab.cli", "vitlab.optimize"}
    assert _imports("vitlab.x.m", src, known) == {"vitlab", "vitlab.bench.timing", "vitlab.optimize"}
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
