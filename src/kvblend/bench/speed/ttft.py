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
from dataclasses import dataclass
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
    run = _Run.open(engine, strategies, disk, disk_strategies, store_dir, host, from_text)
    run.baseline = TransformersBaseline(engine) if transformers else None
    started = time.perf_counter()
    prompts = _Prompts.build(run, engine, lengths, doc_tokens, seed)
    log(f"precomputed documents in {time.perf_counter() - started:.1f} s")
    warmup = run.warm_up(prompts, lengths)
    rows: list[dict[str, Any]] = []
    decode_strategy = strategy(decode_config)
    for repeat in range(repeats):
        for length in lengths:
            timed = run.time_repeat(prompts, repeat, length)
            if decode_tokens > 1:  # after full prefill and after the decode config's
                pair = (strategies[0], decode_strategy)
                timed += run.time_decode(prompts, repeat, length, pair, decode_tokens)
            rows += timed
            log(_repeat_line(repeat, repeats, length, timed))
    result = {
        "benchmark": "ttft",
        "lengths": list(lengths),
        "doc_tokens": doc_tokens,
        "repeats": repeats,
        **run.describe(),
        "elapsed_s": time.perf_counter() - started,
        "store": run.store_sizes(sum(prompts.document_tokens.values())),
        "rows": rows,
        "warmup": warmup,
    }
    result["summary"] = summarize_ttft(rows)
    run.close()
    return result


@dataclass
class _Run:
    """The engines of one TTFT run, one per place the documents are read from, and what each times.

    ``memory``: documents in the model device's memory (every strategy); ``host``: in host
    memory (the strategies that cache documents); ``cold``: from a cold disk tier (``disk``);
    ``baseline``: plain transformers, timed before the strategies in every repeat.
    """

    strategies: Sequence[Strategy]
    from_text: bool
    memory: BlendEngine
    host: BlendEngine | None
    cold: ColdDisk | None
    cached: list[Strategy]
    disk: list[Strategy]
    temp: tempfile.TemporaryDirectory[str] | None = None
    baseline: TransformersBaseline | None = None

    @classmethod
    def open(
        cls,
        engine: BlendEngine,
        strategies: Sequence[Strategy],
        disk: bool,
        disk_strategies: Sequence[str] | None,
        store_dir: Path | None,
        host: bool,
        from_text: bool,
    ) -> _Run:
        """Open the stores and engines over ``engine``'s model (a temporary disk store if none)."""
        memory = _engine_over(engine, MemoryKVStore(8 << 30, device=engine.decoder.device))
        host_engine = _engine_over(engine, MemoryKVStore(8 << 30)) if host else None
        temp = None
        if disk and store_dir is None:
            temp = tempfile.TemporaryDirectory(prefix="kvblend-bench-")
            store_dir = Path(temp.name)
        cold = ColdDisk(engine, store_dir) if disk and store_dir is not None else None
        cached = [s for s in strategies if s.name != "full"]
        on_disk = cached
        if disk_strategies is not None:
            names = set(disk_strategies)
            on_disk = [s for s in cached if s.name in names]
        return cls(strategies, from_text, memory, host_engine, cold, cached, on_disk, temp)

    def precompute(self, documents: list[str]) -> None:
        """Store ``documents`` in every store of the run."""
        for warm in (self.memory, self.host):
            if warm is not None:
                warm.precompute(documents, progress=None)  # a bar on a terminal
        if self.cold is not None:
            self.cold.engine.precompute(documents, progress=None)

    def warm_up(self, prompts: _Prompts, lengths: Sequence[int]) -> list[dict[str, Any]]:
        """Store every prefix segment and run every code path once; return the first runs.

        The first length's runs are kept (``warmup``: for the compiled loop, the first run's
        TTFT is its compile); then every strategy that caches documents prefills every length
        from every store it is timed from.
        """
        warmup = []
        for length in lengths[:1]:
            if self.baseline is not None:
                first = self.baseline.time(prompts.messages[length])
                warmup.append({"target_tokens": length, "strategy": BASELINE, **first})
            for strat in self.strategies:
                first = time_prefill(self.memory, prompts.segments[length], strat, self.from_text)
                warmup.append({"target_tokens": length, "strategy": strat.name, **first})
        for length in lengths:
            for strat in self.cached:
                segments = strat.segments(prompts.segments[length])
                with strat.loop():
                    self.memory.prefill(segments, strat.config)
                    if self.host is not None:
                        self.host.prefill(segments, strat.config)
                    if self.cold is not None and strat in self.disk:
                        self.cold.engine.prefill(segments, strat.config)
        return warmup

    def time_repeat(self, prompts: _Prompts, repeat: int, length: int) -> list[dict[str, Any]]:
        """Time the prompt of ``length`` once: the baseline, then each strategy from each store."""
        segments = prompts.segments[length]
        rows = []
        if self.baseline is not None:
            row = self.baseline.time(prompts.messages[length])
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
        for strat in self.strategies:
            row = time_prefill(self.memory, segments, strat, self.from_text)
            rows.append(_row(repeat, length, strat, "memory", row))
            if self.host is not None and strat in self.cached:
                row = time_prefill(self.host, segments, strat, self.from_text)
                rows.append(_row(repeat, length, strat, "host", row))
            if self.cold is not None and strat in self.disk:
                self.cold.make_cold()
                row = time_prefill(self.cold.engine, segments, strat, self.from_text)
                rows.append(_row(repeat, length, strat, "disk", row))
        return rows

    def time_decode(
        self,
        prompts: _Prompts,
        repeat: int,
        length: int,
        strategies: Sequence[Strategy],
        tokens: int,
    ) -> list[dict[str, Any]]:
        """Time decoding ``tokens`` tokens after each of ``strategies``' prefills (memory)."""
        rows = []
        for strat in strategies:
            row = time_decode(self.memory, prompts.segments[length], strat.config, tokens)
            rows.append(_row(repeat, length, strat, "decode", row))
        return rows

    def describe(self) -> dict[str, Any]:
        """Say what the run timed: its strategies, those from disk, host memory, the baseline."""
        return {
            "strategies": [s.name for s in self.strategies],
            "disk_strategies": [s.name for s in self.disk] if self.cold is not None else [],
            "host": self.host is not None,
            "from_text": self.from_text,
            "baseline": self.baseline.describe() if self.baseline is not None else None,
        }

    def store_sizes(self, document_tokens: int) -> dict[str, Any]:
        """Return the stores' sizes, in all and per 1,000 document tokens."""
        disk_bytes = None
        if self.cold is not None:
            disk_stats = self.cold.store.stats().tiers.get("disk")
            disk_bytes = disk_stats.bytes if disk_stats is not None else None
        memory_bytes = self.memory.store.stats().bytes
        return {
            "memory_bytes": memory_bytes,
            "disk_bytes": disk_bytes,
            "document_tokens": document_tokens,
            "memory_mib_per_1k_tokens": memory_bytes / 2**20 / document_tokens * 1000,
            "disk_mib_per_1k_tokens": (
                disk_bytes / 2**20 / document_tokens * 1000 if disk_bytes else None
            ),
        }

    def close(self) -> None:
        """Close the disk store and the baseline; remove the temporary store folder."""
        if self.cold is not None:
            self.cold.store.close()
        if self.baseline is not None:
            self.baseline.close()
        if self.temp is not None:
            self.temp.cleanup()


