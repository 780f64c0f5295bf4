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
RESUME_KEYS = ("model", "dtype", "data_sha256", "split", "seed", "gold_at", "max_new_tokens",
               "kl_only", "default_config", "labels")  # fmt: skip
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
    out = engine.generate(pre, max_new_tokens=options.max_new_tokens, stop=list(STOP),
                          margins=options.margins)  # fmt: skip
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
    decoding: dict[str, Any] = {"max_new_tokens": options.max_new_tokens, "stop": list(STOP),
                                "margins": options.margins}  # fmt: skip
    out = engine.generate(pre, **decoding) if strat.rounding == "prefill" else rounded.decode(
        bf16, **decoding)  # fmt: skip
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
    decoding = {"max_new_tokens": options.max_new_tokens, "stop": list(STOP), "greedy": True,
                "kl_only": options.kl_only, "threads": torch.get_num_threads()}  # fmt: skip
    dtype = str(engine.decoder.dtype)
    key = BaselineCache.key(engine.fingerprint, dtype, token_ids, decoding)
    cached = cache.get(key) if cache is not None else None
    if cached is None and cache is not None and options.kl_only:  # a baseline with its answer
        answered = BaselineCache.key(engine.fingerprint, dtype, token_ids,
                                     {**decoding, "kl_only": False})  # fmt: skip
        cached = cache.get(answered)
    steps = 0 if options.kl_only else options.margins
    if cached is not None and not retime and cached.margin_steps >= steps:
        return cached, None, None
    pre, answer, timed, margins = _timed(engine, item, full, options)
    assert timed is not None  # full prefill is timed (only rounded references are not)
    ttft = timed
    if pre.token_ids != token_ids:
        raise RuntimeError("full prefill read other token ids than the prompt's plan")
    fresh = Baseline(answer or "", pre.logits.float().cpu(), len(token_ids), ttft, margins, steps)
    if cached is None:
        if cache is not None:
            cache.put(key, fresh)
        return fresh, ttft, None
    same = cached.answer == fresh.answer
    if same and cached.margin_steps < steps:  # the entry gains the margins it lacked
        cached = replace(cached, margins=margins, margin_steps=steps)
        if cache is not None:
            cache.put(key, cached)
    return cached, ttft, same


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
    base_line, full_ttft, confirmed = baseline_for(first, item, strategies[0], cache, options,
                                                  retime)  # fmt: skip
    full_answer = None if options.kl_only else base_line.answer
    base = {"qid": item.qid, **item.meta, "prompt_tokens": base_line.prompt_tokens,
            "full_ttft_s": full_ttft}  # fmt: skip
    rows: list[dict[str, Any]] = []
    for head, engine in engines.items():
        if (head, "full") not in done:
            rows.append(
                {**base, "head": head, "strategy": "full", "answer": full_answer,
                 "correct": None if full_answer is None else item.score(full_answer),
                 "agrees": None if full_answer is None else True, "top1_agrees": True,
                 "kl": 0.0, "compute_fraction": 1.0, "recompute_fraction": 0.0,
                 "documents_reused": 0, "recomputed_tokens": 0, "fallback": None,
                 "ttft_s": full_ttft, "baseline_confirmed": confirmed, "escalated": False,
                 "margins": None if options.kl_only else base_line.margins}
            )  # fmt: skip
        for strat in strategies[1:]:
            if (head, strat.name) in done:
                continue

            def row(
                strat: Strategy, name: str, engine: BlendEngine = engine, head: str = head
            ) -> dict[str, Any]:
                with strat.loop():
                    copy = None if rounded is None else rounded.get(head)
                    pre, answer, ttft, margins = _timed(engine, item, strat, options, copy)
                if len(pre.token_ids) != base_line.prompt_tokens:
                    raise RuntimeError(f"{name} prefilled another prompt than full prefill")
                stats = pre.stats
                return {
                    **base, "head": head, "strategy": name, "answer": answer,
                    "correct": None if answer is None else item.score(answer),
                    "agrees": agree(answer, full_answer),
                    "top1_agrees": int(pre.logits.argmax()) == int(base_line.logits.argmax()),
                    "kl": kl_divergence(base_line.logits, pre.logits),
                    "compute_fraction": stats.compute_fraction,
                    "recompute_fraction": stats.recompute_fraction,
                    "documents_reused": stats.documents_reused,
                    "recomputed_tokens": stats.recomputed_tokens, "fallback": stats.fallback,
                    "prefix_tokens": stats.prefix_tokens,
                    "ttft_s": ttft if full_ttft is not None and ttft is not None else None,
                    **guard_fields(stats), "margins": margins,
                }  # fmt: skip

            twin = (
                None
                if strat.config.reads_cache
                else next(
                    (r for r in rows if r["strategy"] == strat.name and r["head"] != head), None
                )
            )
            if twin is not None:  # it reads no document: the same prefill as another head's
                rows.append({**twin, "head": head})
                continue
            guarded = row(strat, strat.name)
            rows.append(guarded)
            if options.unguarded and guarded.get("guard") is not None:
                rows.append(unguarded_row(guarded, strat, row))
    return rows


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
    return {**again, "ttft_s": None, "guard": guarded["guard"], "escalated": False,
            "guard_would_escalate": True}  # fmt: skip


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
    for key, group in groups.items():
        answered = all(row.get("correct") is not None for row in group)
        paired = strategy_stats(group, seed=seed) if answered else {}
        full_by_qid = {r["qid"]: r for r in group if r["strategy"] == "full"}
        full_answers = {qid: row["answer"] for qid, row in full_by_qid.items()
                        if row.get("answer") is not None}  # fmt: skip
        floor = [r for r in group if r["strategy"] == FLOOR and r["qid"] in full_by_qid]
        for name in dict.fromkeys(r["strategy"] for r in group):
            mine = [r for r in group if r["strategy"] == name and r["qid"] in full_by_qid]
            if not mine:
                continue
            entry: dict[str, Any] = dict(paired.get(name, {}))
            kls = [r["kl"] for r in mine]
            entry.setdefault("n", len(mine))
            entry.setdefault("kl_mean", statistics.fmean(kls))
            entry.setdefault("kl_ci", _bootstrap_mean(kls, seed))
            entry["kl_median"] = statistics.median(kls)
            if answered:
                entry["agreement_ci"] = _bootstrap_mean([float(r["agrees"]) for r in mine], seed)
            entry["top1_agreement"] = statistics.fmean(float(r["top1_agrees"]) for r in mine)
            entry.update(closeness(mine, full_answers, seed=seed))
            if floor and name != "full":
                entry.update(floor_ratios(mine, floor, full_answers, seed=seed))
            # each row's TTFT against full prefill's timed right before it, on the same prompt
            timed = [r for r in mine if r.get("ttft_s") is not None
                     and r.get("full_ttft_s") is not None]  # fmt: skip
            full_time = sum(r["full_ttft_s"] for r in timed)
            entry["ttft_ratio"] = sum(r["ttft_s"] for r in timed) / full_time if timed else None
            entry["ttft_n"] = len(timed)
            escalated = [bool(r.get("escalated")) for r in mine]
            out.append(
                {
                    **dict(zip(group_by, key, strict=True)),
                    "strategy": name,
                    **entry,
                    "compute_fraction": statistics.fmean(r["compute_fraction"] for r in mine),
                    "recompute_fraction": statistics.fmean(r["recompute_fraction"] for r in mine),
                    "escalation_rate": statistics.fmean(escalated),
                    "prompt_tokens_mean": statistics.fmean(r["prompt_tokens"] for r in mine),
                }
            )
    return out


