"""Which guard signal predicts a blended answer that differs from full prefill's, and at what limit.

Input: the rows of a `kvblend bench nq` run (`kvblend.bench.quality.nq_eval`) of a strategy run with
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
budget: the most agreement the budget buys with that signal. ``separation`` says whether a
signal tells the questions apart at all: the probability that a question whose blended answer
differed from full's has a higher risk than one whose answer agreed (the area under the ROC
curve: 0.5 is chance), with a bootstrap 95% interval over questions; a guard whose signal
separates at chance escalates as a coin would, and its agreement per unit of compute is a
coin's.
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


def _auc(risks: np.ndarray, differ: np.ndarray) -> float:
    positive, negative = risks[differ], risks[~differ]
    if positive.size == 0 or negative.size == 0:
        return math.nan
    above = (positive[:, None] > negative[None, :]).mean()
    ties = (positive[:, None] == negative[None, :]).mean()
    return float(above + 0.5 * ties)


def separation(
    rows: Sequence[dict[str, Any]],
    signal: str,
    *,
    target: str = "agrees",
    resamples: int = 2000,
    seed: int = 0,
) -> dict[str, Any]:
    """How well ``signal`` ranks the rows whose ``target`` is false above the others (AUC).

    ``target``: ``"agrees"`` (the whole answer equals full's) or ``"top1_agrees"`` (its first
    token does). Returns the AUC, its paired-bootstrap 95% interval and the rows counted.
    """
    kept = [r for r in rows if math.isfinite(risk(r, signal))]
    risks = np.asarray([risk(r, signal) for r in kept], dtype=float)
    differ = np.asarray([not r[target] for r in kept], dtype=bool)
    rng = np.random.default_rng(seed)
    picks = (rng.integers(0, len(kept), len(kept)) for _ in range(resamples if kept else 0))
    draws = [_auc(risks[i], differ[i]) for i in picks]
    finite = [d for d in draws if math.isfinite(d)]
    interval = [float(np.quantile(finite, q)) for q in (0.025, 0.975)] if finite else [math.nan] * 2
    return {"signal": signal, "target": target, "n": len(kept), "differ": int(differ.sum()),
            "auc": _auc(risks, differ), "auc_ci": interval}  # fmt: skip


def separation_table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown of `separation` rows."""
    lines = ["| signal | predicts a differing | n | differing | AUC [95% CI] |",
             "|---|---|---|---|---|"]  # fmt: skip
    for row in rows:
        what = "answer" if row["target"] == "agrees" else "first token"
        low, high = row["auc_ci"]
        lines.append(f"| {row['signal']} | {what} | {row['n']} | {row['differ']} | "
                     f"{row['auc']:.2f} [{low:.2f}, {high:.2f}] |")  # fmt: skip
    return "\n".join(lines)


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
    parser.add_argument("--output", help="write the sweeps and separations as JSON (+ .md)")
    args = parser.parse_args(argv)
    result = json.loads(Path(args.result).read_text())
    rows = paired_rows(result["rows"], args.strategy)
    if not rows:
        parser.error(f"no {args.strategy} rows with guard signals and answers in {args.result}")
    signals = args.signals.split(",")
    separations = [separation(rows, signal, target=target)
                   for target in ("agrees", "top1_agrees") for signal in signals]  # fmt: skip
    text = [f"Guard signals of {args.strategy} on {len(rows)} questions of {args.result}: "
            "how well each ranks the questions whose answer differed from full prefill's",
            "", separation_table(separations)]  # fmt: skip
    sweeps: dict[str, list[dict[str, Any]]] = {}
    for signal in signals:
        sweeps[signal] = table = sweep(rows, signal)
        text += ["", f"{signal}:", "", calibration_table(table)]
        best = choose_limit(table, args.budget)
        if best is not None:
            text += ["", f"within compute {args.budget:g}: limit {best['limit']:.4g} (escalates "
                     f"{best['escalated']:.0%}, agreement {best['agreement']:.0%})"]  # fmt: skip
    print("\n".join(text))
    if args.output:
        from kvblend.bench.commands import command_line

        output = Path(args.output)
        record = {
            "benchmark": "guard", "command": command_line(), "source": args.result,
            "source_command": result.get("command"), "machine": result.get("machine"),
            "model": result.get("model"), "split": result.get("split"),
            "file_range": result.get("file_range"), "strategy": args.strategy,
            "budget": args.budget, "n": len(rows), "separation": separations, "sweeps": sweeps,
        }  # fmt: skip
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(record, indent=1))
        output.with_suffix(".md").write_text("\n".join(text) + "\n")
    return 0
