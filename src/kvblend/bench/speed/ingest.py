"""Ingestion benchmark: documents/s of `BlendEngine.precompute`, one by one vs batched.

The baseline computes each document alone through the blend loop (`SegmentKV.compute`, what
``precompute`` did before batching), then registers it. The batched runs call
``engine.precompute(texts, force=True, batch_tokens=B)`` for each token budget ``B``. Runs
are interleaved (each repeat times every setting once), so a slower shared machine slows all
of them alike; the speedup of a setting is the median of its per-repeat ratios to the baseline.
The process's CPU time per document is reported too: on a CPU shared with other work it moves
far less than wall-clock time.
Every run writes into a fresh memory store.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvblend.bench.speed.synthetic import synthetic_text
from kvblend.engine.engine import BlendEngine
from kvblend.store import MemoryKVStore

DEFAULT_BATCH_TOKENS = (2048, 4096, 8192)


def _synchronize(engine: BlendEngine) -> None:
    if engine.decoder.device.type == "cuda":
        torch.cuda.synchronize(engine.decoder.device)


def _fresh(engine: BlendEngine) -> BlendEngine:
    return BlendEngine(
        engine.model,
        engine.tokenizer,
        store=MemoryKVStore(8 << 30),
        name=engine.name,
        doc_prefix=engine.doc_prefix,
        system_prompt=engine.system_prompt,
        check_parity=False,
    )


def one_by_one(engine: BlendEngine, texts: Sequence[str]) -> None:
    """Compute and store each text alone through the blend loop, as precompute used to."""
    segment_kv = engine.library.segment_kv
    for text in texts:
        layout = segment_kv.layout(text)
        key = segment_kv.key(text)
        segment_kv.compute(key, layout.context_ids, layout.ids)
        engine.library.registry.add([text])


def run_ingest(
    engine: BlendEngine,
    *,
    documents: int = 16,
    doc_tokens: int = 512,
    batch_tokens: Sequence[int] = DEFAULT_BATCH_TOKENS,
    repeats: int = 3,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Time one-by-one and batched precompute of ``documents`` texts of ``doc_tokens`` tokens."""
    log = log or (lambda message: print(message, file=sys.stderr))
    texts = [
        synthetic_text(engine.tokenizer, doc_tokens, seed * 1000 + index)
        for index in range(documents)
    ]
    settings = _settings(texts, batch_tokens)
    for _, run in settings:  # warm-up: tokenizer caches, allocator, kernels
        run(_fresh(engine))
    rows: list[dict[str, Any]] = []
    for repeat in range(repeats):
        for name, run in settings:
            seconds, cpu_s = _timed(engine, texts, run)
            rows.append(
                {
                    "repeat": repeat,
                    "setting": name,
                    "seconds": seconds,
                    "docs": documents,
                    "docs_per_s": documents / seconds,
                    "cpu_s": cpu_s,
                }
            )
        latest = rows[-len(settings) :]
        log(
            f"repeat {repeat + 1}/{repeats}: "
            + ", ".join(f"{r['setting']} {r['docs_per_s']:.2f} doc/s" for r in latest)
        )
    return {
        "benchmark": "ingest",
        "documents": documents,
        "doc_tokens": doc_tokens,
        "context_tokens": len(engine.library.segment_kv.layout(texts[0]).context_ids),
        "repeats": repeats,
        "rows": rows,
        "summary": summarize_ingest(rows),
    }


def _settings(
    texts: list[str], batch_tokens: Sequence[int]
) -> list[tuple[str, Callable[[BlendEngine], None]]]:
    """Return each timed setting by name: one by one, then batched at each token budget."""

    def batched(budget: int) -> Callable[[BlendEngine], None]:
        def run(target: BlendEngine) -> None:
            target.precompute(texts, progress=False, force=True, batch_tokens=budget)

        return run

    settings: list[tuple[str, Callable[[BlendEngine], None]]] = [
        ("one-by-one", lambda target: one_by_one(target, texts))
    ]
    return settings + [(f"batched-{budget}", batched(budget)) for budget in batch_tokens]


def _timed(
    engine: BlendEngine, texts: list[str], run: Callable[[BlendEngine], None]
) -> tuple[float, float]:
    """Return the wall and CPU seconds of ``run`` on a fresh engine, its texts tokenized before."""
    target = _fresh(engine)
    for text in texts:
        target.library.segment_kv.layout(text)  # tokenizing is not what is compared
    _synchronize(engine)
    started, cpu_started = time.perf_counter(), time.process_time()
    run(target)
    _synchronize(engine)
    seconds = time.perf_counter() - started
    return seconds, time.process_time() - cpu_started


def summarize_ingest(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median documents/s per setting and the median per-repeat speedup over one-by-one."""
    baseline = {r["repeat"]: r["seconds"] for r in rows if r["setting"] == "one-by-one"}
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(r["setting"], []).append(r)
    return [
        {
            "setting": name,
            "runs": len(group),
            "docs_per_s_median": statistics.median(r["docs_per_s"] for r in group),
            "speedup_vs_one_by_one": statistics.median(
                baseline[r["repeat"]] / r["seconds"] for r in group
            ),
            "cpu_s_per_doc_median": statistics.median(r["cpu_s"] for r in group) / group[0]["docs"],
        }
        for name, group in groups.items()
    ]


def ingest_table(result: dict[str, Any]) -> str:
    """Markdown table of an ingestion result."""
    lines = [
        f"{result['documents']} documents x {result['doc_tokens']} tokens "
        f"(+{result['context_tokens']} context tokens each), {result['repeats']} interleaved "
        "repeats, medians:",
        "",
        "| setting | documents/s | speedup vs one-by-one | CPU time per document |",
        "|---|---|---|---|",
    ]
    for s in result["summary"]:
        lines.append(
            f"| {s['setting']} | {s['docs_per_s_median']:.2f} | "
            f"{s['speedup_vs_one_by_one']:.2f}x | {s['cpu_s_per_doc_median']:.2f} s |"
        )
    return "\n".join(lines)
