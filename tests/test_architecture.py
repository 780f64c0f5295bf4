"""The engine's code stays readable: no function longer than 60 lines.

Counted as the source lines from a function's ``def`` to its last line (docstring and comments
included), for every function and method under ``src/kvblend/engine``, nested ones too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvblend.engine

ENGINE = Path(kvblend.engine.__file__).parent
MAX_LINES = 60


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
