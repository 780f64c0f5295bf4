"""Which guard signal predicts a blended answer that differs from full prefill's, and at what limit.

Input: the rows of a `kvblend bench nq` run (`kvblend.bench.quality.nq_eval`) of a strategy run with
``guard=inf`` (every signal measured, nothing escalated) on calibration questions. The signals:

- the guard's own (`kvblend.blend.guard.GUARD_SIGNALS`), made after the blend's prefill;
- ``decode_margin_K`` for K = 1 .. `DECODE_STEPS`: the least of the margins (top-1 minus top-2
  probability) of the answer's first K tokens, which the rows record as decoding makes them
  (``decode_margin_1`` is the first token's: the blend's ``margin``). A guard on them would
  check during decoding, after K tokens.

A high value means risk, except for the margins (``margin`` and every ``decode_margin_K``:
`low_is_risk`), where a low one does. For every signal and limit the guard would escalate the
questions whose signal is past the limit (above it; below it for a margin); escalated questions
get full prefill's answer (the escalation computes the prompt in full, the head read in place),
the others keep the blend's. Per limit (in the signal's own units: what ``guard=`` takes with
``guard_signal=``):

- ``escalated``: the share of questions escalated;
- ``precision``: of the escalated questions, the share whose blended answer differed from full's
  (``first_token_precision``: whose first token did);
- ``recall``: of the questions whose blended answer differed, the share escalated;
- ``kept_agreement``: agreement with full among the questions not escalated;
- ``agreement``: agreement with full of the guarded answers (escalated ones agree);
- ``compute``: mean compute with the escalations (an escalation adds every row but the head, and
  for a decode-step signal the K answer tokens decoded before it, one row each);
- ``share_of_full``: accuracy of the guarded answers over full's.

``choose_limit`` picks the limit with the most agreement whose mean compute stays within a budget
(of equal agreement, the one that escalates least). ``separation`` says whether a signal tells the
questions apart at all: the probability that a question whose blended answer (or first token)
differed from full's has a higher risk than one whose answer agreed (the area under the ROC
curve: 0.5 is chance), with a bootstrap 95% interval over questions; a guard whose signal
separates at chance escalates as a coin would, and its agreement per unit of compute is a coin's.
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

from kvblend.blend.guard import GUARD_SIGNALS, LOW_IS_RISK

#: The decode steps whose margins the decode-step signals read (`kvblend bench nq` records 8).
DECODE_STEPS = 8
#: The decode-step signals: the least margin of the answer's first K tokens.
DECODE_PREFIX = "decode_margin_"
DECODE_SIGNALS = tuple(f"{DECODE_PREFIX}{k}" for k in range(1, DECODE_STEPS + 1))
#: Every signal the calibration ranks.
SIGNALS = GUARD_SIGNALS + DECODE_SIGNALS


def decode_steps(signal: str) -> int:
    """Return the K of a decode-step signal (``decode_margin_K``); 0 for a guard signal."""
    return int(signal.removeprefix(DECODE_PREFIX)) if signal.startswith(DECODE_PREFIX) else 0


def low_is_risk(signal: str) -> bool:
    """Whether a low value of ``signal`` means risk (the margins)."""
    return signal in LOW_IS_RISK or signal.startswith(DECODE_PREFIX)


def signal_value(row: dict[str, Any], signal: str) -> float:
    """Return the row's value of ``signal`` in its own units; NaN when the row lacks it."""
    steps = decode_steps(signal)
    if steps:
        margins = row.get("margins") or []
        return float(min(margins[:steps])) if margins else math.nan
    guard = row.get("guard") or {}
    value = (guard.get("signals") or {}).get(signal)
    return math.nan if value is None else float(value)


def risk(row: dict[str, Any], signal: str) -> float:
    """Return the row's risk by ``signal`` (higher: more at risk); NaN without the signal."""
    value = signal_value(row, signal)
    return -value if low_is_risk(signal) else value


