"""``kvblend bench vllm --nq``: the NQ benchmark's prompts through vLLM, paired with the engine.

The prompts are those `kvblend bench nq --write-prompts FILE` builds (`kvblend.bench.quality.nq`:
retrieved passages, labels computed, passages cached), read back with `nq.read_prompts`, so
the questions, passages and prompt strings are exactly the engine benchmark's. This process
precomputes every passage into a store folder with an engine left at its defaults (as
``kvblend bench nq --doc-prefix auto`` has it: documents behind the engine's own RAG head), then
asks each prompt string, greedy, cut at the first newline, of:

- vanilla vLLM and vLLM + `KVBlendConnector` (default `BlendConfig()`) over that store, both
  OpenAI-compatible servers (`vllm.serving`), prefix caching on;
- the engine itself, full prefill and the default, on the prompt's segments
  (`compare.evaluate_item`, the code of ``kvblend bench nq``).

Every answer is scored by the paper's best-subspan exact match (`nq.best_subspan_em`); every
pair of systems is compared on the same questions with a paired bootstrap over questions
(`stats.paired_stats`): the difference in accuracy with its 95% interval, and how often the two
greedy answers are equal. Run it with the Python of vLLM's environment.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvblend.bench.quality.compare import PromptItem, elapsed, evaluate_item, warm_up
from kvblend.bench.quality.qa_bench import STOP
from kvblend.bench.quality.stats import paired_stats

__all__ = ["PAIRS", "SYSTEMS", "ask", "run_vllm_nq", "summarize_nq", "vllm_nq_table"]

#: The systems compared, by key, in words.
SYSTEMS = {
    "vllm": "vanilla vLLM",
    "vllm_kvblend": "vLLM + kvblend",
    "engine_full": "engine, full prefill",
    "engine_default": "engine, default",
}
#: (system, baseline) pairs compared on the same questions.
PAIRS = (
    ("vllm", "engine_full"),
    ("vllm_kvblend", "engine_default"),
    ("vllm_kvblend", "vllm"),
    ("engine_default", "engine_full"),
    ("vllm_kvblend", "engine_full"),
)


def prompt_text(item: PromptItem) -> str:
    """Return the prompt string of ``item``: its segments' texts joined, as the engine reads."""
    return "".join(segment.text for segment in item.segments)


def ask(url: str, item: PromptItem, max_new_tokens: int) -> dict[str, Any]:
    """Ask a vLLM server ``item``'s prompt string, greedy, stopping as the engine's NQ bench does.

    Returns the answer (stripped, as the engine's), whether it is right, the prompt and cached
    token counts of the usage, and the connector's report (None from vanilla vLLM).
    """
    from kvblend.bench.vllm.server import complete

    extra = {"stop": list(STOP), "ignore_eos": False}
    response = complete(url, prompt_text(item), max_new_tokens, extra)
    answer = response["choices"][0]["text"].strip()
    usage = response.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    return {
        "answer": answer,
        "correct": bool(item.score(answer)),
        "prompt_tokens": usage.get("prompt_tokens"),
        "cached_tokens": int(details.get("cached_tokens") or 0),
        "kvblend": (response.get("kv_transfer_params") or {}).get("kvblend"),
    }


def _warmup(engine: Any) -> str:
    """Return a prompt of the benchmark's shape over a passage that no question has."""
    from kvblend.bench.quality.nq import Passage, nq_segments

    passage = Passage("Warm-up", "A short warm-up passage.")
    return "".join(s.text for s in nq_segments(engine.tokenizer, "warm up", [passage]))


def _engine_row(row: dict[str, Any]) -> dict[str, Any]:
    keys = (
        "answer",
        "correct",
        "prompt_tokens",
        "reused_tokens",
        "recomputed_tokens",
        "fallback",
        "fallback_cause",
        "kl",
    )
    return {key: row[key] for key in keys}


def run_vllm_nq(
    model: str | None,
    prompts: Path,
    *,
    questions: int = 0,
    max_new_tokens: int = 32,
    seed: int = 0,
    work_dir: Path | None = None,
    output: Path | None = None,
) -> dict[str, Any]:
    """Ask every prompt of ``prompts`` (the first ``questions``; 0: all) of the four systems."""
    from kvblend.bench.quality.nq import read_prompts, write_json
    from kvblend.bench.strategies import parse_strategies
    from kvblend.bench.vllm.speed import bench_engine, log_line, serving
    from kvblend.engine.engine import DEFAULT_SYSTEM_PROMPT

    items = read_prompts(prompts)
    items = items[:questions] if questions else items
    if not items:
        raise ValueError(f"{prompts} holds no prompts")
    folder, work, engine = bench_engine(model, work_dir, DEFAULT_SYSTEM_PROMPT)
    engine.precompute(sorted({text for item in items for text in item.documents}))
    engines, strategies = {"untold": engine}, parse_strategies("full,default")
    result: dict[str, Any] = {
        "benchmark": "vllm-nq",
        "model": str(folder),
        "prompts": str(prompts),
        "questions": len(items),
        "max_new_tokens": max_new_tokens,
        "seed": seed,
        "work_dir": str(work),
        "systems": SYSTEMS,
        "records": [],
    }
    started = time.perf_counter()
    with serving(folder, work, engine.context_window, _warmup(engine), {}) as servers:
        warm_up(engines, items[0])
        for done, item in enumerate(items, start=1):
            record: dict[str, Any] = {"qid": item.qid, **item.meta, "answers": item.answers}
            record["vllm"] = ask(servers["vanilla"].url, item, max_new_tokens)
            record["vllm_kvblend"] = ask(servers["kvblend"].url, item, max_new_tokens)
            rows = evaluate_item(engines, item, strategies, max_new_tokens=max_new_tokens)
            by_name = {row["strategy"]: row for row in rows}
            record["engine_full"] = _engine_row(by_name["full"])
            record["engine_default"] = _engine_row(by_name["default"])
            result["records"].append(record)
            if done % 10 == 0 or done == len(items):
                result["summary"] = summarize_nq(result["records"], seed=seed)
                write_json(result, output)
                accuracy = ", ".join(
                    f"{name} {s['accuracy']:.0%}"
                    for name, s in result["summary"]["systems"].items()
                )
                log_line(f"[{done}/{len(items)} in {elapsed(started)}] {accuracy}")
    return result