def _ci(value: float, interval: Sequence[float], percent: bool) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if percent:
        return f"{value:.0%} [{interval[0] * 100:.0f}, {interval[1] * 100:.0f}]"
    return f"{value:.3f} [{interval[0]:.3f}, {interval[1]:.3f}]"


def decided_table(summary: Sequence[dict[str, Any]], keys: Sequence[str] = ("k", "place")) -> str:
    """Markdown table of `summarize` output, one row per group and strategy."""
    columns = ("n | accuracy | % of full [95% CI] | difference, points [95% CI] | agreement with "
               "full [95% CI] | first token | mean KL [95% CI] | escalated | compute (of full) "
               "| TTFT (of full, n)")  # fmt: skip
    lines = [f"| {' | '.join(keys)} | strategy | {columns} |",
             "|" + "---|" * (len(keys) + 11)]  # fmt: skip
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
    clash = {key: (previous.get(key, RESUME_DEFAULTS.get(key)), settings[key])
             for key in RESUME_KEYS
             if previous.get(key, RESUME_DEFAULTS.get(key)) != settings[key]}  # fmt: skip
    rows = list(previous.get("rows", []))
    if set(clash) == {"default_config"}:  # rows of another BlendConfig(): "default" meant it
        return [row for row in rows if not row["strategy"].startswith("default")]
    if clash:
        detail = "; ".join(f"{key}: {was!r} there, {now!r} now"
                           for key, (was, now) in clash.items())  # fmt: skip
        raise ValueError(f"{output} holds rows of another run ({detail}); give another --output "
                         "or --fresh to start over")  # fmt: skip
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
    return (f"[k={k} {done}/{total}, {per:.1f} s/question, {left / 3600:.1f} h left] "
            + "; ".join(parts))  # fmt: skip


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
) -> dict[str, Any]:
    """Every strategy on ``questions`` questions of ``split`` at each k; resumable, JSON as it goes.

    An existing ``output`` of the same settings is continued: the (question, k, head, strategy)
    rows it holds are kept and not run again; when only ``BlendConfig()`` changed since, its
    ``default`` rows (which measured the other default) are dropped and run again. ``shard``
    ``(k, n)`` with ``n > 1``: only every ``n``-th question from the ``k``-th, its rows written
    to `shard_path` (``n`` processes, one per core, each with its own file; rows ``output``
    holds already are not run again); a run without a shard takes the rows of every shard file
    beside ``output`` as done, runs what is left and writes the whole result to ``output``.
    """
    index, count = shard
    if not 0 <= index < count:
        raise ValueError(f"shard {index}/{count}: needs 0 <= {index} < {count}")
    corpus, all_questions = load_nq(data)
    start, stop = split_questions(split, offset, questions, len(all_questions))
    chosen = all_questions[start:stop]
    engine = next(iter(engines.values()))
    settings = {
        "model": str(engine.name), "dtype": str(engine.decoder.dtype).replace("torch.", ""),
        "data_sha256": file_digest(data), "split": split, "seed": seed, "gold_at": gold_at,
        "max_new_tokens": options.max_new_tokens, "kl_only": options.kl_only,
        "default_config": (meta or {}).get("default_config"), "labels": labels,
    }  # fmt: skip
    earlier: list[dict[str, Any]] = []  # a shard's: the whole run's rows, done already
    if count > 1 and output is not None:
        earlier = _load_previous(output, settings)
        output = shard_path(output, shard)
    rows = _load_previous(output, settings)
    if count == 1:  # the shards' rows, taken once (a question in both is run by neither again)
        seen = {(row["qid"], row.get("k"), row["head"], row["strategy"]) for row in rows}
        for row in _shard_rows(output, settings):
            if (key := (row["qid"], row.get("k"), row["head"], row["strategy"])) not in seen:
                seen.add(key)
                rows.append(row)
    retriever = Retriever(corpus, data_path=data, cache_dir=cache_dir)
    result: dict[str, Any] = {
        "benchmark": "nq", **(meta or {}), **settings, "data": str(data),
        "corpus_passages": len(corpus), "embeddings_cache": str(retriever.cache_path),
        "questions": len(chosen), "offset": offset, "file_range": [start, stop], "ks": list(ks),
        "shard": list(shard),
        "heads": {head: e.doc_prefix for head, e in engines.items()},
        "strategies": [s.name for s in strategies], "time_every": options.time_every,
        "baselines": str(cache.directory) if cache is not None else None, "recall": {},
    }  # fmt: skip
    done: dict[tuple[str, Any], set[tuple[str, str]]] = {}
    for row in [*earlier, *rows]:
        done.setdefault((row["qid"], row.get("k")), set()).add((row["head"], row["strategy"]))
    wanted = {(head, s.name) for head in engines for s in strategies}
    items = nq_prompt_items(engine, corpus, chosen, retriever, ks=ks, seed=seed, gold_at=gold_at,
                            labels=labels)  # fmt: skip
    rounded = None
    if any(s.rounding for s in strategies):  # a bfloat16 copy of each head's engine
        rounded = {head: RoundedPrefill(e) for head, e in engines.items()}
        result["rounding"] = next(iter(rounded.values())).rounding

    def checkpoint() -> None:
        result["rows"] = rows
        result.update(summaries(rows, seed))
        if cache is not None:
            result["baseline_hits"], result["baseline_misses"] = cache.hits, cache.misses
        write_json(result, output)

    for k in ks:
        mine = [item for item in items if item.meta["k"] == k]
        result["recall"][str(k)] = sum(i.meta["gold_retrieved"] for i in mine) / len(mine)
        started, ran = time.perf_counter(), 0
        for number, item in enumerate(mine, start=1):
            have = done.get((item.qid, k), set())
            if wanted <= have or (number - 1) % count != index:
                continue
            retime = options.time_every > 0 and (number - 1) % options.time_every == 0
            rows += evaluate_question(engines, item, strategies, cache=cache, options=options,
                                      retime=retime, done=have, rounded=rounded)  # fmt: skip
            ran += 1
            checkpoint()
            if log is not None and (ran % 5 == 0 or number == len(mine)):
                log(progress_message(rows, k, number, len(mine), started, ran))
    checkpoint()
    return result


__all__ = [
    "CALIBRATION",
    "EVAL",
    "RunOptions",
    "agree",
    "decided_table",
    "evaluate_question",
    "run_decided",
    "split_questions",
    "summarize",
]
