"""Document-context benchmark: blend quality when documents are precomputed behind other contexts.

``kvblend bench doc-context`` answers the QA task's questions with full prefill and with a set
of blend settings (``--configs``), once per document context (``--contexts``):

- ``bos``: documents start the sequence (what CacheBlend and LMCache do);
- ``prefix``: documents are precomputed behind the exact prompt head that
  ``BlendEngine.rag_segments`` builds (the engine's ``doc_prefix="auto"`` default);
- ``sys``: behind the chat template head only, without ``Documents:``.

Unlike ``kvblend bench quality``, whose named strategies each run on one engine, this compares
the same settings across engines that differ only in ``doc_prefix`` (they share the model), and
it also holds settings the named strategies do not cover (check layers 2 and 3, a gradual
``ratio_schedule``). Every setting names its strategy: a ``cb`` setting is CacheBlend's
deviation selection as published (no stale-KV correction, like the ``cacheblend-*`` names of
`kvblend.bench.strategies`). Rows are written as the run goes: one per question and setting.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvblend.bench.quality.qa import QAItem, generate_qa, score
from kvblend.bench.quality.qa_bench import STOP, kl_divergence, prompt_segments
from kvblend.blend.config import BlendConfig
from kvblend.engine.engine import BlendEngine
from kvblend.store import MemoryKVStore

#: The settings ``--configs`` chooses from, by name. ``cb<ratio>[L<check layer>]`` is CacheBlend
#: value deviation at that ratio and check layer (1 when not named), ``cbk``: key deviation,
#: ``cbg30to15``: gradual filtering, 30% at layer 1 down to 15% at layer 3.
CONFIGS: dict[str, BlendConfig] = {
    "reuse": BlendConfig("reuse"),
    "cb15": BlendConfig("cacheblend", recompute_ratio=0.15, correction=0.0),
    "cb15L2": BlendConfig("cacheblend", recompute_ratio=0.15, check_layer=2, correction=0.0),
    "cb15L3": BlendConfig("cacheblend", recompute_ratio=0.15, check_layer=3, correction=0.0),
    "cb20": BlendConfig("cacheblend", recompute_ratio=0.2, correction=0.0),
    "cb20L2": BlendConfig("cacheblend", recompute_ratio=0.2, check_layer=2, correction=0.0),
    "cbg30to15": BlendConfig("cacheblend", ratio_schedule=((1, 0.3), (3, 0.15)), correction=0.0),
    "cb30": BlendConfig("cacheblend", recompute_ratio=0.3, correction=0.0),
    "cbk15": BlendConfig("cacheblend", recompute_ratio=0.15, deviation="key", correction=0.0),
    "att15": BlendConfig("attention", recompute_ratio=0.15),
    "att20": BlendConfig("attention", recompute_ratio=0.2),
    "att30": BlendConfig("attention", recompute_ratio=0.3),
    "epic4": BlendConfig("epic", epic_tokens=4),
    "epic8": BlendConfig("epic", epic_tokens=8),
    "epic16": BlendConfig("epic", epic_tokens=16),
}

CONTEXTS = ("bos", "prefix", "sys")


def context_engines(base: BlendEngine, contexts: Sequence[str], head: str) -> dict[str, Any]:
    """One engine per context over ``base``'s model, each with its own memory store.

    ``head`` is the prompt's first segment (chat template + system prompt + ``Documents:``).
    """
    doc_prefixes = {"bos": None, "prefix": head, "sys": head.split("Documents:")[0]}
    unknown = [c for c in contexts if c not in doc_prefixes]
    if unknown:
        raise ValueError(f"unknown context {unknown}; choose from {', '.join(CONTEXTS)}")
    return {
        name: BlendEngine(
            base.model,
            base.tokenizer,
            store=MemoryKVStore(),
            doc_prefix=doc_prefixes[name],
            name=base.name,
        )
        for name in contexts
    }


def summarize(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Accuracy, agreement with full, mean KL and recomputed share per (context, setting).

    Groups come in first-seen order. Agreement is each row's ``agrees``, or, in rows written
    before that field was kept, its ``answer`` equal to the full-prefill row's of the same
    question; ``None`` where neither is recorded.
    """
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["context"], row["config"]), []).append(row)
    full = {r["qid"]: r["answer"] for r in rows if r["config"] == "full" and "answer" in r}
    return [
        {
            "context": context,
            "config": name,
            "questions": len(group),
            "accuracy": sum(r["correct"] for r in group) / len(group),
            "agreement": _agreement(group, full),
            "kl": statistics.fmean(r["kl"] for r in group),
            "recompute_fraction": statistics.fmean(r["recompute_fraction"] for r in group),
        }
        for (context, name), group in groups.items()
    ]


