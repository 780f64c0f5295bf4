"""`kvblend bench nq` at a size that decides: resumable, baselines kept, results by gold place.

The NQ-open benchmark (`kvblend.bench.quality.nq`: a real retriever, the lost-in-the-middle prompt,
best-subspan exact match) run the way a headline figure needs it:

- **Splits.** The data file's questions are split once and for all: the *evaluation* questions
  are the file's first 500 (`EVAL`), the *calibration* questions those from 1000 on
  (`CALIBRATION`); settings and the guard's tolerance are chosen on calibration questions only,
  and evaluation questions are run for the reported figures. ``--offset`` counts inside a split.
- **Gold places.** ``gold_at="places"`` (the default here) puts each question's gold passage
  first, in the middle or last (`kvblend.bench.quality.nq.gold_place`: a third each, by a hash of
  the question), and every summary is given per place as well as overall.
- **Baselines kept.** Full prefill's answer and first-token logits are read from a
  `BaselineCache` when a run before computed them for the same model, dtype, prompt token ids
  and decoding; only every ``time_every``-th question runs full prefill again, to time it back
  to back with the strategies: the TTFT shares come from those questions.
- **Resumable.** The output JSON is written after every question; a run given the same output
  skips every (question, k, head, strategy) it holds and goes on, and refuses to mix rows
  measured under other settings.
- **Rows.** Per strategy and question: the answer, right or wrong, whether it equals full
  prefill's (normalised as the metric normalises), whether the first token does, KL(full ||
  strategy) at the first answer token, compute and recompute shares, the TTFT (on timed
  questions), what the blend's guard did, and the margins of the answer's first tokens
  (``margins``: the model's top-1 minus top-2 probability before each of the first
  `RunOptions.margins` tokens, from the logits decoding makes; None when nothing was decoded),
  with which `kvblend.bench.quality.guard_calibration` ranks whole answers that differ.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvblend.bench.quality.baselines import Baseline, BaselineCache
from kvblend.bench.quality.closeness import closeness, floor_ratios
from kvblend.bench.quality.compare import PromptItem
from kvblend.bench.quality.nq import (
    PLACES,
    NQQuestion,
    Passage,
    Retriever,
    file_digest,
    load_nq,
    normalize_answer,
    nq_prompt_items,
    write_json,
)
from kvblend.bench.quality.qa_bench import STOP, kl_divergence
from kvblend.bench.quality.rounding import RoundedPrefill
from kvblend.bench.quality.stats import strategy_stats
from kvblend.bench.strategies import FLOOR, Strategy
from kvblend.engine.engine import BlendEngine

#: The evaluation questions: the file's first 500 (reported figures only).
EVAL = (0, 500)
#: The calibration questions: the file's questions from 1000 on (settings, the guard's tolerance).
CALIBRATION = (1000, None)
SPLITS = {"eval": EVAL, "calibration": CALIBRATION, "all": (0, None)}

#: Settings a resumed run must share with the rows already in its output.
RESUME_KEYS = (
    "model",
    "dtype",
    "data_sha256",
    "split",
    "seed",
    "gold_at",
    "max_new_tokens",
    "kl_only",
    "default_config",
    "labels",
)
#: The value of a resume key in results written before the key existed.
RESUME_DEFAULTS = {"labels": "computed"}


def split_questions(split: str, offset: int, questions: int, total: int) -> tuple[int, int]:
    """Return the file indices ``[start, stop)`` of ``questions`` from ``offset`` in ``split``.

    ``ValueError`` when they run past the split's end (an evaluation run never takes a
    calibration question, nor the reverse).
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; use {', '.join(SPLITS)}")
    if offset < 0 or questions < 1:
        raise ValueError("offset must be >= 0 and questions >= 1")
    first, last = SPLITS[split]
    end = total if last is None else min(last, total)
    start, stop = first + offset, first + offset + questions
    if stop > end:
        raise ValueError(
            f"the {split} split holds questions {first}..{end - 1} of the file; "
            f"{questions} from offset {offset} run past it"
        )
    return start, stop


@dataclass(frozen=True)
class RunOptions:
    """How each question is run."""

    max_new_tokens: int = 32
    kl_only: bool = False  # prefill only: KL and the first token, no answers
    time_every: int = 10  # every n-th question times full prefill again (0: only when computed)
    #: a guarded strategy also gets ``NAME@unguarded`` rows: its blends without escalations
    unguarded: bool = True
    #: the answer's first tokens whose margins each row records (0: none)
    margins: int = 8


def agree(answer: str | None, full_answer: str | None) -> bool | None:
    """Whether two answers are the same once normalised as the metric does (None: no answer)."""
    if answer is None or full_answer is None:
        return None
    return normalize_answer(answer) == normalize_answer(full_answer)