def escalates(row: dict[str, Any], signal: str, limit: float) -> bool:
    """Whether a guard on ``signal`` at ``limit`` escalates ``row`` (never without the signal)."""
    value = signal_value(row, signal)
    return value < limit if low_is_risk(signal) else value > limit


def paired_rows(rows: Sequence[dict[str, Any]], strategy: str) -> list[dict[str, Any]]:
    """Return the ``strategy`` rows with guard signals or margins, each with full's answer.

    Each row gets ``full_correct``, whether its question's full prefill answered right.
    """
    full = {(r["qid"], r.get("k"), r["head"]): r for r in rows if r["strategy"] == "full"}
    out = []
    for row in rows:
        key = (row["qid"], row.get("k"), row["head"])
        measured = row.get("guard") or row.get("margins")
        if row["strategy"] == strategy and measured and key in full:
            out.append({**row, "full_correct": full[key]["correct"]})
    return out


def at_limit(rows: Sequence[dict[str, Any]], signal: str, limit: float) -> dict[str, Any]:
    """Return what a guard escalating past ``limit`` of ``signal`` would do on ``rows``."""
    escalate = [escalates(r, signal, limit) for r in rows]
    return {
        "signal": signal,
        "limit": limit,
        "n": len(rows),
        **_caught(rows, escalate),
        **_outcome(rows, escalate, decode_steps(signal)),
    }


def _caught(rows: Sequence[dict[str, Any]], escalate: list[bool]) -> dict[str, float]:
    """Return the share escalated, and of the answers unlike full's how many were caught."""
    differ = [not r["agrees"] for r in rows]
    first_differs = [not r.get("top1_agrees", True) for r in rows]
    caught = sum(e and d for e, d in zip(escalate, differ, strict=True))
    caught_first = sum(e and d for e, d in zip(escalate, first_differs, strict=True))
    escalated = sum(escalate)
    return {
        "escalated": escalated / len(rows),
        "precision": caught / escalated if escalated else math.nan,
        "first_token_precision": caught_first / escalated if escalated else math.nan,
        "recall": caught / sum(differ) if any(differ) else math.nan,
    }


def _outcome(rows: Sequence[dict[str, Any]], escalate: list[bool], steps: int) -> dict[str, float]:
    """Return the agreement with full, the compute and the accuracy with the escalations."""
    kept = [r for r, e in zip(rows, escalate, strict=True) if not e]
    cost = [
        _escalated_cost(r, steps) if e else r["compute_fraction"]
        for r, e in zip(rows, escalate, strict=True)
    ]
    correct = [
        r["full_correct"] if e else r["correct"] for r, e in zip(rows, escalate, strict=True)
    ]
    full_accuracy = statistics.fmean(float(r["full_correct"]) for r in rows)
    return {
        "kept_agreement": statistics.fmean(float(r["agrees"]) for r in kept) if kept else math.nan,
        "agreement": statistics.fmean(
            float(e or r["agrees"]) for r, e in zip(rows, escalate, strict=True)
        ),
        "compute": statistics.fmean(cost),
        "share_of_full": statistics.fmean(float(c) for c in correct) / full_accuracy
        if full_accuracy
        else math.nan,
    }


def _escalated_cost(row: dict[str, Any], steps: int) -> float:
    """Return an escalated row's compute: the blend, every row but the head, the K decoded."""
    prompt = row["prompt_tokens"]
    decoded = min(steps, len(row.get("margins") or []))
    return row["compute_fraction"] + (prompt - row.get("prefix_tokens", 0) + decoded) / prompt


