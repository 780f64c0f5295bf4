"""The code stays readable: no function of the core packages longer than 60 lines, no folder
of the package with more than 15 modules.

A function is counted as the source lines from its ``def`` to its last line (docstring and
comments included), for every function and method of the packages that make up the engine
(`CORE`), nested ones too. Which module may import which is held by import-linter's contracts
(pyproject.toml), run by CI.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvblend

PACKAGE = Path(kvblend.__file__).parent
#: The packages under the 60-line rule: the engine and what it is made of.
CORE = ("engine", "blend", "prompt", "documents", "models", "decoding")
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


def test_no_core_function_is_longer_than_60_lines() -> None:
    for name in CORE:
        folder = PACKAGE / name
        assert list(folder.rglob("*.py")), folder  # the sources are where the test looks
        assert _long_functions(folder) == [], name


def test_the_count_sees_a_long_function(tmp_path: Path) -> None:
    body = "\n".join(f"    x{n} = {n}" for n in range(MAX_LINES))
    (tmp_path / "long.py").write_text(f"def too_long():\n{body}\n\n\ndef short():\n    pass\n")
    assert _long_functions(tmp_path) == [f"long.py:1 too_long: {MAX_LINES + 1}"]


#: The most modules (``.py`` files, ``__init__.py`` included) one folder of the package holds:
#: past that, a folder is cut into subpackages by what its modules do.
MAX_MODULES = 15


def _crowded_folders(root: Path) -> list[str]:
    counts = {
        folder: len(list(folder.glob("*.py")))
        for folder in [root, *root.rglob("*")]
        if folder.is_dir() and folder.name != "__pycache__"
    }
    return sorted(
        f"{folder.relative_to(root).as_posix() or '.'}: {n}"
        for folder, n in counts.items()
        if n > MAX_MODULES
    )


def test_no_folder_holds_more_than_15_modules() -> None:
    assert len(list(PACKAGE.rglob("*.py"))) > 100  # the sources are where the test looks
    assert _crowded_folders(PACKAGE) == []


def test_the_count_sees_a_crowded_folder(tmp_path: Path) -> None:
    (tmp_path / "crowded" / "sub").mkdir(parents=True)
    for n in range(MAX_MODULES + 1):
        (tmp_path / "crowded" / f"m{n}.py").write_text("")
    for n in range(MAX_MODULES):
        (tmp_path / "crowded" / "sub" / f"m{n}.py").write_text("")
    assert _crowded_folders(tmp_path) == [f"crowded: {MAX_MODULES + 1}"]
