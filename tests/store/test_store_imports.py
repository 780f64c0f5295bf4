"""The store package's import graph is a DAG, and each of its modules imports on its own.

The graph is read from the source (every ``import`` of a ``kvblend.store`` module, at the top
of a file or inside a function), so a circle closed by a lazy import counts too. Modules are
named relative to ``kvblend.store`` (``base``, ``disk.store``); importing a module of a
sub-package runs that sub-package's ``__init__`` first, so it counts as an import of the
sub-package too, unless the importer lies inside it (its ``__init__`` is then already running).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import kvblend.store

PACKAGE = Path(kvblend.store.__file__).parent
FILES = {
    ".".join(path.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__"): path
    for path in PACKAGE.rglob("*.py")
    if path != PACKAGE / "__init__.py"
}
MODULES = sorted(FILES)


def store_imports(module: str) -> set[str]:
    """Names of the store modules that ``kvblend.store.<module>`` imports, anywhere in it."""
    path = FILES[module]
    package = "kvblend.store." + module if path.name == "__init__.py" else "kvblend.store"
    if path.name != "__init__.py" and "." in module:
        package += "." + module.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text("utf-8"))
    found: set[str] = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1]) if node.level else ""
            base = ".".join(p for p in (base, node.module or "") if p)
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        for name in names:
            parts = name.split(".")
            if parts[:2] != ["kvblend", "store"]:
                continue
            # the longest store module the name starts with, and the sub-packages above it
            tails = [".".join(parts[2:end]) for end in range(3, len(parts) + 1)]
            known = [tail for tail in tails if tail in FILES]
            if known:
                target = known[-1]
                found.add(target)
                found.update(tail for tail in known[:-1] if not module.startswith(tail + "."))
    return found - {module}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A list of modules that import each other in a circle, or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (cycle := visit(target)) is not None:
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_the_cycle_finder_finds_a_circle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_store_package_has_no_import_circle() -> None:
    graph = {module: store_imports(module) for module in MODULES}
    assert graph["defaults"] >= {"tiered", "remote_tier", "disk", "redis"}  # it sees real imports
    assert graph["redis.store"] >= {"redis.access", "base"}  # and inside the sub-packages
    assert "redis" not in graph["redis.store"]  # the importer's own package is running already
    assert find_cycle(graph) is None, f"import circle: {' -> '.join(find_cycle(graph) or [])}"


@pytest.mark.slow  # a process per module
def test_each_store_module_imports_on_its_own() -> None:
    code = (
        "import importlib, sys\n"
        f"for name in {MODULES!r}:\n"
        "    for loaded in [m for m in sys.modules if m.startswith('kvblend.store')]:\n"
        "        del sys.modules[loaded]\n"
        "    importlib.import_module('kvblend.store.' + name)\n"
        "print('ok')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]