def _timed(
    engine: BlendEngine,
    item: PromptItem,
    strat: Strategy,
    options: RunOptions,
    rounded: RoundedPrefill | None = None,
) -> tuple[Any, str | None, float | None, list[float] | None]:
    """Prefill (and decode unless KL only); return the prefill, answer, TTFT and margins.

    The margins: the answer's first ``options.margins`` (None without an answer, or at 0). A
    rounded reference (``strat.rounding``) runs on ``rounded`` and has no TTFT.
    """
    if strat.rounding is not None:
        return _rounded(engine, item, strat, options, rounded)
    pre = engine.prefill(strat.segments(item.segments), strat.config)
    prefill_s = pre.stats.timings.get("prefill_s", 0.0)
    if options.kl_only:
        return pre, None, prefill_s, None
    out = engine.generate(
        pre, max_new_tokens=options.max_new_tokens, stop=list(STOP), margins=options.margins
    )
    return pre, out.text.strip(), out.ttft_s + prefill_s, out.margins if options.margins else None


def _rounded(
    engine: BlendEngine,
    item: PromptItem,
    strat: Strategy,
    options: RunOptions,
    rounded: RoundedPrefill | None,
) -> tuple[Any, str | None, None, list[float] | None]:
    """``strat`` on the bfloat16 copy; decoded by ``engine`` (``prefill``) or in bfloat16."""
    if rounded is None:
        raise ValueError(f"{strat.name} needs the engine's bfloat16 copy (a RoundedPrefill)")
    documents = strategy_documents(strat, item) if strat.config.reads_cache else ()
    bf16 = rounded.rounded_prefill(strat.segments(item.segments), strat.config, documents)
    pre = rounded.in_engine_dtype(bf16)
    if options.kl_only:
        return pre, None, None, None
    decoding: dict[str, Any] = {
        "max_new_tokens": options.max_new_tokens,
        "stop": list(STOP),
        "margins": options.margins,
    }
    out = (
        engine.generate(pre, **decoding)
        if strat.rounding == "prefill"
        else rounded.decode(bf16, **decoding)
    )
    return pre, out.text.strip(), None, out.margins if options.margins else None


def strategy_documents(strat: Strategy, item: PromptItem) -> list[str]:
    """Return the document texts ``strat`` caches in ``item``'s prompt (its own layout)."""
    return [s.text for s in strat.segments(item.segments) if s.cache and s.role == "document"]


def guard_fields(stats: Any) -> dict[str, Any]:
    """Return what a prefill's guard did, for a row (nothing when the stats carry no guard)."""
    guard = getattr(stats, "guard", None)
    if guard is None:
        return {"escalated": False}
    report = guard.to_dict() if hasattr(guard, "to_dict") else dict(guard)
    return {"escalated": bool(report.get("escalated")), "guard": report}


def baseline_for(
    engine: BlendEngine,
    item: PromptItem,
    full: Strategy,
    cache: BaselineCache | None,
    options: RunOptions,
    retime: bool,
) -> tuple[Baseline, float | None, bool | None]:
    """Full prefill's answer and logits for ``item``: from ``cache``, else computed and kept.

    Returns the baseline, full prefill's TTFT when it ran now (``retime``, or a miss), and
    whether running again gave the cached answer (None when it did not run again). The key
    holds torch's thread count too: kernels split their sums by thread, and an answer at a
    near-tie can follow the rounding. A cached answer without the margins ``options`` asks
    for runs again once, and its entry gains them (when the answer is the same).
    """
    token_ids = engine.plan(item.segments).token_ids.tolist()
    key, cached = _cached_baseline(engine, token_ids, cache, options)
    steps = 0 if options.kl_only else options.margins
    if cached is not None and not retime and cached.margin_steps >= steps:
        return cached, None, None
    fresh = _full_prefill(engine, item, full, options, token_ids, steps)
    if cached is None:
        if cache is not None:
            cache.put(key, fresh)
        return fresh, fresh.ttft_s, None
    same = cached.answer == fresh.answer
    if same and cached.margin_steps < steps:  # the entry gains the margins it lacked
        cached = replace(cached, margins=fresh.margins, margin_steps=steps)
        if cache is not None:
            cache.put(key, cached)
    return cached, fresh.ttft_s, same


def _baseline_key(
    engine: BlendEngine, token_ids: list[int], options: RunOptions, *, kl_only: bool
) -> str:
    """Return the `BaselineCache` key of full prefill on ``token_ids`` (``kl_only``: no answer)."""
    decoding = {
        "max_new_tokens": options.max_new_tokens,
        "stop": list(STOP),
        "greedy": True,
        "kl_only": kl_only,
        "threads": torch.get_num_threads(),
    }
    return BaselineCache.key(engine.fingerprint, str(engine.decoder.dtype), token_ids, decoding)


