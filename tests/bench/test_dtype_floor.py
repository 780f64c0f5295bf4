"""scripts/dtype_floor.py: full prefill in bfloat16 against float32 on the same NQ prompts."""

from __future__ import annotations

import gzip
import json
import runpy
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "dtype_floor.py"
PASSAGES = [
    ("Mount Everest", "Mount Everest is Earth's highest mountain above sea level.",
     "what is the highest mountain on earth", ["Mount Everest"]),
    ("Pacific Ocean", "The Pacific Ocean is the largest and deepest of Earth's oceans.",
     "which is the largest ocean", ["Pacific"]),
    ("Penicillin", "Penicillin was discovered in 1928 by Alexander Fleming.",
     "who discovered penicillin", ["Alexander Fleming"]),
    ("Tour de France", "The Tour de France is an annual bicycle race held in France.",
     "what is the famous bicycle race in france", ["Tour de France"]),
    ("Great Wall", "The Great Wall of China was built along China's northern borders.",
     "what wall was built along china's northern border", ["Great Wall"]),
    ("Nile", "The Nile is a major north-flowing river in northeastern Africa.",
     "which river flows north through egypt", ["Nile"]),
]  # fmt: skip


@pytest.mark.slow
def test_both_dtypes_read_the_same_tokens_and_stay_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "nq.jsonl.gz"
    with gzip.open(data, "wt", encoding="utf-8") as out:
        for title, text, question, answers in PASSAGES:
            out.write(json.dumps({"question": question, "answers": answers, "title": title,
                                  "text": text}) + "\n")  # fmt: skip
    output = tmp_path / "floor.json"
    argv = [str(SCRIPT), "--data", str(data), "--questions", "2", "--shape", "nq-5",
            "--cache-dir", str(tmp_path), "--output", str(output)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    runpy.run_path(str(SCRIPT), run_name="__main__")
    result = json.loads(output.read_text(encoding="utf-8"))
    summary = result["summary"]
    assert summary["questions"] == 2 and len(result["rows"]) == 2
    # bfloat16 rounds every product: not zero, and far below a blend's KL on these models
    assert all(0 < row["kl"] < 0.05 for row in result["rows"]), result["rows"]
    assert summary["mean_kl_ci"][0] <= summary["mean_kl"] <= summary["mean_kl_ci"][1]
    assert 0 <= summary["top1_agreement"] <= 1
    assert '"questions": 2' in capsys.readouterr().out
