"""Quality benchmark: accuracy and fidelity to full prefill of every strategy on the QA task.

For each question the prompt is built once (`BlendEngine.rag_segments`); full prefill runs first
and is the baseline. Every other strategy prefills the same token ids, and we record: whether its
greedy answer is correct, whether it equals the full-prefill answer, the KL divergence
KL(full || strategy) of the next-token distribution at the answer position, and how much it
recomputed. Documents are precomputed once, before any timing.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from kvblend.bench.quality.qa import QUESTION_TYPES, SYSTEM_PROMPT, QAItem, score
from kvblend.bench.strategies import Strategy
from kvblend.engine.engine import BlendEngine
from kvblend.prompt.segments import Segment

STOP = ("\n",)


def kl_divergence(reference_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """KL(reference || other) in nats between two next-token distributions given as logits."""
    reference = torch.log_softmax(reference_logits.double(), dim=-1)
    other = torch.log_softmax(logits.double(), dim=-1)
    return float((reference.exp() * (reference - other)).sum().clamp_min(0.0))


def prompt_segments(
    engine: BlendEngine, item: QAItem, system: str = SYSTEM_PROMPT
) -> list[Segment]:
    """Build the chat RAG prompt of ``item``, with the assistant's answer started by its prefix."""
    segments = engine.rag_segments(item.question, item.documents, system=system)
    if item.answer_prefix:
        last = segments[-1]
        segments[-1] = Segment(last.text + item.answer_prefix, cache=False)
    return segments


def evaluate_question(
    engine: BlendEngine,
    item: QAItem,
    strategies: Sequence[Strategy],
    *,
    max_new_tokens: int = 12,
    system: str = SYSTEM_PROMPT,
) -> list[dict[str, Any]]:
    """One row per strategy for ``item``; the first strategy must be ``full``."""
    if strategies[0].name != "full":
        raise ValueError("the first strategy must be 'full', the baseline")
    segments = prompt_segments(engine, item, system)
    rows: list[dict[str, Any]] = []
    baseline = None
    for strat in strategies:
        started = time.perf_counter()
        pre = engine.prefill(strat.segments(segments), strat.config)
        out = engine.generate(pre, max_new_tokens=max_new_tokens, stop=list(STOP))
        ttft = out.ttft_s + (out.stats.timings.get("prefill_s", 0.0))
        answer = out.text.strip()
        if baseline is None:
            baseline = (pre, answer)
        full_pre, full_answer = baseline
        if pre.token_ids != full_pre.token_ids:
            raise RuntimeError(f"{strat.name} prefilled other token ids than full prefill")
        stats = pre.stats
        rows.append(
            {
                "qid": item.qid,
                "qtype": item.qtype,
                "strategy": strat.name,
                "answer": answer,
                "correct": score(answer, item.answers, item.wrong),
                "agrees": answer == full_answer,
                "top1_agrees": int(pre.logits.argmax()) == int(full_pre.logits.argmax()),
                "kl": kl_divergence(full_pre.logits, pre.logits),
                "recompute_fraction": stats.recompute_fraction,
                "compute_fraction": stats.compute_fraction,
                "prompt_tokens": stats.prompt_tokens,
                "ttft_s": ttft,
                "seconds": time.perf_counter() - started,
            }
        )
    return rows


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per-strategy accuracy, agreement, KL and recompute, overall and by question type."""
    by_strategy: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_strategy.setdefault(row["strategy"], []).append(row)
    full_acc = None
    summary: dict[str, dict[str, Any]] = {}
    for name, group in by_strategy.items():
        summary[name] = entry = _strategy_summary(group)
        if name == "full":
            full_acc = entry["accuracy"]
    for entry in summary.values():
        entry["relative_accuracy"] = entry["accuracy"] / full_acc if full_acc else math.nan
    return summary


def _strategy_summary(group: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Return one strategy's accuracy, agreement, KL and recompute, overall and by type."""
    n = len(group)
    kls = [r["kl"] for r in group]
    entry: dict[str, Any] = {
        "questions": n,
        "accuracy": sum(r["correct"] for r in group) / n,
        "agreement": sum(r["agrees"] for r in group) / n,
        "top1_agreement": sum(r["top1_agrees"] for r in group) / n,
        "kl_mean": statistics.fmean(kls),
        "kl_median": statistics.median(kls),
        "recompute_fraction": statistics.fmean(r["recompute_fraction"] for r in group),
        "compute_fraction": statistics.fmean(r["compute_fraction"] for r in group),
        "prompt_tokens_mean": statistics.fmean(r["prompt_tokens"] for r in group),
        "by_type": {},
    }
    for qtype in QUESTION_TYPES:
        typed = [r for r in group if r["qtype"] == qtype]
        if typed:
            entry["by_type"][qtype] = {
                "questions": len(typed),
                "accuracy": sum(r["correct"] for r in typed) / len(typed),
                "agreement": sum(r["agrees"] for r in typed) / len(typed),
            }
    return entry