def _cached_baseline(
    engine: BlendEngine, token_ids: list[int], cache: BaselineCache | None, options: RunOptions
) -> tuple[str, Baseline | None]:
    """Return the baseline's key and its cached entry (None: not cached).

    A KL-only run also takes the entry of a run that answered (its logits are the same).
    """
    key = _baseline_key(engine, token_ids, options, kl_only=options.kl_only)
    if cache is None:
        return key, None
    cached = cache.get(key)
    if cached is None and options.kl_only:  # a baseline with its answer
        cached = cache.get(_baseline_key(engine, token_ids, options, kl_only=False))
    return key, cached


def _full_prefill(
    engine: BlendEngine,
    item: PromptItem,
    full: Strategy,
    options: RunOptions,
    token_ids: list[int],
    steps: int,
) -> Baseline:
    """Run full prefill on ``item`` now: its answer, logits, TTFT and ``steps`` margins."""
    pre, answer, ttft, margins = _timed(engine, item, full, options)
    assert ttft is not None  # full prefill is timed (only rounded references are not)
    if pre.token_ids != token_ids:
        raise RuntimeError("full prefill read other token ids than the prompt's plan")
    return Baseline(answer or "", pre.logits.float().cpu(), len(token_ids), ttft, margins, steps)


def evaluate_question(
    engines: Mapping[str, BlendEngine],
    item: PromptItem,
    strategies: Sequence[Strategy],
    *,
    cache: BaselineCache | None,
    options: RunOptions,
    retime: bool,
    done: set[tuple[str, str]] | frozenset[tuple[str, str]] = frozenset(),
    rounded: Mapping[str, RoundedPrefill] | None = None,
) -> list[dict[str, Any]]:
    """Rows of ``item``: full prefill (cached or run), then each strategy not in ``done``.

    ``done`` holds (head, strategy) pairs already measured on this item. With ``retime``
    full prefill runs again (its answer checked against the cached one) and every row gets
    a TTFT; else only the strategies' prefills run. ``rounded`` runs the rounded references
    (``full@bf16-prefill``, ``full@bf16``).
    """
    if not strategies or strategies[0].name != "full":
        raise ValueError("the first strategy must be 'full', the baseline")
    documents = dict.fromkeys(text for s in strategies for text in strategy_documents(s, item))
    for engine in engines.values():
        engine.precompute(list(documents), progress=False)
    first = next(iter(engines.values()))
    baseline, full_ttft, confirmed = baseline_for(
        first, item, strategies[0], cache, options, retime
    )
    question = _Question(item, baseline, full_ttft, options, rounded)
    rows: list[dict[str, Any]] = []
    for head, engine in engines.items():
        if (head, "full") not in done:
            rows.append(question.full_row(head, confirmed))
        for strat in strategies[1:]:
            if (head, strat.name) not in done:
                rows += question.strategy_rows(engine, head, strat, rows)
    return rows


