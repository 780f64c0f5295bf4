"""`kvblend bench guard`: each signal's AUC, limits and the limit a budget buys, on rows whose
answers are built here (so every figure has a known value)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvblend.bench.quality.guard_calibration import (
    DECODE_SIGNALS,
    SIGNALS,
    at_limit,
    choose_limit,
    escalates,
    main,
    separation,
    signal_value,
    sweep,
)
from kvblend.blend.guard import GUARD_SIGNALS


def _row(
    qid: int,
    agrees: bool,
    top1: bool = True,
    *,
    margins: list[float] | None = None,
    **signals: float,
) -> dict:
    """A blend's row: 0.3 of full's compute, a 10-token head in 110 tokens, full answers right."""
    return {
        "qid": qid,
        "k": 10,
        "head": "untold",
        "agrees": agrees,
        "top1_agrees": top1,
        "correct": agrees,
        "full_correct": True,
        "compute_fraction": 0.3,
        "prefix_tokens": 10,
        "prompt_tokens": 110,
        "margins": margins,
        "guard": {"signals": signals} if signals else None,
    }


def test_every_signal_has_a_direction_and_the_decode_steps_take_the_least_margin() -> None:
    assert SIGNALS == GUARD_SIGNALS + DECODE_SIGNALS and len(DECODE_SIGNALS) == 8
    row = _row(0, True, margins=[0.9, 0.7, 0.2, 0.8], margin=0.9, shift=0.3)
    assert [signal_value(row, f"decode_margin_{k}") for k in (1, 2, 3, 4, 8)] == [
        0.9,
        0.7,
        0.2,
        0.2,
        0.2,
    ]
    assert escalates(row, "decode_margin_3", 0.25) and not escalates(row, "decode_margin_2", 0.25)
    assert escalates(row, "shift", 0.2) and not escalates(row, "shift", 0.3)
    assert escalates(row, "margin", 0.95) and not escalates(row, "margin", 0.9)
    bare = _row(1, True)  # no guard, nothing decoded: never escalated, left out of the AUC
    assert math.isnan(signal_value(bare, "margin")) and math.isnan(
        signal_value(bare, "decode_margin_1")
    )
    assert not escalates(bare, "margin", 1.0) and not escalates(bare, "decode_margin_1", 1.0)


def test_auc_is_one_when_a_signal_separates_and_a_half_when_it_is_independent() -> None:
    # differing answers: high shift, low margin, a low margin at the third decode step only;
    # stale_mass takes each value once among the differing and once among the agreeing
    rows = []
    for qid in range(8):
        differs = qid % 2 == 0
        rows.append(
            _row(
                qid,
                not differs,
                top1=not differs,
                margins=[0.5, 0.6, 0.05 if differs else 0.9, 0.95],
                shift=0.8 + qid / 100 if differs else 0.1 + qid / 100,
                margin=0.1 if differs else 0.7,
                stale_mass=float(qid // 2),
            )
        )
    for signal in ("shift", "margin", "decode_margin_3", "decode_margin_8"):
        for target in ("agrees", "top1_agrees"):
            found = separation(rows, signal, target=target, resamples=200)
            assert found["auc"] == 1.0 and found["n"] == 8 and found["differ"] == 4
            assert found["auc_ci"] == [1.0, 1.0]
    for signal in ("stale_mass", "decode_margin_1", "decode_margin_2"):
        assert separation(rows, signal, resamples=0)["auc"] == 0.5
    # a signal ranking the agreeing answers first: 0
    assert separation(rows, "kl", resamples=0)["n"] == 0  # not recorded: nothing counted
    flipped = [{**r, "guard": {"signals": {"kl": 1.0 if r["agrees"] else 0.0}}} for r in rows]
    assert separation(flipped, "kl", resamples=0)["auc"] == 0.0


def test_the_limit_chosen_buys_the_most_agreement_within_the_budget() -> None:
    # 10 questions, the two differing ones have the two lowest margins
    margins = [0.01, 0.02, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95]
    rows = [
        _row(q, q >= 2, top1=q != 0, margins=[1.0, m], margin=m, shift=0.5)
        for q, m in enumerate(margins)
    ]
    table = sweep(rows, "margin", quantiles=[1.0, 0.9, 0.8, 0.7])
    assert [row["escalated"] for row in table] == [0.0, 0.1, 0.2, 0.3]
    assert [row["limit"] for row in table] == sorted(row["limit"] for row in table)
    escalation = 100 / 110  # every row but the 10-token head
    best = choose_limit(table, budget=0.3 + 0.25 * escalation)  # 20% fits, 30% does not
    assert best is not None and best["escalated"] == 0.2 and best["limit"] > 0.02
    assert best["precision"] == 1.0 and best["recall"] == 1.0 and best["agreement"] == 1.0
    assert best["first_token_precision"] == 0.5 and best["share_of_full"] == 1.0
    assert best["compute"] == pytest.approx(0.3 + 0.2 * escalation)
    assert table[-1]["compute"] > 0.3 + 0.25 * escalation  # 30%: past the budget
    assert choose_limit(table, budget=0.29) is None  # not even the blend alone fits
    # the same on the second decode step's margin: each escalation also re-decodes 2 tokens
    decoded = choose_limit(sweep(rows, "decode_margin_2", quantiles=[1.0, 0.8]), budget=0.6)
    assert decoded is not None and decoded["agreement"] == 1.0
    assert decoded["compute"] == pytest.approx(0.3 + 0.2 * (100 + 2) / 110)
    # of equal agreement, the limit that escalates least: a useless shift escalates nothing
    flat = choose_limit(sweep(rows, "shift"), budget=2.0)
    assert flat is not None and flat["escalated"] == 0.0 and flat["agreement"] == 0.8
    # limits that escalate the same questions are one row: 11 quantiles up to the median of
    # 0.01, 0.02, 0.3 escalate none or the first
    assert [row["escalated"] for row in sweep(rows[:3], "margin")] == [0.0, 1 / 3]


def test_at_limit_counts_a_margin_below_the_limit_as_risk() -> None:
    rows = [
        _row(0, False, margin=0.1),
        _row(1, True, margin=0.5),
        _row(2, False, margin=0.6),
        _row(3, True, margin=0.9),
    ]
    half = at_limit(rows, "margin", 0.55)
    assert half["escalated"] == 0.5 and half["precision"] == 0.5 and half["recall"] == 0.5
    assert at_limit(rows, "margin", 0.5)["escalated"] == 0.25  # at the limit: kept


def test_the_command_prints_the_chosen_limit_with_its_rate_cost_and_precision(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    margins = [0.01, 0.02, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95]
    rows = []
    for q, m in enumerate(margins):
        rows.append({**_row(q, True), "strategy": "full", "correct": True, "margins": [0.9]})
        rows.append({**_row(q, q >= 2, margins=[m, m], margin=m, shift=0.5), "strategy": "g"})
    result = tmp_path / "nq.json"
    result.write_text(json.dumps({"rows": rows, "model": "m", "split": "calibration"}))
    output = tmp_path / "guard.json"
    assert (
        main(
            [
                str(result),
                "--strategy",
                "g",
                "--budget",
                "0.5",
                "--resamples",
                "50",
                "--output",
                str(output),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "margin within compute 0.5: limit" in text and "guard_signal=margin" in text
    assert "escalates 20%, precision 100%" in text and "mean compute 0.482 with escalations" in text
    assert "decode_margin_2 within compute 0.5" in text and "no setting yet" in text
    record = json.loads(output.read_text())
    chosen = {row["signal"]: row for row in record["chosen"]}
    assert chosen["margin"]["agreement"] == 1.0 and chosen["decode_margin_1"]["agreement"] == 1.0
    assert {row["signal"] for row in record["separation"]} == {"shift", "margin", *DECODE_SIGNALS}
    with pytest.raises(SystemExit):
        main([str(result), "--strategy", "g", "--signals", "entropy"])