def _agreement(group: Sequence[dict[str, Any]], full: dict[str, str]) -> float | None:
    marks = [
        row["agrees"]
        if "agrees" in row
        else row["answer"] == full[row["qid"]]
        if "answer" in row and row["qid"] in full
        else None
        for row in group
    ]
    if any(mark is None for mark in marks):
        return None
    return sum(bool(mark) for mark in marks) / len(marks)


def doc_context_table(summary: Sequence[dict[str, Any]]) -> str:
    """Return the summary as a markdown table."""
    lines = [
        "| context | setting | questions | accuracy | agreement with full | mean KL | recomputed |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        agreement = "-" if s.get("agreement") is None else f"{s['agreement']:.1%}"
        lines.append(
            f"| {s['context']} | {s['config']} | {s['questions']} | {s['accuracy']:.1%} | "
            f"{agreement} | {s['kl']:.3f} | {s['recompute_fraction']:.0%} |"
        )
    return "\n".join(lines)


def doc_context_items(questions: int, seed: int = 0) -> list[QAItem]:
    """Return the first ``questions`` items of the QA task (the same for any count to 240)."""
    return generate_qa(max(240, questions), seed=seed)[:questions]


def run_doc_context(
    base: BlendEngine,
    items: Sequence[QAItem],
    contexts: Sequence[str],
    configs: Sequence[str],
    output: Path,
    *,
    max_new_tokens: int = 12,
) -> dict[str, Any]:
    """Answer ``items`` with full prefill and every setting in every context.

    Writes ``output`` (JSON: questions done, settings, rows) every 20 questions and at the end.
    """
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise ValueError(f"unknown config {unknown}; choose from {', '.join(CONFIGS)}")
    engines = context_engines(base, contexts, prompt_segments(base, items[0])[0].text)
    settings = {name: repr(CONFIGS[name]) for name in configs}
    rows: list[dict[str, Any]] = []
    result: dict[str, Any] = {}
    started = time.perf_counter()
    for index, item in enumerate(items):
        rows += _answer(base, engines, configs, item, max_new_tokens)
        if (index + 1) % 20 == 0 or index + 1 == len(items):
            elapsed = time.perf_counter() - started
            print(f"[{index + 1}/{len(items)} in {elapsed:.0f} s]", file=sys.stderr)
            print(doc_context_table(summarize(rows)), file=sys.stderr)
            result = {"questions": index + 1, "settings": settings, "rows": rows}
            output.parent.mkdir(parents=True, exist_ok=True)
            output.write_text(json.dumps(result))
    result["summary"] = summarize(rows)
    return result


def _answer(
    base: BlendEngine,
    engines: dict[str, BlendEngine],
    configs: Sequence[str],
    item: QAItem,
    max_new_tokens: int,
) -> list[dict[str, Any]]:
    """Return ``item``'s rows: full prefill's, then each setting's in each context."""
    segments = prompt_segments(base, item)
    full = base.prefill(segments, BlendConfig("full"))
    full_answer = base.generate(full, max_new_tokens=max_new_tokens, stop=list(STOP))
    rows: list[dict[str, Any]] = [
        {
            "qid": item.qid,
            "context": "-",
            "config": "full",
            "correct": score(full_answer.text.strip(), item.answers, item.wrong),
            "agrees": True,
            "kl": 0.0,
            "recompute_fraction": 0.0,
            "answer": full_answer.text.strip(),
        }
    ]
    for context, engine in engines.items():
        for name in configs:
            pre = engine.prefill(segments, CONFIGS[name])
            answer = engine.generate(pre, max_new_tokens=max_new_tokens, stop=list(STOP))
            rows.append(
                {
                    "qid": item.qid,
                    "context": context,
                    "config": name,
                    "correct": score(answer.text.strip(), item.answers, item.wrong),
                    "agrees": answer.text.strip() == full_answer.text.strip(),
                    "kl": kl_divergence(full.logits, pre.logits),
                    "recompute_fraction": pre.stats.recompute_fraction,
                    "answer": answer.text.strip(),
                }
            )
    return rows
