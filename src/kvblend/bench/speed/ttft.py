"""TTFT benchmark: time to first token of every strategy at several prompt lengths.

A prompt of about N tokens is a chat-formatted RAG prompt (`BlendEngine.rag_segments`) over
N // doc_tokens synthetic documents. Documents are precomputed before timing, into a memory store
on the model's device (``memory``), optionally into one in host memory (``host``: pinned when
CUDA is available), and into a tiered store whose memory tier is cleared (and whose files are
dropped from the OS page cache where the OS allows) before every cold-disk run (``disk``). The
prompt is given as its segments, or (``from_text``) as the prompt string, as users give it: the
documents are then found in it and its tokens spliced (the prompt handling, ``prompt_s``, is
timed in the TTFT, and ``ttft_from_ids`` is the TTFT without it). Runs are interleaved: each repeat
times every (length, strategy, store) once, so a slower shared CPU slows all of them alike, and
speedups are medians of per-repeat ratios to the baselines of the same repeat: kvblend's own full
prefill and, with ``transformers=True``, plain transformers as users call it on the same text
(the ``transformers`` row, `kvblend.bench.speed.ttft_baseline`); `kvblend.bench.speed.ttft_summary`
turns the runs into the summary and its table.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvblend.bench.speed.peak_memory import PeakMemory
from kvblend.bench.speed.synthetic import synthetic_text
from kvblend.bench.speed.ttft_baseline import STRATEGY as BASELINE
from kvblend.bench.speed.ttft_baseline import TransformersBaseline, rag_messages
from kvblend.bench.speed.ttft_summary import (  # the summary: importable from here too
    summarize_ttft,
)
from kvblend.bench.strategies import Strategy, strategy
from kvblend.blend.config import BlendConfig
from kvblend.engine.engine import BlendEngine
from kvblend.prompt.segments import Segment
from kvblend.store import DiskKVStore, MemoryKVStore, TieredKVStore

__all__ = [
    "DEFAULT_LENGTHS",
    "QUESTION",
    "SYSTEM",
    "ColdDisk",
    "build_documents",
    "drop_page_cache",
    "length_label",
    "run_ttft",
    "time_decode",
    "time_prefill",
]

QUESTION = "Summarize the documents above in a few sentences."
SYSTEM = "You are a helpful assistant. Answer using the documents."
DEFAULT_LENGTHS = (1024, 2048, 4096, 7680)


def length_label(tokens: int) -> str:
    """``1K``, ``2K``, ``7.5K`` ..."""
    return f"{tokens / 1024:g}K"


def build_documents(
    engine: BlendEngine, prompt_tokens: int, doc_tokens: int, seed: int
) -> list[str]:
    """``prompt_tokens // doc_tokens`` (at least one) synthetic documents of ``doc_tokens``."""
    count = max(1, prompt_tokens // doc_tokens)
    return [synthetic_text(engine.tokenizer, doc_tokens, seed * 1000 + i) for i in range(count)]


# ---------------------------------------------------------------------- stores
def drop_page_cache(directory: Path) -> int:
    """Ask the OS to drop ``directory``'s files from its page cache; return how many files."""
    if not hasattr(os, "posix_fadvise"):
        return 0
    dropped = 0
    for path in directory.rglob("*"):
        if not path.is_file():
            continue
        with contextlib.suppress(OSError):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                dropped += 1
            finally:
                os.close(fd)
    return dropped


class ColdDisk:
    """An engine over a tiered store whose memory tier is emptied before each run."""

    def __init__(self, engine: BlendEngine, directory: Path) -> None:
        self.directory = directory
        self.store = TieredKVStore(MemoryKVStore(), DiskKVStore(directory))
        self.engine = BlendEngine(
            engine.model,
            engine.tokenizer,
            store=self.store,
            name=engine.name,
            doc_prefix=engine.doc_prefix,
            system_prompt=engine.system_prompt,
        )

    def make_cold(self) -> None:
        """Empty the memory tier and drop the store's files from the page cache."""
        self.store.memory.clear()
        drop_page_cache(self.directory)


# ---------------------------------------------------------------------- timing
def time_prefill(
    engine: BlendEngine, segments: Sequence[Segment], strat: Strategy, from_text: bool = False
) -> dict[str, Any]:
    """Time one prompt under one strategy: TTFT (prefill + first token), phases, peak memory.

    ``from_text``: the prompt is given as one string (a strategy that caches no document, such
    as ``prefix``, still gets its segments).
    """
    prompt: Any = strat.segments(segments)
    if from_text and strat.cache_documents:
        prompt = "".join(segment.text for segment in segments)
    with PeakMemory(engine.decoder.device) as peak, strat.loop():
        out = engine.generate(prompt, strat.config, max_new_tokens=1)
    stats = out.stats
    return {
        "ttft_s": out.ttft_s,
        "prompt_s": stats.timings.get("tokenize_s"),
        "prefill_s": stats.timings.get("prefill_s"),
        "lookup_s": stats.timings.get("lookup_s"),
        "load_s": stats.timings.get("load_s"),
        "blend_s": stats.timings.get("blend_s"),
        "blend_device_s": stats.timings.get("blend_device_s"),  # CUDA events: the device's
        "load_device_s": stats.timings.get("load_device_s"),
        "uncompiled_calls": stats.uncompiled_calls,
        "prompt_tokens": stats.prompt_tokens,
        "recompute_fraction": stats.recompute_fraction,
        "compute_fraction": stats.compute_fraction,
        "segments_precomputed": stats.segments_precomputed,
        "peak_mib": peak.mib,
        "first_token": out.token_ids[0] if out.token_ids else None,
    }


def time_decode(
    engine: BlendEngine, segments: Sequence[Segment], config: BlendConfig, tokens: int
) -> dict[str, Any]:
    """Decode speed (tokens/s after the first token) following a prefill with ``config``."""
    out = engine.generate(list(segments), config, max_new_tokens=tokens)
    decoded = out.output_tokens - 1
    seconds = out.total_s - out.ttft_s
    return {
        "decode_tokens": decoded,
        "decode_s": seconds,
        "decode_tok_s": decoded / seconds if decoded > 0 and seconds > 0 else None,
    }


def run_ttft(
    engine: BlendEngine,
    *,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    strategies: Sequence[Strategy],
    repeats: int = 3,
    doc_tokens: int = 512,
    disk: bool = True,
    disk_strategies: Sequence[str] | None = None,
    decode_tokens: int = 16,
    decode_config: str = "default",
    seed: int = 0,
    log: Callable[[str], None] | None = None,
    store_dir: Path | None = None,
    host: bool = False,
    from_text: bool = False,
    transformers: bool = False,
) -> dict[str, Any]:
    """Run the interleaved TTFT benchmark; return every measurement and a summary.

    ``host``: also time the documents read from host memory (``host`` rows); ``from_text``:
    give every prompt as its string (see the module's docstring); ``transformers``: also time
    plain transformers on the same text in the engine's dtype (the ``transformers`` row, the
    user's baseline: `kvblend.bench.speed.ttft_baseline`), in every repeat before the strategies.
    """
    log = log or (lambda message: print(message, file=sys.stderr))
    if not strategies or strategies[0].name != "full":
        raise ValueError("the first strategy must be 'full', the baseline")
    memory_engine = _engine_over(engine, MemoryKVStore(8 << 30, device=engine.decoder.device))
    host_engine = _engine_over(engine, MemoryKVStore(8 << 30)) if host else None
    temp = None
    if disk and store_dir is None:
        temp = tempfile.TemporaryDirectory(prefix="kvblend-bench-")
        store_dir = Path(temp.name)
    cold = ColdDisk(engine, store_dir) if disk and store_dir is not None else None
    cached = [s for s in strategies if s.name != "full"]
    if disk_strategies is not None:
        disk_set = set(disk_strategies)
        disk_list = [s for s in cached if s.name in disk_set]
    else:
        disk_list = cached
    baseline = TransformersBaseline(engine) if transformers else None
    prompts: dict[int, list[Segment]] = {}
    messages: dict[int, list[dict[str, str]]] = {}
    doc_token_total: dict[int, int] = {}
    started = time.perf_counter()
    for length in lengths:
        documents = build_documents(engine, length, doc_tokens, seed + length)
        prompts[length] = engine.rag_segments(QUESTION, documents, system=SYSTEM)
        messages[length] = rag_messages(SYSTEM, documents, QUESTION)
        doc_token_total[length] = sum(len(engine.tokenize(d)) for d in documents)
        for warm in (memory_engine, host_engine):
            if warm is not None:
                warm.precompute(documents, progress=None)  # a bar on a terminal
        if cold is not None:
            cold.engine.precompute(documents, progress=None)
    log(f"precomputed documents in {time.perf_counter() - started:.1f} s")
    # warm-up: store every prefix segment and touch every code path once (compile it, for
    # the compiled loop: the first run's TTFT is kept in ``warmup``)
    warmup = []
    for length in lengths[:1]:
        if baseline is not None:
            first = baseline.time(messages[length])
            warmup.append({"target_tokens": length, "strategy": BASELINE, **first})
        for strat in strategies:
            first = time_prefill(memory_engine, prompts[length], strat, from_text)
            warmup.append({"target_tokens": length, "strategy": strat.name, **first})
    for length in lengths:
        for strat in cached:
            with strat.loop():
                memory_engine.prefill(strat.segments(prompts[length]), strat.config)
                if host_engine is not None:
                    host_engine.prefill(strat.segments(prompts[length]), strat.config)
                if cold is not None and strat in disk_list:
                    cold.engine.prefill(strat.segments(prompts[length]), strat.config)
    rows: list[dict[str, Any]] = []
    decode_strategy = strategy(decode_config)
    for repeat in range(repeats):
        for length in lengths:
            segments = prompts[length]
            if baseline is not None:
                row = baseline.time(messages[length])
                rows.append(
                    {
                        "repeat": repeat,
                        "target_tokens": length,
                        "strategy": BASELINE,
                        "ratio": None,
                        "store": "none",
                        **row,
                    }
                )
            for strat in strategies:
                row = time_prefill(memory_engine, segments, strat, from_text)
                rows.append(_row(repeat, length, strat, "memory", row))
                if host_engine is not None and strat in cached:
                    row = time_prefill(host_engine, segments, strat, from_text)
                    rows.append(_row(repeat, length, strat, "host", row))
                if cold is not None and strat in disk_list:
                    cold.make_cold()
                    row = time_prefill(cold.engine, segments, strat, from_text)
                    rows.append(_row(repeat, length, strat, "disk", row))
            if decode_tokens > 1:
                for strat in (strategies[0], decode_strategy):
                    row = time_decode(memory_engine, segments, strat.config, decode_tokens)
                    rows.append(_row(repeat, length, strat, "decode", row))
            log(
                f"repeat {repeat + 1}/{repeats}, {length_label(length)}: "
                + ", ".join(
                    f"{r['strategy']}"
                    f"{'' if r['store'] in ('memory', 'none') else '(' + r['store'] + ')'} "
                    f"{r['ttft_s']:.2f}s"
                    for r in rows
                    if r["repeat"] == repeat and r["target_tokens"] == length and "ttft_s" in r
                )
            )
    store_bytes = None
    if cold is not None:
        disk_stats = cold.store.stats().tiers.get("disk")
        store_bytes = disk_stats.bytes if disk_stats is not None else None
    memory_bytes = memory_engine.store.stats().bytes
    stored_tokens = sum(doc_token_total.values())
    result = {
        "benchmark": "ttft",
        "lengths": list(lengths),
        "doc_tokens": doc_tokens,
        "repeats": repeats,
        "strategies": [s.name for s in strategies],
        "disk_strategies": [s.name for s in disk_list] if cold is not None else [],
        "host": host_engine is not None,
        "from_text": from_text,
        "baseline": baseline.describe() if baseline is not None else None,
        "elapsed_s": time.perf_counter() - started,
        "store": {
            "memory_bytes": memory_bytes,
            "disk_bytes": store_bytes,
            "document_tokens": stored_tokens,
            "memory_mib_per_1k_tokens": memory_bytes / 2**20 / stored_tokens * 1000,
            "disk_mib_per_1k_tokens": (
                store_bytes / 2**20 / stored_tokens * 1000 if store_bytes else None
            ),
        },
        "rows": rows,
        "warmup": warmup,
    }
    result["summary"] = summarize_ttft(rows)
    if cold is not None:
        cold.store.close()
    if baseline is not None:
        baseline.close()
    if temp is not None:
        temp.cleanup()
    return result


def _engine_over(engine: BlendEngine, store: MemoryKVStore) -> BlendEngine:
    """Return an engine over ``engine``'s model and settings, reading ``store``."""
    return BlendEngine(
        engine.model,
        engine.tokenizer,
        store=store,
        name=engine.name,
        doc_prefix=engine.doc_prefix,
        system_prompt=engine.system_prompt,
    )


def _row(repeat: int, length: int, strat: Strategy, store: str, data: dict) -> dict[str, Any]:
    return {
        "repeat": repeat,
        "target_tokens": length,
        "strategy": strat.name,
        "ratio": strat.recompute_ratio,
        "store": store,
        **data,
    }
