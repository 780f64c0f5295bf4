"""The code stays readable: no engine function longer than 60 lines, no module over 400.

A function is counted as the source lines from its ``def`` to its last line (docstring and
comments included), for every function and method under ``src/kvblend/engine``, nested ones too.
A module is counted as the lines of its file, for every module under ``src/kvblend``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvblend
import kvblend.engine

PACKAGE = Path(kvblend.__file__).parent
ENGINE = Path(kvblend.engine.__file__).parent
MAX_LINES = 60
MAX_MODULE_LINES = 400


def _long_functions(folder: Path) -> list[str]:
    found = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_LINES:
                    found.append(f"{path.relative_to(folder)}:{node.lineno} {node.name}: {lines}")
    return found


def test_no_engine_function_is_longer_than_60_lines() -> None:
    assert list(ENGINE.rglob("*.py")), ENGINE  # the engine's sources are where the test looks
    assert _long_functions(ENGINE) == []


def test_the_count_sees_a_long_function(tmp_path: Path) -> None:
    body = "\n".join(f"    x{n} = {n}" for n in range(MAX_LINES))
    (tmp_path / "long.py").write_text(f"def too_long():\n{body}\n\n\ndef short():\n    pass\n")
    assert _long_functions(tmp_path) == [f"long.py:1 too_long: {MAX_LINES + 1}"]


def _long_modules(folder: Path) -> list[str]:
    """Modules over `MAX_MODULE_LINES` lines, longest first, as ``path: lines``."""
    sizes = [
        (len(path.read_text(encoding="utf-8").splitlines()), path.relative_to(folder).as_posix())
        for path in folder.rglob("*.py")
    ]
    return [f"{name}: {lines}" for lines, name in sorted(sizes, reverse=True)
            if lines > MAX_MODULE_LINES]  # fmt: skip


def test_no_module_is_longer_than_400_lines() -> None:
    assert list(PACKAGE.rglob("*.py")), PACKAGE  # the package's sources are where the test looks
    too_long = _long_modules(PACKAGE)
    assert not too_long, (
        f"modules over {MAX_MODULE_LINES} lines (split each along a seam, one job per module), "
        f"longest first: {', '.join(too_long)}"
    )


def test_the_count_sees_a_long_module(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "short.py").write_text("x = 1\n" * MAX_MODULE_LINES)
    (tmp_path / "sub" / "long.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    (tmp_path / "longer.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 7))
    assert _long_modules(tmp_path) == [
        f"longer.py: {MAX_MODULE_LINES + 7}",
        f"sub/long.py: {MAX_MODULE_LINES + 1}",
    ]