def sweep(
    rows: Sequence[dict[str, Any]], signal: str, quantiles: Sequence[float] | None = None
) -> list[dict[str, Any]]:
    """`at_limit` at limits that escalate 0%, 5%, ..., 50% of ``rows`` (the signal's quantiles).

    ``quantiles``: the share of the rows each limit keeps (1: none escalated). Of limits that
    escalate the same rows, the first is kept.
    """
    values = np.asarray([signal_value(r, signal) for r in rows], dtype=float)
    values = values[np.isfinite(values)]
    if values.size == 0:
        return []
    points = list(quantiles) if quantiles is not None else np.linspace(1.0, 0.5, 11).tolist()
    if low_is_risk(signal):  # the low tail is at risk: the limits from the least value up
        points = [1.0 - q for q in points]
    limits = sorted(
        {float(np.quantile(values, q)) for q in points}, reverse=not low_is_risk(signal)
    )
    table, seen = [], set()
    for limit in limits:  # a limit that escalates the same questions as one before: left out
        escalated = tuple(escalates(row, signal, limit) for row in rows)
        if escalated not in seen:
            seen.add(escalated)
            table.append(at_limit(rows, signal, limit))
    return table


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
    token does). Returns the AUC, its bootstrap 95% interval over rows and the rows counted
    (those with the signal and the target).
    """
    kept = [r for r in rows if math.isfinite(risk(r, signal)) and r.get(target) is not None]
    risks = np.asarray([risk(r, signal) for r in kept], dtype=float)
    differ = np.asarray([not r[target] for r in kept], dtype=bool)
    rng = np.random.default_rng(seed)
    picks = (rng.integers(0, len(kept), len(kept)) for _ in range(resamples if kept else 0))
    draws = [_auc(risks[i], differ[i]) for i in picks]
    finite = [d for d in draws if math.isfinite(d)]
    interval = [float(np.quantile(finite, q)) for q in (0.025, 0.975)] if finite else [math.nan] * 2
    return {
        "signal": signal,
        "target": target,
        "n": len(kept),
        "differ": int(differ.sum()),
        "auc": _auc(risks, differ),
        "auc_ci": interval,
    }


def separation_table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown of `separation` rows."""
    lines = [
        "| signal | predicts a differing | n | differing | AUC [95% CI] |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        what = "answer" if row["target"] == "agrees" else "first token"
        low, high = row["auc_ci"]
        lines.append(
            f"| {row['signal']} | {what} | {row['n']} | {row['differ']} | "
            f"{row['auc']:.2f} [{low:.2f}, {high:.2f}] |"
        )
    return "\n".join(lines)


def choose_limit(table: Sequence[dict[str, Any]], budget: float) -> dict[str, Any] | None:
    """Return the row of ``table`` with the most agreement within a mean compute ``budget``.

    Of rows with equal agreement, the one escalating least; None when none fits the budget.
    """
    within = [row for row in table if row["compute"] <= budget]
    return max(within, key=lambda row: (row["agreement"], -row["escalated"])) if within else None


def _percent(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.0%}"


def calibration_table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown of `sweep` (or `choose_limit`) rows."""
    lines = [
        "| signal | limit | n | escalated | precision | first-token precision | recall "
        "| agreement kept | agreement | compute | % of full |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['signal']} | {row['limit']:.4g} | {row['n']} | {row['escalated']:.0%} | "
            f"{_percent(row['precision'])} | {_percent(row['first_token_precision'])} | "
            f"{_percent(row['recall'])} | {_percent(row['kept_agreement'])} | "
            f"{row['agreement']:.0%} | {row['compute']:.3f} | {_percent(row['share_of_full'])} |"
        )
    return "\n".join(lines)


def chosen_line(best: dict[str, Any], budget: float) -> str:
    """Say the limit `choose_limit` picked: the setting, escalation rate, precision and cost."""
    signal, limit = best["signal"], best["limit"]
    past = "below" if low_is_risk(signal) else "above"
    steps = decode_steps(signal)
    setting = f"guard={limit:.4g}, guard_signal={signal}"
    if steps:
        setting = f"a check after {steps} decoded token(s): no setting yet"
    return (
        f"{signal} within compute {budget:g}: limit {limit:.4g} (escalate {past}; {setting}): "
        f"escalates {best['escalated']:.0%}, precision {_percent(best['precision'])} "
        f"(first token {_percent(best['first_token_precision'])}), mean compute "
        f"{best['compute']:.3f} with escalations, agreement {best['agreement']:.0%}, "
        f"{_percent(best['share_of_full'])} of full's accuracy"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``kvblend bench guard``: the signals' separations and sweeps over a run's rows, limits."""
    parser = argparse.ArgumentParser(
        prog="kvblend bench guard",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("result", help="a `kvblend bench nq` JSON of a strategy run with guard=inf")
    parser.add_argument("--strategy", default="default+guard=inf")
    parser.add_argument("--budget", type=float, default=0.35, help="mean compute allowed")
    parser.add_argument(
        "--signals",
        default=",".join(SIGNALS),
        help="comma-separated (default: every guard and decode-step signal)",
    )
    parser.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples")
    parser.add_argument("--output", help="write the sweeps and separations as JSON (+ .md)")
    args = parser.parse_args(argv)
    signals = args.signals.split(",")
    unknown = [s for s in signals if s not in SIGNALS]
    if unknown:
        parser.error(f"unknown signal(s) {', '.join(unknown)}; use {', '.join(SIGNALS)}")
    result = json.loads(Path(args.result).read_text())
    rows = paired_rows(result["rows"], args.strategy)
    if not rows:
        parser.error(f"no {args.strategy} rows with guard signals or margins in {args.result}")
    separations = [
        separation(rows, signal, target=target, resamples=args.resamples)
        for target in ("top1_agrees", "agrees")
        for signal in signals
    ]
    separations = [row for row in separations if row["n"]]  # signals the rows have
    text = [
        f"Signals of {args.strategy} on {len(rows)} questions of {args.result}: how well each "
        "ranks the questions whose first token or whole answer differed from full prefill's",
        "",
        separation_table(separations),
    ]
    sweeps, chosen = _calibrate(rows, signals, args.budget, text)
    print("\n".join(text))
    if args.output:
        record = {
            "source": args.result,
            "source_command": result.get("command"),
            **{key: result.get(key) for key in ("machine", "model", "split", "file_range")},
            "strategy": args.strategy,
            "budget": args.budget,
            "n": len(rows),
            "separation": separations,
            "sweeps": sweeps,
            "chosen": chosen,
        }
        _write_record(Path(args.output), record, text)
    return 0


def _calibrate(
    rows: list[dict[str, Any]], signals: list[str], budget: float, text: list[str]
) -> tuple[dict[str, list[dict[str, Any]]], list[dict[str, Any]]]:
    """Sweep each signal's limits over the answered rows and choose one within ``budget``.

    Appends each signal's table and choice, then the choices best first, to ``text``; returns
    the sweeps and the choices.
    """
    answered = [r for r in rows if r.get("agrees") is not None and r.get("correct") is not None]
    sweeps: dict[str, list[dict[str, Any]]] = {}
    chosen: list[dict[str, Any]] = []
    for signal in signals if answered else ():
        sweeps[signal] = table = sweep(answered, signal)
        if not table:
            continue
        text += ["", f"{signal}:", "", calibration_table(table)]
        best = choose_limit(table, budget)
        if best is not None:
            chosen.append(best)
            text += ["", chosen_line(best, budget)]
    if chosen:
        chosen.sort(key=lambda row: (-row["agreement"], row["compute"]))
        text += [
            "",
            f"The limit each signal picks within compute {budget:g}, best first:",
            "",
            calibration_table(chosen),
        ]
    elif not answered:
        text += ["", "No answers in these rows (a --kl-only run): no limits to choose."]
    return sweeps, chosen


def _write_record(output: Path, record: dict[str, Any], text: list[str]) -> None:
    """Write the calibration as JSON to ``output``, with the command, and its text beside it."""
    from kvblend.bench.result_files import running_command

    record = {"benchmark": "guard", "command": running_command(), **record}
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(record, indent=1))
    output.with_suffix(".md").write_text("\n".join(text) + "\n")
