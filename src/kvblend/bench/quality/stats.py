"""Paired statistics of a strategy against full prefill over the same questions.

Every strategy answers the same questions as full prefill, so differences are paired: resampling
questions (a bootstrap over question indices, seeded) and recomputing each statistic on the
resample gives intervals that account for which questions are hard. At 100 questions one
question is one point of accuracy; these intervals say how many points a difference needs
before it is more than the draw of questions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

RESAMPLES = 2000


def _interval(samples: np.ndarray) -> list[float]:
    """Return the central 95% of ``samples`` (NaN dropped), as ``[low, high]``."""
    finite = samples[np.isfinite(samples)]
    if finite.size == 0:
        return [math.nan, math.nan]
    low, high = np.percentile(finite, [2.5, 97.5])
    return [float(low), float(high)]


def paired_stats(
    correct: Sequence[bool],
    full_correct: Sequence[bool],
    kl: Sequence[float] | None = None,
    agrees: Sequence[bool] | None = None,
    *,
    seed: int = 0,
    resamples: int = RESAMPLES,
) -> dict[str, Any]:
    """Accuracy of a strategy against full prefill's on the same questions, with 95% intervals.

    Args:
        correct: per question, whether the strategy's answer is right.
        full_correct: per question (same order), whether full prefill's answer is right.
        kl: per question, KL(full || strategy) at the answer position.
        agrees: per question, whether the strategy's answer equals full prefill's.
        seed: seed of the bootstrap (same seed and data: same intervals).
        resamples: bootstrap resamples of the questions.

    Returns:
        ``n``, ``accuracy``, ``full_accuracy``, ``difference`` (strategy - full) with
        ``difference_ci``, ``share_of_full`` (accuracy / full accuracy, NaN when full scores 0)
        with ``share_of_full_ci``, ``kl_mean`` with ``kl_ci``, and ``agreement``.
    """
    ours = np.asarray(correct, dtype=float)
    full = np.asarray(full_correct, dtype=float)
    if ours.shape != full.shape or ours.ndim != 1 or ours.size == 0:
        raise ValueError("correct and full_correct must be equally long, non-empty sequences")
    n = ours.size
    rng = np.random.default_rng(seed)
    index = rng.integers(0, n, size=(resamples, n))
    ours_b = ours[index].mean(axis=1)
    full_b = full[index].mean(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        share_b = np.where(full_b > 0, ours_b / full_b, np.nan)
    accuracy, full_accuracy = float(ours.mean()), float(full.mean())
    result: dict[str, Any] = {
        "n": n,
        "accuracy": accuracy,
        "full_accuracy": full_accuracy,
        "difference": accuracy - full_accuracy,
        "difference_ci": _interval(ours_b - full_b),
        "share_of_full": accuracy / full_accuracy if full_accuracy else math.nan,
        "share_of_full_ci": _interval(share_b),
    }
    if kl is not None:
        kls = np.asarray(kl, dtype=float)
        result["kl_mean"] = float(kls.mean())
        result["kl_ci"] = _interval(kls[index].mean(axis=1))
    if agrees is not None:
        result["agreement"] = float(np.asarray(agrees, dtype=float).mean())
    return result


def strategy_stats(rows: Sequence[dict[str, Any]], *, seed: int = 0) -> dict[str, dict[str, Any]]:
    """`paired_stats` of every strategy in ``rows`` against the ``full`` rows, by question id.

    ``rows`` hold ``qid``, ``strategy``, ``correct``, ``kl`` and ``agrees``; questions that full
    prefill or the strategy lacks are left out of that strategy's comparison.
    """
    by_strategy: dict[str, dict[str, dict[str, Any]]] = {}
    for row in rows:
        by_strategy.setdefault(row["strategy"], {})[row["qid"]] = row
    full = by_strategy.get("full")
    if full is None:
        raise ValueError("no full-prefill rows to compare with")
    out: dict[str, dict[str, Any]] = {}
    for name, group in by_strategy.items():
        qids = [q for q in group if q in full]
        out[name] = paired_stats(
            [group[q]["correct"] for q in qids],
            [full[q]["correct"] for q in qids],
            kl=[group[q]["kl"] for q in qids],
            agrees=[group[q]["agrees"] for q in qids],
            seed=seed,
        )
    return out


def format_ci(value: float, interval: Sequence[float], percent: bool = True) -> str:
    """``92% [81, 103]`` (or ``0.091 [0.060, 0.130]`` with ``percent=False``)."""
    if math.isnan(value):
        return "-"
    if percent:
        return f"{value:.0%} [{interval[0] * 100:.0f}, {interval[1] * 100:.0f}]"
    return f"{value:.3f} [{interval[0]:.3f}, {interval[1]:.3f}]"


def paired_table(stats: dict[str, dict[str, Any]]) -> str:
    """Markdown table of `strategy_stats`: accuracy, share of full and KL with 95% intervals."""
    lines = [
        "| strategy | n | accuracy | % of full [95% CI] | difference, points [95% CI] | "
        "mean KL [95% CI] | agreement with full |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, s in stats.items():
        low, high = s["difference_ci"]
        lines.append(
            f"| {name} | {s['n']} | {s['accuracy']:.1%} | "
            f"{format_ci(s['share_of_full'], s['share_of_full_ci'])} | "
            f"{s['difference'] * 100:+.1f} [{low * 100:+.1f}, {high * 100:+.1f}] | "
            f"{format_ci(s['kl_mean'], s['kl_ci'], percent=False)} | {s['agreement']:.0%} |"
        )
    return "\n".join(lines)
