"""How close a strategy's answers are to full prefill's, read against the rounding floor.

A blend is judged by how far it moves full prefill's first-token distribution (KL) and its
greedy answer (the first token, the first 1 / 3 / 5 normalised words, the whole answer). Full
prefill itself moves that far under bfloat16 rounding of its prefill (``full@bf16-prefill``,
`kvblend.bench.quality.rounding`), so each figure is also given as a multiple of the floor's on
the same questions: the KL ratio (mean KL over the floor's mean KL) and disagreement ratios
(share of questions where the strategy disagrees with full prefill over the share where the floor
does). Intervals are paired bootstraps over questions: each resample draws questions, and both
the strategy's and the floor's figure are taken over the same draw.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kvblend.bench.quality.nq import normalize_answer

__all__ = ["WORDS", "closeness", "closeness_table", "floor_ratios", "same_words"]

#: Leading normalised words over which answers are compared (besides the whole answer).
WORDS = (1, 3, 5)
RESAMPLES = 2000


def same_words(answer: str, full_answer: str, words: int | None = None) -> bool:
    """Whether two answers agree once normalised, over their first ``words`` words if given."""
    first, second = normalize_answer(answer).split(), normalize_answer(full_answer).split()
    return first[:words] == second[:words] if words else first == second


def _interval(samples: np.ndarray) -> list[float]:
    finite = samples[np.isfinite(samples)]
    if finite.size == 0:
        return [math.nan, math.nan]
    low, high = np.percentile(finite, [2.5, 97.5])
    return [float(low), float(high)]


def _agreements(
    rows: Sequence[Mapping[str, Any]], full: Mapping[str, str]
) -> dict[str, list[float]]:
    """Per row (in order): 1.0 where the strategy agrees with full prefill, per measure."""
    out: dict[str, list[float]] = {"first_token": [float(r["top1_agrees"]) for r in rows]}
    if all(r.get("answer") is not None and r["qid"] in full for r in rows):
        for words in WORDS:
            out[f"words_{words}"] = [
                float(same_words(r["answer"], full[r["qid"]], words)) for r in rows
            ]
        out["answer"] = [float(same_words(r["answer"], full[r["qid"]])) for r in rows]
    return out


def closeness(
    rows: Sequence[Mapping[str, Any]], full: Mapping[str, str], *, seed: int = 0
) -> dict[str, Any]:
    """Agreement of ``rows`` with full prefill's answers ``full`` (by question id), with intervals.

    Returns ``agreement_<measure>`` and ``agreement_<measure>_ci`` for ``first_token``,
    ``words_1`` / ``words_3`` / ``words_5`` and ``answer`` (the answer measures only when every
    row has an answer).
    """
    measures = _agreements(rows, full)
    n = len(rows)
    index = np.random.default_rng(seed).integers(0, n, size=(RESAMPLES, n)) if n else None
    out: dict[str, Any] = {}
    for measure, values in measures.items():
        data = np.asarray(values)
        out[f"agreement_{measure}"] = float(data.mean()) if n else math.nan
        out[f"agreement_{measure}_ci"] = (
            _interval(data[index].mean(axis=1)) if index is not None else [math.nan, math.nan]
        )
    return out


def floor_ratios(
    rows: Sequence[Mapping[str, Any]],
    floor: Sequence[Mapping[str, Any]],
    full: Mapping[str, str],
    *,
    seed: int = 0,
) -> dict[str, Any]:
    """Each closeness figure of ``rows`` as a multiple of the ``floor`` rows' on the same questions.

    ``kl_ratio`` (mean KL over the floor's) and ``disagreement_ratio_<measure>`` (share
    disagreeing with full prefill over the floor's share), each with a paired bootstrap interval
    (``_ci``); questions missing from either side are left out (``floor_n`` says how many stay).
    A ratio whose floor figure is 0 is infinite (its interval drops the resamples where it is).
    """
    by_qid = {r["qid"]: r for r in floor}
    mine = [r for r in rows if r["qid"] in by_qid]
    theirs = [by_qid[r["qid"]] for r in mine]
    out: dict[str, Any] = {"floor_n": len(mine)}
    if not mine:
        return out
    index = np.random.default_rng(seed).integers(0, len(mine), size=(RESAMPLES, len(mine)))
    ours_kl, floor_kl = (np.asarray([r["kl"] for r in side]) for side in (mine, theirs))
    out.update(_ratio("kl_ratio", ours_kl, floor_kl, index))
    ours, floors = _agreements(mine, full), _agreements(theirs, full)
    for measure in [m for m in ours if m in floors]:  # in a fixed order: the JSON's keys
        out.update(
            _ratio(
                f"disagreement_ratio_{measure}",
                1.0 - np.asarray(ours[measure]),
                1.0 - np.asarray(floors[measure]),
                index,
            )
        )
    return out


def _ratio(name: str, ours: np.ndarray, floor: np.ndarray, index: np.ndarray) -> dict[str, Any]:
    """``name``: mean(ours) / mean(floor) and its interval over the resampled questions."""
    with np.errstate(divide="ignore", invalid="ignore"):
        if ours.mean() == 0:
            value = 0.0
        else:
            value = ours.mean() / floor.mean() if floor.mean() > 0 else math.inf
        samples = ours[index].mean(axis=1) / floor[index].mean(axis=1)
    return {name: float(value), f"{name}_ci": _interval(samples)}


def _share(entry: Mapping[str, Any], measure: str) -> str:
    value = entry.get(f"agreement_{measure}")
    if value is None or math.isnan(value):
        return "-"
    low, high = entry[f"agreement_{measure}_ci"]
    return f"{value:.1%} [{low * 100:.1f}, {high * 100:.1f}]"


def _times(entry: Mapping[str, Any], name: str) -> str:
    value = entry.get(name)
    if value is None:
        return "-"
    low, high = entry[f"{name}_ci"]
    return f"{value:.1f}x [{low:.1f}, {high:.1f}]"


def closeness_table(summary: Sequence[Mapping[str, Any]], keys: Sequence[str] = ("k",)) -> str:
    """Markdown table: each strategy's agreement with full prefill, and as a multiple of the floor.

    Agreement columns are shares of questions with 95% intervals; ``x floor`` columns are the
    `floor_ratios` (``-`` where the run has no ``full@bf16-prefill`` rows).
    """
    header = (
        "first token | first word | 3 words | 5 words | whole answer | mean KL [95% CI] "
        "| KL x floor | first token disagreement x floor | 5 words x floor | whole answer "
        "x floor | compute"
    )
    lines = [f"| {' | '.join(keys)} | strategy | n | {header} |", "|" + "---|" * (len(keys) + 13)]
    for entry in summary:
        if entry["strategy"] == "full":
            continue
        low, high = entry["kl_ci"]
        cells = [
            *(str(entry.get(key, "all")) for key in keys),
            entry["strategy"],
            str(entry["n"]),
            *(_share(entry, m) for m in ("first_token", "words_1", "words_3", "words_5", "answer")),
            f"{entry['kl_mean']:.4f} [{low:.4f}, {high:.4f}]",
            _times(entry, "kl_ratio"),
            _times(entry, "disagreement_ratio_first_token"),
            _times(entry, "disagreement_ratio_words_5"),
            _times(entry, "disagreement_ratio_answer"),
            f"{entry['compute_fraction']:.2f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
