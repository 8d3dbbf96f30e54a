"""The package's import layers: data flows one way, datasets -> kernels -> landmarks -> precond -> solvers -> gp ->
reduced / bo / distributed / baselines -> cli, with shared utilities on the ground floor. Every ``gpnys`` import a
module makes at run time (at the top or inside a function; ``if TYPE_CHECKING:`` blocks excepted) must point to its
own layer or a lower one, and no modules may import each other in a circle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "gpnys"

#: lowest first; a module belongs to the longest prefix that names it
LAYERS: list[tuple[str, ...]] = [
    ("gpnys.checks", "gpnys.cache", "gpnys.keys", "gpnys.linalg", "gpnys.budget", "gpnys.collectives", "gpnys.launch"),
    ("gpnys.datasets",),
    ("gpnys.kernels",),
    ("gpnys.landmarks",),
    ("gpnys.precond",),
    ("gpnys.solvers",),
    ("gpnys.gp",),
    ("gpnys.reduced", "gpnys.bo", "gpnys.distributed", "gpnys.baselines", "gpnys.classify"),
    ("gpnys.cli",),
    ("gpnys",),
]


def _layer(module: str) -> int:
    best: tuple[int, int] | None = None
    for i, group in enumerate(LAYERS):
        for prefix in group:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > best[1]):
                best = (i, len(prefix))
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best[0]


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The gpnys modules ``path`` imports at run time (``from a.b import c`` counts ``a.b.c`` when that is a module)."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING"
                   for n in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("gpnys"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("gpnys"))
    return {m for m in found if m in modules}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(p, modules) - {m} for m, p in modules.items()}


def _upward(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} ({_layer(m)}) imports {d} ({_layer(d)})" for m, deps in graph.items() for d in deps
                  if _layer(d) > _layer(m))


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    return circles


def test_no_module_imports_from_a_higher_layer(graph):
    upward = _upward(graph)
    assert not upward, "\n".join(upward)


def test_no_import_circles(graph):
    circles = _circles(graph)
    assert not circles, circles


def test_the_checks_see_a_violation(graph):
    """Not vacuous: a planted upward import and a planted circle are caught, and the real graph has edges."""
    assert sum(len(d) for d in graph.values()) > 100
    planted = {**graph, "gpnys.kernels.operator": graph["gpnys.kernels.operator"] | {"gpnys.gp.hook"}}
    assert _upward(planted) == ["gpnys.kernels.operator (2) imports gpnys.gp.hook (6)"]
    assert any({"gpnys.gp.hook", "gpnys.kernels.operator"} <= set(c) for c in _circles(planted))
