"""scripts/nq_agreement.py: two NQ runs' answers to the same questions, compared."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "nq_agreement.py"


def _run(path: Path, dtype: str, answers: dict[str, list[str]]) -> None:
    rows = [{"qid": f"q{i}", "k": 10, "strategy": name, "answer": text, "correct": "Paris" in text}
            for name, texts in answers.items() for i, text in enumerate(texts)]  # fmt: skip
    path.write_text(json.dumps({"dtype": dtype, "rows": rows}), encoding="utf-8")


def test_agreement_is_counted_on_normalised_answers_and_split_by_the_other_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    reference = ["Paris, France.", "The capital is Rome", "It is Oslo", "Bern in the Alps"]
    _run(tmp_path / "a.json", "float32", {
        "full": reference,
        "default": ["paris france", "The capital is Milan", "It is Oslo city", "Bern in the Alps"],
    })  # fmt: skip
    # the other run: the same as the reference on q0 and q3 (q0 up to case and punctuation)
    _run(tmp_path / "b.json", "bfloat16", {
        "full": ["PARIS France", "The capital is Rome, Italy", "It was Oslo", "Bern in the Alps"]
    })  # fmt: skip
    out_file = tmp_path / "figures.json"
    argv = [str(SCRIPT), "--reference", f"{tmp_path / 'a.json'}:full", "--other",
            f"{tmp_path / 'b.json'}:full", "--blend", f"{tmp_path / 'a.json'}:default",
            "--output", str(out_file)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    runpy.run_path(str(SCRIPT), run_name="__main__")
    out = capsys.readouterr().out
    assert "questions in both: 4" in out
    assert "other agrees with reference, whole answers: 50.0%" in out
    assert "first 1 words: 100.0%" in out  # every answer starts alike, "the" dropped
    figures = json.loads(out_file.read_text(encoding="utf-8"))
    assert figures["agreement_3"][0] == 0.75  # "it is oslo" / "it was oslo" part at word 2
    assert figures["agreement_5"][0] == 0.5  # "capital is rome" / "... rome italy" at word 4
    assert figures["blend_agreement_every_question"][0] == 0.5  # q0 and q3
    assert figures["blend_agreement_other_agrees"][0] == 1.0  # q0, q3
    assert figures["blend_agreement_other_differs"][0] == 0.0  # q1, q2
    assert figures["accuracy_reference"][0] == 0.25


def test_a_strategy_with_no_answers_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _run(tmp_path / "a.json", "float32", {"full": ["Paris"]})
    argv = [str(SCRIPT), "--reference", f"{tmp_path / 'a.json'}:full", "--other",
            f"{tmp_path / 'a.json'}:default"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit, match="no answered rows of strategy 'default'"):
        runpy.run_path(str(SCRIPT), run_name="__main__")
