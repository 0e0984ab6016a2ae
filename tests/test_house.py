"""The house rules that keep hisparse easy to walk: no import circles, short modules.

Every import counts, also those inside functions and under ``TYPE_CHECKING``: a
circle that only a lazy import hides is still a circle for the reader.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "hisparse"
MAX_LINES = 400

# The daemon's layers, lowest first: a subpackage imports only from the layers below it
# (and from itself), except for names it needs for type hints alone.
DAEMON_LAYERS = ["conf", "policy", "store", "cluster", "ops", "front"]


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _imports(name: str) -> list[tuple[str, bool]]:
    """(module imported, only for type hints) for every import statement in ``name``."""
    tree = ast.parse(MODULES[name].read_text())
    typing_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                for sub in ast.walk(inner):
                    typing_only.add(id(sub))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name if _is_package(name) else name.rsplit(".", 1)[0]
                for _ in range(node.level - 1):
                    pkg = pkg.rsplit(".", 1)[0]
                base = f"{pkg}.{base}" if base else pkg
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for target in targets:
            if target in MODULES and target != name:
                out.append((target, id(node) in typing_only))
    return out


GRAPH = {name: _imports(name) for name in MODULES}


def _circles() -> list[list[str]]:
    """Every strongly connected set of modules larger than one (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w, _ in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for name in sorted(GRAPH):
        if name not in index:
            visit(name)
    return found


def test_no_import_circles_anywhere():
    assert _circles() == []


def test_a_circle_is_found_when_there_is_one(monkeypatch):
    # The check itself must be able to fail.
    monkeypatch.setitem(GRAPH, "hisparse.errors", GRAPH["hisparse.errors"] + [("hisparse.layout", False)])
    monkeypatch.setitem(GRAPH, "hisparse.layout", GRAPH["hisparse.layout"] + [("hisparse.errors", False)])
    assert ["hisparse.errors", "hisparse.layout"] in _circles()


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_is_over_400_lines(name):
    assert len(MODULES[name].read_text().splitlines()) <= MAX_LINES


def _layer(name: str) -> int | None:
    parts = name.split(".")
    if len(parts) > 3 and parts[:2] == ["hisparse", "daemon"] and parts[2] in DAEMON_LAYERS:
        return DAEMON_LAYERS.index(parts[2])
    return None


def test_daemon_subpackages_import_only_downwards():
    upward = []
    for name, edges in GRAPH.items():
        mine = _layer(name)
        if mine is None:
            continue
        for target, typing_only in edges:
            theirs = _layer(target)
            if theirs is not None and theirs > mine and not typing_only:
                upward.append(f"{name} -> {target}")
            if target == "hisparse.daemon.main":
                upward.append(f"{name} -> {target}")
    assert upward == []


def test_every_daemon_subpackage_says_what_lives_there():
    for layer in DAEMON_LAYERS:
        doc = ast.get_docstring(ast.parse(MODULES[f"hisparse.daemon.{layer}"].read_text())) or ""
        assert "May import" in doc, layer
