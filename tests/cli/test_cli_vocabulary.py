"""One vocabulary for what a prompt reuses (docs/glossary.md), in ``ask`` and ``explain``.

Every prompt token is reused, recomputed or computed, and the counts add up to the prompt.
A prompt that runs as full prefill still reuses its cached prefix (the prompt head): ``ask``
says the reused tokens are the prefix's (it said "33 reused ... ran as full prefill"), and
``explain`` (tests/cli/test_cli.py, tests/documents/test_registry.py) says a document
recomputed whole is recomputed, not "reused at its new position" beside "0 reused".
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import byte_tokenizer, tiny_model
from kvblend import BlendEngine
from kvblend.cli.main import main

SHORT = ["Marta Quill keeps bees in Lisbon.", "Tomas Elm makes violins in Cremona."]
COUNTS = re.compile(
    r"(\d+) prompt tokens: (\d+) reused( \(the cached prefix\))?, (\d+) recomputed, (\d+) computed"
)


@pytest.fixture
def engines(monkeypatch: pytest.MonkeyPatch) -> list[BlendEngine]:
    made: list[BlendEngine] = []

    def from_pretrained(cls, model=None, *, store, **kwargs):  # noqa: ANN001, ANN202
        made.append(BlendEngine(tiny_model("llama"), byte_tokenizer(), store=store))
        return made[-1]

    monkeypatch.setattr(BlendEngine, "from_pretrained", classmethod(from_pretrained))
    return made


def _docs(tmp_path: Path, texts: list[str]) -> Path:
    folder = tmp_path / "docs"
    folder.mkdir()
    for index, text in enumerate(texts):
        (folder / f"doc{index}.txt").write_text(text)
    return folder


def test_ask_says_a_full_prefill_reuses_only_the_cached_prefix(
    engines: list[BlendEngine], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    docs = _docs(tmp_path, SHORT)  # two short documents: a blend would not pay
    argv = ["ask", "Where does Marta live?", "--docs", str(docs), "--memory-only",
            "--max-new-tokens", "2"]  # fmt: skip
    assert main(argv) == 0
    line = capsys.readouterr().err.strip().splitlines()[-1]
    found = COUNTS.search(line)
    assert found is not None, line
    total, reused, head, recomputed, computed = found.groups()
    assert int(total) == int(reused) + int(recomputed) + int(computed)
    assert head and int(reused) > 0 and "; ran as full prefill after the cached prefix: " in line


def test_ask_says_a_blend_without_a_fallback_clause(
    engines: list[BlendEngine], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    long = [" ".join(f"{name}{i}" for i in range(30)) for name in ("alpha", "beta", "gamma")]
    docs = _docs(tmp_path, long)
    argv = ["ask", "What follows alpha7?", "--docs", str(docs), "--memory-only",
            "--max-new-tokens", "2", "--set", "min_recompute=0"]  # fmt: skip
    assert main(argv) == 0
    line = capsys.readouterr().err.strip().splitlines()[-1]
    found = COUNTS.search(line)
    assert found is not None and found.group(3) is None, line
    total, reused, _, recomputed, computed = found.groups()
    assert int(total) == int(reused) + int(recomputed) + int(computed)
    assert int(recomputed) > 0 and "full prefill" not in line