@dataclass(frozen=True)
class _Question:
    """One question with full prefill's baseline, against which each of its rows is measured."""

    item: PromptItem
    baseline: Baseline
    full_ttft: float | None  # full prefill's TTFT when it ran now (timed question), else None
    options: RunOptions
    rounded: Mapping[str, RoundedPrefill] | None

    @property
    def full_answer(self) -> str | None:
        """Full prefill's answer (None in a KL-only run)."""
        return None if self.options.kl_only else self.baseline.answer

    def base(self) -> dict[str, Any]:
        """Return the fields every row of the question starts with."""
        return {
            "qid": self.item.qid,
            **self.item.meta,
            "prompt_tokens": self.baseline.prompt_tokens,
            "full_ttft_s": self.full_ttft,
        }

    def full_row(self, head: str, confirmed: bool | None) -> dict[str, Any]:
        """Return full prefill's row on ``head`` (``confirmed``: running again gave its answer)."""
        answer = self.full_answer
        return {
            **self.base(),
            "head": head,
            "strategy": "full",
            "answer": answer,
            "correct": None if answer is None else self.item.score(answer),
            "agrees": None if answer is None else True,
            "top1_agrees": True,
            "kl": 0.0,
            "compute_fraction": 1.0,
            "recompute_fraction": 0.0,
            "documents_reused": 0,
            "recomputed_tokens": 0,
            "fallback": None,
            "ttft_s": self.full_ttft,
            "baseline_confirmed": confirmed,
            "escalated": False,
            "margins": None if self.options.kl_only else self.baseline.margins,
        }

    def strategy_rows(
        self, engine: BlendEngine, head: str, strat: Strategy, earlier: Sequence[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        """Return ``strat``'s rows on ``head``: its own, and its unguarded one if it has a guard.

        A strategy that reads no document has the prefill of another head's row in ``earlier``:
        that row is taken, not run again.
        """
        twin = None if strat.config.reads_cache else _other_head_row(earlier, strat.name, head)
        if twin is not None:  # it reads no document: the same prefill as another head's
            return [{**twin, "head": head}]

        def run(strategy: Strategy, name: str) -> dict[str, Any]:
            return self.row(engine, head, strategy, name)

        guarded = run(strat, strat.name)
        if self.options.unguarded and guarded.get("guard") is not None:
            return [guarded, unguarded_row(guarded, strat, run)]
        return [guarded]

    def row(self, engine: BlendEngine, head: str, strat: Strategy, name: str) -> dict[str, Any]:
        """Run ``strat`` on ``head``'s ``engine``: its row, named ``name``."""
        with strat.loop():
            copy = None if self.rounded is None else self.rounded.get(head)
            pre, answer, ttft, margins = _timed(engine, self.item, strat, self.options, copy)
        base_line = self.baseline
        if len(pre.token_ids) != base_line.prompt_tokens:
            raise RuntimeError(f"{name} prefilled another prompt than full prefill")
        stats = pre.stats
        return {
            **self.base(),
            "head": head,
            "strategy": name,
            "answer": answer,
            "correct": None if answer is None else self.item.score(answer),
            "agrees": agree(answer, self.full_answer),
            "top1_agrees": int(pre.logits.argmax()) == int(base_line.logits.argmax()),
            "kl": kl_divergence(base_line.logits, pre.logits),
            "compute_fraction": stats.compute_fraction,
            "recompute_fraction": stats.recompute_fraction,
            "documents_reused": stats.documents_reused,
            "recomputed_tokens": stats.recomputed_tokens,
            "fallback": stats.fallback,
            "prefix_tokens": stats.prefix_tokens,
            "ttft_s": ttft if self.full_ttft is not None and ttft is not None else None,
            **guard_fields(stats),
            "margins": margins,
        }


def _other_head_row(rows: Sequence[dict[str, Any]], name: str, head: str) -> dict[str, Any] | None:
    """Return the first of ``rows`` of strategy ``name`` on a head other than ``head``, if any."""
    return next((r for r in rows if r["strategy"] == name and r["head"] != head), None)


#: The suffix of a guarded strategy's rows without its escalations (`RunOptions.unguarded`).
UNGUARDED = "@unguarded"


def unguarded_row(
    guarded: dict[str, Any], strat: Strategy, run: Callable[[Strategy, str], dict[str, Any]]
) -> dict[str, Any]:
    """Return the row the guarded strategy ``strat`` would have without its escalation.

    Where the guard did not escalate it is the guarded row itself (the same blend); where it
    did, the blend runs again with the guard off (its answer, KL and compute, no TTFT).
    """
    name = strat.name + UNGUARDED
    if not guarded["escalated"]:  # no TTFT: the guarded row's is the strategy's
        return {**guarded, "strategy": name, "ttft_s": None}
    config = strat.config.replace(guard=None)
    again = run(Strategy(name, config, strat.cache_documents, strat.compiled), name)
    return {
        **again,
        "ttft_s": None,
        "guard": guarded["guard"],
        "escalated": False,
        "guard_would_escalate": True,
    }


# ------------------------------------------------------------------------- summaries
def _bootstrap_mean(values: Sequence[float], seed: int, resamples: int = 2000) -> list[float]:
    data = np.asarray(values, dtype=float)
    if data.size == 0:
        return [math.nan, math.nan]
    index = np.random.default_rng(seed).integers(0, data.size, size=(resamples, data.size))
    low, high = np.percentile(data[index].mean(axis=1), [2.5, 97.5])
    return [float(low), float(high)]


def summarize(
    rows: Sequence[dict[str, Any]], *, group_by: Sequence[str] = ("k", "head"), seed: int = 0
) -> list[dict[str, Any]]:
    """Each group's strategies against full prefill on the same questions.

    Paired bootstrap intervals (`kvblend.bench.quality.stats`) of the accuracy difference, the share
    of full's accuracy and the mean KL; agreement with full (normalised answers) with its interval,
    first-token agreement, mean compute and recompute shares, the TTFT share over the timed
    questions (total strategy TTFT over total full TTFT on the same questions, ``ttft_n`` of them)
    and the escalation rate. KL-only rows (no answers) get the KL and first-token figures.
    """
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(tuple(row.get(key) for key in group_by), []).append(row)
    out = []
    for key, rows_of_group in groups.items():
        group = _Group.of(rows_of_group, seed)
        for name in dict.fromkeys(r["strategy"] for r in rows_of_group):
            mine = group.rows_of(name)
            if mine:
                labels = dict(zip(group_by, key, strict=True))
                out.append(
                    {**labels, "strategy": name, **group.entry(name, mine, seed), **_means(mine)}
                )
    return out


@dataclass(frozen=True)
class _Group:
    """One summary group's rows and what each of its strategies is compared with."""

    rows: list[dict[str, Any]]
    answered: bool  # every row has an answer (not a KL-only run)
    paired: dict[str, dict[str, Any]]  # `strategy_stats` by strategy, when answered
    full_qids: frozenset[str]  # the questions with a full prefill row
    full_answers: dict[str, str]  # full prefill's answer by question
    floor: list[dict[str, Any]]  # the rounding floor's rows (`FLOOR`)

    @classmethod
    def of(cls, rows: list[dict[str, Any]], seed: int) -> _Group:
        """Return the group of ``rows``."""
        answered = all(row.get("correct") is not None for row in rows)
        full_by_qid = {r["qid"]: r for r in rows if r["strategy"] == "full"}
        full_answers = {
            qid: row["answer"] for qid, row in full_by_qid.items() if row.get("answer") is not None
        }
        floor = [r for r in rows if r["strategy"] == FLOOR and r["qid"] in full_by_qid]
        paired = strategy_stats(rows, seed=seed) if answered else {}
        return cls(rows, answered, paired, frozenset(full_by_qid), full_answers, floor)

    def rows_of(self, name: str) -> list[dict[str, Any]]:
        """Return strategy ``name``'s rows on the questions full prefill has."""
        return [r for r in self.rows if r["strategy"] == name and r["qid"] in self.full_qids]

    def entry(self, name: str, mine: list[dict[str, Any]], seed: int) -> dict[str, Any]:
        """Return strategy ``name``'s figures on its rows ``mine``: accuracy, KL, closeness."""
        entry: dict[str, Any] = dict(self.paired.get(name, {}))
        kls = [r["kl"] for r in mine]
        entry.setdefault("n", len(mine))
        entry.setdefault("kl_mean", statistics.fmean(kls))
        entry.setdefault("kl_ci", _bootstrap_mean(kls, seed))
        entry["kl_median"] = statistics.median(kls)
        if self.answered:
            entry["agreement_ci"] = _bootstrap_mean([float(r["agrees"]) for r in mine], seed)
        entry["top1_agreement"] = statistics.fmean(float(r["top1_agrees"]) for r in mine)
        entry.update(closeness(mine, self.full_answers, seed=seed))
        if self.floor and name != "full":
            entry.update(floor_ratios(mine, self.floor, self.full_answers, seed=seed))
        entry.update(_ttft_share(mine))
        return entry


def _ttft_share(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Return the rows' TTFT over full prefill's: ``ttft_ratio`` (None: none timed), ``ttft_n``.

    Over the timed rows, each against full prefill's TTFT timed right before it on the same prompt.
    """
    timed = [r for r in rows if r.get("ttft_s") is not None and r.get("full_ttft_s") is not None]
    full_time = sum(r["full_ttft_s"] for r in timed)
    ratio = sum(r["ttft_s"] for r in timed) / full_time if timed else None
    return {"ttft_ratio": ratio, "ttft_n": len(timed)}


def _means(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Return the mean compute and recompute shares, escalation rate and prompt length."""
    return {
        "compute_fraction": statistics.fmean(r["compute_fraction"] for r in rows),
        "recompute_fraction": statistics.fmean(r["recompute_fraction"] for r in rows),
        "escalation_rate": statistics.fmean([bool(r.get("escalated")) for r in rows]),
        "prompt_tokens_mean": statistics.fmean(r["prompt_tokens"] for r in rows),
    }


def _ci(value: float, interval: Sequence[float], percent: bool) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if percent:
        return f"{value:.0%} [{interval[0] * 100:.0f}, {interval[1] * 100:.0f}]"
    return f"{value:.3f} [{interval[0]:.3f}, {interval[1]:.3f}]"


def decided_table(summary: Sequence[dict[str, Any]], keys: Sequence[str] = ("k", "place")) -> str:
    """Markdown table of `summarize` output, one row per group and strategy."""
    columns = (
        "n | accuracy | % of full [95% CI] | difference, points [95% CI] | agreement with "
        "full [95% CI] | first token | mean KL [95% CI] | escalated | compute (of full) "
        "| TTFT (of full, n)"
    )
    lines = [f"| {' | '.join(keys)} | strategy | {columns} |", "|" + "---|" * (len(keys) + 11)]
    for s in summary:
        if "accuracy" in s:
            low, high = s["difference_ci"]
            accuracy = f"{s['accuracy']:.1%}"
            share = _ci(s["share_of_full"], s["share_of_full_ci"], True)
            diff = f"{s['difference'] * 100:+.1f} [{low * 100:+.1f}, {high * 100:+.1f}]"
            agreement = _ci(s["agreement"], s["agreement_ci"], True)
        else:
            accuracy = share = diff = agreement = "-"
        ttft = "-" if s["ttft_ratio"] is None else f"{s['ttft_ratio']:.2f} ({s['ttft_n']})"
        lines.append(
            "| " + " | ".join(str(s.get(key, "all")) for key in keys) + f" | {s['strategy']} | "
            f"{s['n']} | {accuracy} | {share} | {diff} | {agreement} | "
            f"{s['top1_agreement']:.0%} | {_ci(s['kl_mean'], s['kl_ci'], False)} | "
            f"{s['escalation_rate']:.0%} | {s['compute_fraction']:.2f} | {ttft} |"
        )
    return "\n".join(lines)


def summaries(rows: Sequence[dict[str, Any]], seed: int) -> dict[str, list[dict[str, Any]]]:
    """Return the summaries a result holds: by k and head, and by k, head and gold place."""
    by_place = [r for r in rows if r.get("place") in PLACES]
    return {
        "summary": summarize(rows, group_by=("k", "head"), seed=seed),
        "by_place": summarize(by_place, group_by=("k", "head", "place"), seed=seed),
    }


# ------------------------------------------------------------------------- the run
def shard_path(output: Path, shard: tuple[int, int]) -> Path:
    """Where shard ``(k, n)`` of a run into ``output`` writes: ``NAME.shard-k-of-n.json``."""
    index, count = shard
    return output.with_name(f"{output.stem}.shard-{index}-of-{count}{output.suffix}")


def _shard_rows(output: Path | None, settings: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows the shards of a run into ``output`` wrote (`shard_path`), checked for their settings."""
    if output is None:
        return []
    rows: list[dict[str, Any]] = []
    for path in sorted(output.parent.glob(f"{output.stem}.shard-*-of-*{output.suffix}")):
        rows += _load_previous(path, settings)
    return rows


def _load_previous(output: Path | None, settings: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows of an earlier run into ``output`` with the same settings (``ValueError`` if not)."""
    import json

    if output is None or not output.exists():
        return []
    previous = json.loads(output.read_text())
    clash = {
        key: (previous.get(key, RESUME_DEFAULTS.get(key)), settings[key])
        for key in RESUME_KEYS
        if previous.get(key, RESUME_DEFAULTS.get(key)) != settings[key]
    }
    rows = list(previous.get("rows", []))
    if set(clash) == {"default_config"}:  # rows of another BlendConfig(): "default" meant it
        return [row for row in rows if not row["strategy"].startswith("default")]
    if clash:
        detail = "; ".join(
            f"{key}: {was!r} there, {now!r} now" for key, (was, now) in clash.items()
        )
        raise ValueError(
            f"{output} holds rows of another run ({detail}); give another --output "
            "or --fresh to start over"
        )
    return rows


def progress_message(
    rows: Sequence[dict[str, Any]], k: int, done: int, total: int, started: float, ran: int
) -> str:
    """``[k=10 40/500, 12.3 s/question, 1h34m left] default: acc 21% (full 23%) ...``."""
    spent = time.perf_counter() - started
    per = spent / ran if ran else 0.0
    left = per * (total - done)
    mine = [r for r in rows if r.get("k") == k]
    parts = []
    for name in dict.fromkeys(r["strategy"] for r in mine):
        group = [r for r in mine if r["strategy"] == name]
        kl = statistics.fmean(r["kl"] for r in group)
        text = f"{name}: KL {kl:.3f}"
        if group[0].get("correct") is not None:
            accuracy = statistics.fmean(float(r["correct"]) for r in group)
            agreement = statistics.fmean(float(r["agrees"]) for r in group)
            text += f", acc {accuracy:.0%}, agrees {agreement:.0%}"
        if any(r.get("escalated") for r in group):
            rate = statistics.fmean(float(bool(r.get("escalated"))) for r in group)
            text += f", escalated {rate:.0%}"
        parts.append(text)
    return f"[k={k} {done}/{total}, {per:.1f} s/question, {left / 3600:.1f} h left] " + "; ".join(
        parts
    )


def run_decided(
    engines: dict[str, BlendEngine],
    data: str | Path,
    strategies: Sequence[Strategy],
    *,
    ks: Sequence[int] = (10,),
    split: str = "eval",
    questions: int = 100,
    offset: int = 0,
    seed: int = 0,
    gold_at: str = "places",
    labels: str = "computed",
    options: RunOptions = RunOptions(),
    cache: BaselineCache | None = None,
    cache_dir: Path | None = None,
    output: Path | None = None,
    meta: dict[str, Any] | None = None,
    log: Callable[[str], None] | None = None,
    shard: tuple[int, int] = (0, 1),
    stop: Callable[[], bool] | None = None,
) -> dict[str, Any]:
    """Every strategy on ``questions`` questions of ``split`` at each k; resumable, JSON as it goes.

    An existing ``output`` of the same settings is continued: the (question, k, head, strategy)
    rows it holds are kept and not run again; when only ``BlendConfig()`` changed since, its
    ``default`` rows (which measured the other default) are dropped and run again. ``shard``
    ``(k, n)`` with ``n > 1``: only every ``n``-th question from the ``k``-th, its rows written
    to `shard_path` (``n`` processes, one per core, each with its own file; rows ``output``
    holds already are not run again); a run without a shard takes the rows of every shard file
    beside ``output`` as done, runs what is left and writes the whole result to ``output``.
    ``stop``: asked after each question; when it returns True the run ends there, and the
    result's ``stopped`` says after how many of its questions (`stopped_note`).
    """
    _check_shard(shard)
    chosen = _Chosen.load(data, split, offset, questions)
    engine = next(iter(engines.values()))
    settings = _run_settings(engine, data, split, seed, gold_at, labels, options, meta)
    earlier, rows, output = _resumed_rows(output, settings, shard)
    retriever = Retriever(chosen.corpus, data_path=data, cache_dir=cache_dir)
    result = _result_head(
        engines, strategies, chosen, retriever, settings, meta, ks, shard, options, cache
    )
    items = chosen.prompt_items(engine, retriever, ks, seed, gold_at, labels)
    rounded = _rounded_copies(engines, strategies)
    if rounded is not None:
        result["rounding"] = next(iter(rounded.values())).rounding
    done = _done_pairs([*earlier, *rows])
    run = _DecidedRun(
        engines, strategies, options, cache, output, seed, shard, log, result, rows, done, rounded
    )
    for k in ks:
        if stop is not None and stop():
            break
        run.run_k(k, [item for item in items if item.meta["k"] == k], stop)
    if stop is not None and stop():
        pairs = {(head, s.name) for head in engines for s in strategies}
        have = _done_pairs([*earlier, *rows])
        finished = sum(pairs <= have.get((i.qid, i.meta["k"]), set()) for i in items)
        result["stopped"] = {"questions_done": finished, "questions": len(items)}
    run.checkpoint()
    return result


def stopped_note(result: dict[str, Any]) -> str:
    """Return ``"stopped after N of M questions; ..."`` for a stopped run's result, else ``""``.

    A question counts once per k, and as done when every head ran every strategy on it.
    """
    stopped = result.get("stopped")
    if not stopped:
        return ""
    return (
        f"stopped after {stopped['questions_done']} of {stopped['questions']} questions "
        "(the same command resumes the run)"
    )


def _check_shard(shard: tuple[int, int]) -> None:
    """Raise ``ValueError`` unless ``shard`` ``(k, n)`` has ``0 <= k < n``."""
    index, count = shard
    if not 0 <= index < count:
        raise ValueError(f"shard {index}/{count}: needs 0 <= {index} < {count}")


@dataclass(frozen=True)
class _Chosen:
    """The questions a run asks, and the data file's corpus they are asked over."""

    data: str | Path
    corpus: list[Passage]
    questions: list[NQQuestion]
    offset: int  # the first question's place in its split
    file_range: tuple[int, int]  # the questions' indices in the file, [start, stop)

    @classmethod
    def load(cls, data: str | Path, split: str, offset: int, questions: int) -> _Chosen:
        """Read ``data``: its corpus and ``questions`` questions from ``offset`` in ``split``."""
        corpus, all_questions = load_nq(data)
        start, stop = split_questions(split, offset, questions, len(all_questions))
        return cls(data, corpus, all_questions[start:stop], offset, (start, stop))

    def prompt_items(
        self,
        engine: BlendEngine,
        retriever: Retriever,
        ks: Sequence[int],
        seed: int,
        gold_at: str,
        labels: str,
    ) -> list[PromptItem]:
        """Return the questions' prompts at each k in turn (`nq_prompt_items`)."""
        return nq_prompt_items(
            engine,
            self.corpus,
            self.questions,
            retriever,
            ks=ks,
            seed=seed,
            gold_at=gold_at,
            labels=labels,
        )


def _result_head(
    engines: dict[str, BlendEngine],
    strategies: Sequence[Strategy],
    chosen: _Chosen,
    retriever: Retriever,
    settings: dict[str, Any],
    meta: dict[str, Any] | None,
    ks: Sequence[int],
    shard: tuple[int, int],
    options: RunOptions,
    cache: BaselineCache | None,
) -> dict[str, Any]:
    """Return what a run's result says before its rows: its settings, questions and strategies."""
    return {
        "benchmark": "nq",
        **(meta or {}),
        **settings,
        "data": str(chosen.data),
        "corpus_passages": len(chosen.corpus),
        "embeddings_cache": str(retriever.cache_path),
        "questions": len(chosen.questions),
        "offset": chosen.offset,
        "file_range": list(chosen.file_range),
        "ks": list(ks),
        "shard": list(shard),
        "heads": {head: e.doc_prefix for head, e in engines.items()},
        "strategies": [s.name for s in strategies],
        "time_every": options.time_every,
        "baselines": str(cache.directory) if cache is not None else None,
        "recall": {},
    }


def _run_settings(
    engine: BlendEngine,
    data: str | Path,
    split: str,
    seed: int,
    gold_at: str,
    labels: str,
    options: RunOptions,
    meta: dict[str, Any] | None,
) -> dict[str, Any]:
    """Return the settings (`RESUME_KEYS`) under which alone a run's rows are resumed."""
    return {
        "model": str(engine.name),
        "dtype": str(engine.decoder.dtype).replace("torch.", ""),
        "data_sha256": file_digest(data),
        "split": split,
        "seed": seed,
        "gold_at": gold_at,
        "max_new_tokens": options.max_new_tokens,
        "kl_only": options.kl_only,
        "default_config": (meta or {}).get("default_config"),
        "labels": labels,
    }


def _resumed_rows(
    output: Path | None, settings: dict[str, Any], shard: tuple[int, int]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], Path | None]:
    """Return the rows done already, the rows a run goes on from and the file it writes.

    A shard's: the whole run's rows in ``output`` (done, not its own), the rows of its shard
    file and that file. A run without a shard: none, the rows of ``output`` and of its shards'
    files (a question in both is taken once) and ``output``.
    """
    earlier: list[dict[str, Any]] = []
    if shard[1] > 1 and output is not None:
        earlier = _load_previous(output, settings)
        output = shard_path(output, shard)
    rows = _load_previous(output, settings)
    if shard[1] == 1:  # the shards' rows, taken once (a question in both is run by neither again)
        seen = {_row_key(row) for row in rows}
        for row in _shard_rows(output, settings):
            if (key := _row_key(row)) not in seen:
                seen.add(key)
                rows.append(row)
    return earlier, rows, output


def _row_key(row: dict[str, Any]) -> tuple[Any, ...]:
    """Return a row's question, k, head and strategy: what a run measures once."""
    return row["qid"], row.get("k"), row["head"], row["strategy"]


def _done_pairs(rows: Sequence[dict[str, Any]]) -> dict[tuple[str, Any], set[tuple[str, str]]]:
    """Return the (head, strategy) pairs ``rows`` hold, by (question, k)."""
    done: dict[tuple[str, Any], set[tuple[str, str]]] = {}
    for row in rows:
        done.setdefault((row["qid"], row.get("k")), set()).add((row["head"], row["strategy"]))
    return done


def _rounded_copies(
    engines: dict[str, BlendEngine], strategies: Sequence[Strategy]
) -> dict[str, RoundedPrefill] | None:
    """Return a bfloat16 copy of each head's engine if a strategy is a rounded reference."""
    if not any(s.rounding for s in strategies):
        return None
    return {head: RoundedPrefill(e) for head, e in engines.items()}


@dataclass
class _DecidedRun:
    """A `run_decided` run under way: what it runs, its result and rows, and what is done."""

    engines: dict[str, BlendEngine]
    strategies: Sequence[Strategy]
    options: RunOptions
    cache: BaselineCache | None
    output: Path | None
    seed: int
    shard: tuple[int, int]
    log: Callable[[str], None] | None
    result: dict[str, Any]
    rows: list[dict[str, Any]]  # the rows it writes: those resumed, then those it runs
    done: dict[tuple[str, Any], set[tuple[str, str]]]  # (head, strategy) by (question, k)
    rounded: dict[str, RoundedPrefill] | None  # the rounded references' bfloat16 copies

    def run_k(
        self, k: int, items: Sequence[PromptItem], stop: Callable[[], bool] | None = None
    ) -> None:
        """Run the questions ``items`` at ``k`` that this shard takes and that are not done.

        ``stop`` is asked after each question run; True ends the loop there.
        """
        self.result["recall"][str(k)] = sum(i.meta["gold_retrieved"] for i in items) / len(items)
        wanted = {(head, s.name) for head in self.engines for s in self.strategies}
        index, count = self.shard
        every = self.options.time_every
        started, ran = time.perf_counter(), 0
        for number, item in enumerate(items, start=1):
            have = self.done.get((item.qid, k), set())
            if wanted <= have or (number - 1) % count != index:
                continue
            retime = every > 0 and (number - 1) % every == 0
            self.rows += evaluate_question(
                self.engines,
                item,
                self.strategies,
                cache=self.cache,
                options=self.options,
                retime=retime,
                done=have,
                rounded=self.rounded,
            )
            ran += 1
            self.checkpoint()
            stopping = stop is not None and stop()
            if self.log is not None and (ran % 5 == 0 or number == len(items) or stopping):
                self.log(progress_message(self.rows, k, number, len(items), started, ran))
            if stopping:
                return

    def checkpoint(self) -> None:
        """Write the result with every row so far, its summaries and the baselines' hits."""
        self.result["rows"] = self.rows
        self.result.update(summaries(self.rows, self.seed))
        if self.cache is not None:
            self.result["baseline_hits"] = self.cache.hits
            self.result["baseline_misses"] = self.cache.misses
        write_json(self.result, self.output)


__all__ = [
    "CALIBRATION",
    "EVAL",
    "RunOptions",
    "agree",
    "decided_table",
    "evaluate_question",
    "run_decided",
    "split_questions",
    "stopped_note",
    "summarize",
]
