"""Every Python example in the README and docs/ runs as a complete program and answers right.

Each ```python block is written to a file and run in a fresh interpreter with its own store
folder, on the bundled model. A line ``# expected output: X`` in a block means ``X`` must appear
in what the program prints (case-insensitive): the examples show right answers, not just code
that runs. An example prints no deprecation warning (its imports are current), and a blend in
it that runs as full prefill (the log's "blend ran as full prefill") is one the block says
falls back, in a ``# falls back`` comment. Excerpts that are not programs (signatures, loop
sketches) use a plain fence.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest_langchain import requires_model

ROOT = Path(__file__).resolve().parents[2]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
_EXPECTED = re.compile(r"#\s*expected output:\s*(.+?)\s*$", re.MULTILINE)
_FALLS_BACK = re.compile(r"#.*\bfalls back\b")


def examples() -> list[tuple[str, str]]:
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        if path.name == "api.md":  # generated from docstrings
            continue
        for number, block in enumerate(_BLOCK.findall(path.read_text("utf-8")), 1):
            found.append((f"{path.relative_to(ROOT)}#{number}", block))
    return found


EXAMPLES = examples()


def test_the_docs_have_examples_with_expected_answers() -> None:
    assert len(EXAMPLES) >= 8
    answered = [name for name, code in EXAMPLES if _EXPECTED.search(code)]
    assert any(name.startswith("README.md") for name in answered)


@pytest.mark.slow
@requires_model
@pytest.mark.parametrize(("name", "code"), EXAMPLES, ids=[name for name, _ in EXAMPLES])
def test_example_runs_and_prints_the_expected_answer(name: str, code: str, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(code)
    env = {
        **os.environ,
        "KVBLEND_STORE_DIR": str(tmp_path / "store"),
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
    }
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"{name} failed:\n{done.stderr[-3000:]}"
    for expected in _EXPECTED.findall(code):
        assert expected.lower() in done.stdout.lower(), (
            f"{name}: expected {expected!r} in its output:\n{done.stdout[-2000:]}"
        )
    assert "deprecat" not in done.stderr.lower(), f"{name} warns:\n{done.stderr[-3000:]}"
    if "blend ran as full prefill" in done.stderr:
        assert _FALLS_BACK.search(code), (
            f"{name}: a blend ran as full prefill and the example does not say it falls back:"
            f"\n{done.stderr[-2000:]}"
        )
