"""Which guard signal predicts a blended answer that differs from full prefill's, and at what limit.

Input: the rows of a `kvblend bench nq` run (`kvblend.bench.nq_eval`) of a strategy run with
``guard=inf`` (every signal measured, nothing escalated) on calibration questions. For every
signal of `kvblend.blend.guard.GUARD_SIGNALS` and limit, the guard would escalate the questions
whose signal is above the limit; escalated questions get full prefill's answer (the escalation
computes the prompt in full, the head read in place), the others keep the blend's. Per limit:

- ``escalated``: the share of questions escalated;
- ``precision``: of the escalated questions, the share whose blended answer differed from full's;
- ``recall``: of the questions whose blended answer differed, the share escalated;
- ``kept_agreement``: agreement with full among the questions not escalated;
- ``agreement``: agreement with full of the guarded answers (escalated ones agree);
- ``compute``: mean compute with the escalations (an escalation adds every row but the head);
- ``share_of_full``: accuracy of the guarded answers over full's.

``choose_limit`` picks the lowest limit (most escalations) whose mean compute stays within a
budget: the most agreement the budget buys with that signal.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvblend.blend.guard import GUARD_SIGNALS

#: Signals where a low value means risk: their risk is ``1 - value``.
LOW_IS_RISK = frozenset({"margin"})


def risk(row: dict[str, Any], signal: str) -> float:
    """Return the row's risk by ``signal`` (higher: more at risk); NaN without a guard."""
    guard = row.get("guard") or {}
    value = (guard.get("signals") or {}).get(signal)
    if value is None:
        return math.nan
    return 1.0 - value if signal in LOW_IS_RISK else float(value)


def paired_rows(rows: Sequence[dict[str, Any]], strategy: str) -> list[dict[str, Any]]:
    """Return the ``strategy`` rows with guard signals, each with its question's full row."""
    full = {(r["qid"], r.get("k"), r["head"]): r for r in rows if r["strategy"] == "full"}
    out = []
    for row in rows:
        key = (row["qid"], row.get("k"), row["head"])
        if row["strategy"] == strategy and row.get("guard") and key in full:
            out.append({**row, "full_correct": full[key]["correct"]})
    return out


def at_limit(rows: Sequence[dict[str, Any]], signal: str, limit: float) -> dict[str, Any]:
    """Return what a guard escalating above ``limit`` of ``signal`` would do on ``rows``."""
    escalate = [risk(r, signal) > limit for r in rows]
    differ = [not r["agrees"] for r in rows]
    kept = [r for r, e in zip(rows, escalate, strict=True) if not e]
    caught = sum(e and d for e, d in zip(escalate, differ, strict=True))
    cost = [r["compute_fraction"] + (1 - r.get("prefix_tokens", 0) / r["prompt_tokens"]) * e
            for r, e in zip(rows, escalate, strict=True)]  # fmt: skip
    correct = [r["full_correct"] if e else r["correct"]
               for r, e in zip(rows, escalate, strict=True)]  # fmt: skip
    full_accuracy = statistics.fmean(float(r["full_correct"]) for r in rows)
    return {
        "signal": signal,
        "limit": limit,
        "n": len(rows),
        "escalated": statistics.fmean(float(e) for e in escalate),
        "precision": caught / sum(escalate) if any(escalate) else math.nan,
        "recall": caught / sum(differ) if any(differ) else math.nan,
        "kept_agreement": statistics.fmean(float(r["agrees"]) for r in kept) if kept else math.nan,
        "agreement": statistics.fmean(
            float(e or r["agrees"]) for r, e in zip(rows, escalate, strict=True)
        ),  # fmt: skip
        "compute": statistics.fmean(cost),
        "share_of_full": statistics.fmean(float(c) for c in correct) / full_accuracy
        if full_accuracy
        else math.nan,
    }


def sweep(
    rows: Sequence[dict[str, Any]], signal: str, quantiles: Sequence[float] | None = None
) -> list[dict[str, Any]]:
    """`at_limit` at limits that escalate 0%, 5%, ... of ``rows`` (the signal's quantiles)."""
    values = np.asarray([risk(r, signal) for r in rows], dtype=float)
    values = values[np.isfinite(values)]
    if values.size == 0:
        return []
    points = list(quantiles) if quantiles is not None else np.linspace(1.0, 0.5, 11).tolist()
    limits = sorted({float(np.quantile(values, q)) for q in points}, reverse=True)
    return [at_limit(rows, signal, limit) for limit in limits]


def choose_limit(table: Sequence[dict[str, Any]], budget: float) -> dict[str, Any] | None:
    """Return the row of ``table`` with the most agreement within a mean compute ``budget``."""
    within = [row for row in table if row["compute"] <= budget]
    return max(within, key=lambda row: (row["agreement"], row["limit"])) if within else None


def calibration_table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown of `sweep` rows."""
    lines = ["| signal | limit | n | escalated | precision | recall | agreement kept | agreement "
             "| compute | % of full |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for row in rows:
        lines.append(
            f"| {row['signal']} | {row['limit']:.4g} | {row['n']} | {row['escalated']:.0%} | "
            f"{row['precision']:.0%} | {row['recall']:.0%} | {row['kept_agreement']:.0%} | "
            f"{row['agreement']:.0%} | {row['compute']:.3f} | {row['share_of_full']:.0%} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``kvblend bench guard``: the signals' sweeps over a run's rows, and the limit chosen."""
    parser = argparse.ArgumentParser(prog="kvblend bench guard", description=__doc__)
    parser.add_argument("result", help="a `kvblend bench nq` JSON of a strategy run with guard=inf")
    parser.add_argument("--strategy", default="default+guard=inf")
    parser.add_argument("--budget", type=float, default=0.35, help="mean compute allowed")
    parser.add_argument("--signals", default=",".join(GUARD_SIGNALS))
    args = parser.parse_args(argv)
    result = json.loads(Path(args.result).read_text())
    rows = paired_rows(result["rows"], args.strategy)
    if not rows:
        parser.error(f"no {args.strategy} rows with guard signals and answers in {args.result}")
    for signal in args.signals.split(","):
        table = sweep(rows, signal)
        print(f"\n{signal}:\n\n{calibration_table(table)}")
        best = choose_limit(table, args.budget)
        if best is not None:
            print(f"\nwithin compute {args.budget:g}: limit {best['limit']:.4g} (escalates "
                  f"{best['escalated']:.0%}, agreement {best['agreement']:.0%})")  # fmt: skip
    return 0
