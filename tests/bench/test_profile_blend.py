"""scripts/profile_blend.py: one blend and one full prefill of the same prompt, profiled."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "profile_blend.py"


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])  # query chunks; blocks of products
def test_the_profile_reports_times_pairs_and_both_op_tables(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], dtype: str
) -> None:
    # no warm-up: the test reads what the profile reports, not its times (bfloat16 is emulated on
    # a CPU without bfloat16 units, each prefill seconds)
    argv = [str(SCRIPT), "--documents", "4", "--doc-tokens", "200", "--rows", "3", "--repeats", "1",
            "--warmups", "0", "--dtype", dtype]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    runpy.run_path(str(SCRIPT), run_name="__main__")
    out = capsys.readouterr().out
    head, pairs = out.splitlines()[:2]
    assert f"prompt tokens, {dtype}, 1 thread(s): full" in head and "compute" in head
    computed, needed = (float(part.split()[0]) for part in pairs.split(": ")[1].split(", ")[:2])
    assert 0 < needed <= computed <= 1  # at least what the rows need
    assert "\nblend:\n" in out and "\nfull:\n" in out and out.count("aten::mm") == 2