def _mean(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def summarize_nq(records: Sequence[dict[str, Any]], *, seed: int = 0) -> dict[str, Any]:
    """Accuracy and token counts of each system; paired differences of each pair in `PAIRS`."""
    systems = {}
    for name in SYSTEMS:
        rows = [record[name] for record in records]
        systems[name] = {
            "n": len(rows),
            "accuracy": statistics.fmean(bool(row["correct"]) for row in rows),
            "prompt_tokens": _mean([row.get("prompt_tokens") for row in rows]),
            "cached_tokens": _mean(
                [row.get("cached_tokens", row.get("reused_tokens")) for row in rows]
            ),
            "recomputed_tokens": _mean([_recomputed(row) for row in rows]),
        }
    pairs = []
    for name, baseline in PAIRS:
        ours = [bool(record[name]["correct"]) for record in records]
        theirs = [bool(record[baseline]["correct"]) for record in records]
        agrees = [record[name]["answer"] == record[baseline]["answer"] for record in records]
        stats = paired_stats(ours, theirs, agrees=agrees, seed=seed)
        pairs.append({"system": name, "baseline": baseline, **stats})
    return {"systems": systems, "pairs": pairs, "checks": _checks(records)}


def _recomputed(row: dict[str, Any]) -> float | None:
    if "recomputed_tokens" in row:
        return float(row["recomputed_tokens"])
    report = row.get("kvblend")
    return float(report["recomputed_tokens"]) if report else None


def _outcome(row: dict[str, Any]) -> str:
    """Return ``blended``, the fallback's code (the record's ``reason``), or ``no report``.

    vLLM drops the connector's report of a request a stop string ended: its frontend finds the
    stop string and aborts the request before the engine core finishes it.
    """
    report = row["kvblend"]
    if report is None:
        return "no report"
    return "blended" if report.get("fallback") is None else str(report["reason"])


def _checks(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Whether vLLM read the engine's tokens, and why blends fell back, in each engine."""
    same_tokens = [
        record["vllm_kvblend"]["prompt_tokens"] == record["engine_full"]["prompt_tokens"]
        for record in records
    ]
    connector = Counter(_outcome(record["vllm_kvblend"]) for record in records)
    engine = Counter(record["engine_default"]["fallback_cause"] or "blended" for record in records)
    return {
        "same_prompt_tokens": statistics.fmean(same_tokens),
        "connector_outcomes": dict(connector),
        "engine_outcomes": dict(engine),
    }


def vllm_nq_table(result: dict[str, Any]) -> str:
    """Markdown tables of a ``kvblend bench vllm --nq`` result."""
    summary = result["summary"]
    lines = [
        f"NQ-open prompts through vLLM, {Path(result['model']).name}, {result['questions']} "
        f"questions ({result['prompts']}), greedy, {result['max_new_tokens']} new tokens",
        "",
        "| system | accuracy | mean prompt tokens | mean cached tokens | mean recomputed |",
        "|---|---|---|---|---|",
    ]
    for name, s in summary["systems"].items():
        cached = "-" if s["cached_tokens"] is None else f"{s['cached_tokens']:.0f}"
        recomputed = "-" if s["recomputed_tokens"] is None else f"{s['recomputed_tokens']:.0f}"
        lines.append(
            f"| {SYSTEMS[name]} | {s['accuracy']:.1%} | {s['prompt_tokens']:.0f} | "
            f"{cached} | {recomputed} |"
        )
    lines += [
        "",
        "| system vs baseline (same questions) | n | accuracy | baseline | "
        "difference, points [95% CI] | same answer |",
        "|---|---|---|---|---|---|",
    ]
    for p in summary["pairs"]:
        low, high = p["difference_ci"]
        lines.append(
            f"| {SYSTEMS[p['system']]} vs {SYSTEMS[p['baseline']]} | {p['n']} | "
            f"{p['accuracy']:.1%} | {p['full_accuracy']:.1%} | {p['difference'] * 100:+.1f} "
            f"[{low * 100:+.1f}, {high * 100:+.1f}] | {p['agreement']:.0%} |"
        )
    checks = summary["checks"]
    lines += [
        "",
        f"vLLM's prompt tokens equal the engine's on {checks['same_prompt_tokens']:.0%} of the "
        f"prompts; connector outcomes {checks['connector_outcomes']}, engine default outcomes "
        f"{checks['engine_outcomes']}.",
    ]
    return "\n".join(lines)