@dataclass
class _Prompts:
    """Each length's prompt, as segments and as the baseline's messages, and its document tokens."""

    segments: dict[int, list[Segment]]
    messages: dict[int, list[dict[str, str]]]
    document_tokens: dict[int, int]

    @classmethod
    def build(
        cls, run: _Run, engine: BlendEngine, lengths: Sequence[int], doc_tokens: int, seed: int
    ) -> _Prompts:
        """Build each length's documents and prompt; precompute the documents in ``run``."""
        prompts = cls({}, {}, {})
        for length in lengths:
            documents = build_documents(engine, length, doc_tokens, seed + length)
            prompts.segments[length] = engine.rag_segments(QUESTION, documents, system=SYSTEM)
            prompts.messages[length] = rag_messages(SYSTEM, documents, QUESTION)
            prompts.document_tokens[length] = sum(len(engine.tokenize(d)) for d in documents)
            run.precompute(documents)
        return prompts


def _repeat_line(repeat: int, repeats: int, length: int, rows: list[dict[str, Any]]) -> str:
    """Return the progress line of one repeat of one length: each timed row's TTFT."""
    return f"repeat {repeat + 1}/{repeats}, {length_label(length)}: " + ", ".join(
        f"{r['strategy']}"
        f"{'' if r['store'] in ('memory', 'none') else '(' + r['store'] + ')'} "
        f"{r['ttft_s']:.2f}s"
        for r in rows
        if "ttft_s" in r
    )


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
