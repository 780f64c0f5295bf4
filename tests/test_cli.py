"""The ``kvblend`` command line on the bundled model: demo, ask, precompute, store, errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvblend.cli import main


@pytest.mark.slow
def test_demo_answers_with_full_and_blended_prefill(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--memory-only", "--questions", "1", "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "Q: In which city does Marta Quill live?" in out
    assert "full prefill  TTFT" in out and "blended       TTFT" in out
    assert "Expected answer found: full prefill" in out and "reused from cache" in out


@pytest.mark.slow
def test_precompute_ask_and_store_stats(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "marta.txt").write_text("Marta Quill is a beekeeper who lives in Lisbon.\n")
    (docs / "tomas.md").write_text("Tomas Elm is a violin maker who lives in Cremona.\n")
    store = str(tmp_path / "store")
    system = ["--system", "Answer from the documents."]
    assert main(["precompute", str(docs), "--store-dir", store, *system]) == 0
    assert "precomputed 2 documents" in capsys.readouterr().out
    assert main(["store", "stats", "--store-dir", store]) == 0
    assert "entries: 2" in capsys.readouterr().out
    code = main(
        ["ask", "Where does Marta Quill live?", "--docs", str(docs), "--store-dir", store,
         "--max-new-tokens", "12", *system]
    )  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0 and captured.out.strip()
    assert "reused" in captured.err
    assert main(["store", "clear", "--store-dir", store]) == 0
    # two documents + the prompt head: ask found the documents precompute stored (same system
    # prompt, so the same document context and segment ids)
    assert "cleared 3 entries" in capsys.readouterr().out
    assert main(["store", "stats", "--store-dir", store]) == 0
    assert "entries: 0" in capsys.readouterr().out


def test_missing_documents_are_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["ask", "question?", "--docs", str(tmp_path / "nowhere"), "--memory-only"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("kvblend: error: no such file or folder") and "Traceback" not in err


def test_bad_ratio_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["demo", "--memory-only", "--ratio", "1.5"])
    captured = capsys.readouterr()
    assert code == 2 and "recompute_ratio must be a number in [0, 1]" in captured.err
    assert "loaded" not in captured.out + captured.err  # refused before loading the model


def test_bad_correction_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["demo", "--memory-only", "--correction", "-0.1"])
    captured = capsys.readouterr()
    assert code == 2 and "correction must be a number in [0, 1]" in captured.err
    assert "Traceback" not in captured.err