def run_quality(
    engine: BlendEngine,
    items: Sequence[QAItem],
    strategies: Sequence[Strategy],
    *,
    max_new_tokens: int = 12,
    output: Path | None = None,
    log: Callable[[str], None] | None = None,
    meta: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Evaluate every question under every strategy; write JSON to ``output`` as it goes."""
    log = log or (lambda message: print(message, file=sys.stderr))
    started = time.perf_counter()
    documents = list(dict.fromkeys(d for item in items for d in item.documents))
    engine.precompute(documents, progress=None)  # a bar on a terminal
    log(f"precomputed {len(documents)} documents in {time.perf_counter() - started:.1f} s")
    rows: list[dict[str, Any]] = []
    result: dict[str, Any] = {}
    for index, item in enumerate(items):
        rows += evaluate_question(engine, item, strategies, max_new_tokens=max_new_tokens)
        done = index + 1
        if done % 10 == 0 or done == len(items):
            summary = summarize(rows)
            line = ", ".join(f"{name} {s['accuracy']:.0%}" for name, s in summary.items())
            log(f"[{done}/{len(items)} in {time.perf_counter() - started:.0f} s] {line}")
            result = {
                "benchmark": "quality",
                **(meta or {}),
                "questions": done,
                "strategies": [s.name for s in strategies],
                "elapsed_s": time.perf_counter() - started,
                "summary": summary,
                "rows": rows,
            }
            if output is not None:
                output.parent.mkdir(parents=True, exist_ok=True)
                tmp = output.with_suffix(".json.tmp")
                tmp.write_text(json.dumps(result, indent=1))
                tmp.replace(output)
    return result


def quality_table(summary: dict[str, dict[str, Any]]) -> str:
    """Markdown table of a quality summary."""
    lines = [
        "| strategy | accuracy | vs full | agreement with full | top-1 agreement | mean KL | "
        "median KL | recomputed (of moved) | compute (of full) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in summary.items():
        lines.append(
            f"| {name} | {s['accuracy']:.1%} | {s['relative_accuracy']:.0%} | "
            f"{s['agreement']:.1%} | {s['top1_agreement']:.1%} | {s['kl_mean']:.3f} | "
            f"{s['kl_median']:.3f} | {s['recompute_fraction']:.1%} | {s['compute_fraction']:.1%} |"
        )
    return "\n".join(lines)


def type_table(summary: dict[str, dict[str, Any]], metric: str = "accuracy") -> str:
    """Markdown table of ``metric`` by question type (rows) and strategy (columns).

    ``metric``: ``accuracy``, or ``agreement`` (the answer equal to full prefill's); ``-`` where
    a summary lacks it.
    """
    names = list(summary)
    title = "type" if metric == "accuracy" else f"{metric} with full, by type"
    lines = [f"| {title} | n | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for qtype in QUESTION_TYPES:
        cells = [summary[n]["by_type"].get(qtype) for n in names]
        if cells[0] is None:
            continue
        row = " | ".join(f"{c[metric]:.0%}" if c and metric in c else "-" for c in cells)
        lines.append(f"| {qtype} | {cells[0]['questions']} | {row} |")
    return "\n".join(lines)


def quality_report(summary: dict[str, dict[str, Any]]) -> str:
    """Return the quality table, then accuracy and agreement with full prefill's by type."""
    return "\n\n".join(
        [quality_table(summary), type_table(summary), type_table(summary, "agreement")]
    )
