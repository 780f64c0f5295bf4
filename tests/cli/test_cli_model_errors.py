"""A model that cannot load fails in one line naming the real cause; the load line names the model.

transformers, given a folder without a tokenizer, says "You need to have sentencepiece or
tiktoken installed" (they are installed) and, given a text file, that a config file is not
valid JSON: the command line says what the path lacks instead. With ``KVBLEND_MODEL`` set the
first line names that model, not the bundled default.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvblend.cli.main import main


def _error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[str, str]:
    code = main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and "Traceback" not in err, err
    return lines[0], lines[-1]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda path: path.mkdir(), "is not a model folder: it has no config.json"),
        (lambda path: (path.mkdir(), (path / "notes.txt").write_text("hi")),
         "is not a model folder: it has no config.json"),
        (lambda path: (path.mkdir(), (path / "config.json").write_text(json.dumps({}))),
         "has no tokenizer: none of tokenizer.json, tokenizer.model"),
        (lambda path: path.write_text("not a model"), "is a file, not a model"),
    ],
    ids=["empty folder", "folder of notes", "config without tokenizer", "text file"],
)  # fmt: skip
def test_a_path_that_is_no_model_names_what_it_lacks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], make, message: str
) -> None:
    path = tmp_path / "model"
    make(path)
    _, last = _error(capsys, ["explain", "hello", "--model", str(path), "--memory-only"])
    assert last.startswith(f"kvblend: error: {path} ") and message in last, last
    assert "sentencepiece" not in last and "JSON" not in last


def test_the_load_line_names_the_model_of_kvblend_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "my-model"
    folder.mkdir()
    monkeypatch.setenv("KVBLEND_MODEL", str(folder))
    first, last = _error(capsys, ["explain", "hello", "--memory-only"])
    assert first == f"loading model {folder} ($KVBLEND_MODEL) ...", first  # not "(bundled default)"
    assert "is not a model folder" in last
    # --model wins over the variable, and the line says so
    other = tmp_path / "other"
    other.mkdir()
    first, _ = _error(capsys, ["explain", "hello", "--memory-only", "--model", str(other)])
    assert first == f"loading model {other} ..."
