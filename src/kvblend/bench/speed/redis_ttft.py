"""Redis benchmark: TTFT with documents from Redis vs memory vs a cold local disk, and throughput.

``kvblend bench redis-ttft``: without ``--redis-url`` it starts its own ``redis-server`` on a free
loopback port (in a temporary folder) and stops it at the end. One prompt of about ``--length``
tokens over 512-token synthetic documents, the default blend strategy; each repeat times full
prefill, then the blend with documents from memory, from a cold disk tier (memory emptied, files
dropped from the page cache) and from Redis (nothing kept locally: every lookup crosses the
network), interleaved. Then four processes read (and write) the same entries on Redis at once:
aggregate MB/s. It answers what the shared tier costs against the local ones, so it needs a
``redis-server`` binary (or a server's URL) and the ``redis`` extra.
"""

from __future__ import annotations

import multiprocessing
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from kvblend.bench.speed.ttft import QUESTION, SYSTEM, ColdDisk, build_documents, time_prefill
from kvblend.bench.strategies import strategy
from kvblend.engine.engine import BlendEngine
from kvblend.prompt.segments import Segment
from kvblend.store import MemoryKVStore, RedisKVStore, RemoteTieredKVStore

PROCESSES = 4


@contextmanager
def redis_server(url: str | None) -> Iterator[str]:
    """Yield ``url``, or when it is None the URL of a ``redis-server`` started for the run."""
    if url is not None:
        yield url
        return
    if shutil.which("redis-server") is None:
        raise SystemExit("redis-server not found: apt-get install -y redis-server, or --redis-url")
    folder = Path(tempfile.mkdtemp(prefix="kvblend-redis-bench-"))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    try:
        subprocess.run(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder),
             "--save", "", "--appendonly", "no", "--daemonize", "yes"],
            check=True,
        )  # fmt: skip
        for _ in range(200):
            ping = subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True)
            if ping.returncode == 0:
                break
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        subprocess.run(["redis-cli", "-p", str(port), "shutdown", "nosave"], capture_output=True)
        shutil.rmtree(folder, ignore_errors=True)


def _throughput_worker(url: str, prefix: str, keys: list[str], worker: int, rounds: int) -> dict:
    """Read every entry ``rounds`` times (all tensors), then write them under new keys."""
    store = RedisKVStore(url, prefix=prefix)
    read_bytes = 0
    started = time.perf_counter()
    kept = {}
    for _ in range(rounds):
        for key in keys:
            entry = store.get(key)
            tensors = {name: entry[name] for name in entry}
            read_bytes += sum(t.nbytes for t in tensors.values())
            kept[key] = (tensors, entry.metadata)
    read_s = time.perf_counter() - started
    started = time.perf_counter()
    written = 0
    for key, (tensors, metadata) in kept.items():
        store.put(f"copy{worker}-{key}"[:200], tensors, metadata)
        written += sum(t.nbytes for t in tensors.values())
    write_s = time.perf_counter() - started
    store.close()
    return {"read_bytes": read_bytes, "read_s": read_s, "write_bytes": written, "write_s": write_s}


def run_redis_ttft(
    memory: BlendEngine, url: str, *, length: int, doc_tokens: int, repeats: int, rounds: int
) -> dict[str, Any]:
    """Time the default blend from memory, a cold disk and Redis; then Redis throughput.

    ``memory`` is the engine over a memory store; the disk and Redis engines share its model.
    Returns ``{"summary": ..., "rows": ...}`` (one row per repeat, store and strategy).
    """
    temp = Path(tempfile.mkdtemp(prefix="kvblend-redis-bench-"))
    cold = ColdDisk(memory, temp / "disk")
    remote = RedisKVStore(url, prefix="kvblend-bench:")
    remote.clear()
    try:
        over_redis = BlendEngine(
            memory.model,
            memory.tokenizer,
            name=memory.name,
            system_prompt=SYSTEM,
            store=RemoteTieredKVStore(MemoryKVStore(0), None, remote=remote),
        )
        documents = build_documents(memory, length, doc_tokens, seed=length)
        segments = memory.rag_segments(QUESTION, documents, system=SYSTEM)
        engines = {"memory": memory, "disk": cold.engine, "redis": over_redis}
        for engine in engines.values():
            engine.precompute(documents, progress=False)
        default = strategy("default")
        for engine in engines.values():  # warm-up; stores the prompt head everywhere
            engine.prefill(default.segments(segments), default.config)
        rows = _time_stores(engines, cold, segments, repeats)
        keys = [memory.segment_id(d) for d in documents]
        redis_bytes = remote.stats().bytes
        parts, wall = _throughput(url, remote.prefix, keys, rounds)
    finally:
        remote.clear()
        remote.close()
        cold.store.close()
        shutil.rmtree(temp, ignore_errors=True)
    summary = {
        "tokens": rows[0]["prompt_tokens"],
        "documents": len(documents),
        "doc_tokens": doc_tokens,
        "repeats": repeats,
        "rounds": rounds,
        "threads": torch.get_num_threads(),
        **_ttft_summary(rows, engines),
        "throughput_4_processes": {
            "read_mb_s": sum(p["read_bytes"] for p in parts)
            / max(p["read_s"] for p in parts)
            / 1e6,
            "write_mb_s": sum(p["write_bytes"] for p in parts)
            / max(p["write_s"] for p in parts)
            / 1e6,
            "read_bytes_per_process": parts[0]["read_bytes"],
            "entries": len(keys),
            "wall_s": wall,
        },
        "redis_bytes": redis_bytes,
    }
    return {"summary": summary, "rows": rows}


def _time_stores(
    engines: dict[str, BlendEngine], cold: ColdDisk, segments: list[Segment], repeats: int
) -> list[dict[str, Any]]:
    """Time full prefill from memory, then the default from each store, in every repeat."""
    full, default = strategy("full"), strategy("default")
    rows = []
    for repeat in range(repeats):
        row = time_prefill(engines["memory"], segments, full)
        rows.append({"repeat": repeat, "store": "memory", "strategy": "full", **row})
        for name, engine in engines.items():
            if name == "disk":
                cold.make_cold()
            row = time_prefill(engine, segments, default)
            assert row["segments_precomputed"] == 0, (name, row)
            rows.append({"repeat": repeat, "store": name, "strategy": "default", **row})
        timed = ", ".join(f"{r['store']}/{r['strategy']} {r['ttft_s']:.3f}s" for r in rows[-4:])
        print(f"repeat {repeat + 1}: {timed}", file=sys.stderr)
    return rows


def _throughput(
    url: str, prefix: str, keys: list[str], rounds: int
) -> tuple[list[dict[str, Any]], float]:
    """Read and write ``keys`` on Redis from `PROCESSES` processes at once: each's counts, wall."""
    with multiprocessing.get_context("spawn").Pool(PROCESSES) as pool:
        started = time.perf_counter()
        work = [(url, prefix, keys, worker, rounds) for worker in range(PROCESSES)]
        parts = pool.starmap(_throughput_worker, work)
        wall = time.perf_counter() - started
    return parts, wall


def _ttft_summary(rows: list[dict[str, Any]], stores: Iterable[str]) -> dict[str, Any]:
    """Return the median TTFTs, each store's lookup time and its TTFT over memory's."""

    def median(store: str, strat: str, field: str = "ttft_s") -> float:
        return statistics.median(
            r[field] for r in rows if r["store"] == store and r["strategy"] == strat
        )

    def ratio(store: str) -> float:
        blended = [r for r in rows if r["store"] == store and r["strategy"] == "default"]
        in_memory = [r for r in rows if r["store"] == "memory" and r["strategy"] == "default"]
        return statistics.median(
            a["ttft_s"] / b["ttft_s"] for a, b in zip(blended, in_memory, strict=True)
        )

    return {
        "ttft_s": {
            "full (memory)": median("memory", "full"),
            "default, memory": median("memory", "default"),
            "default, cold disk": median("disk", "default"),
            "default, redis": median("redis", "default"),
        },
        "lookup_s": {s: median(s, "default", "lookup_s") for s in stores},
        "ratio_to_memory": {s: ratio(s) for s in stores},
    }


def redis_table(summary: dict[str, Any]) -> str:
    """Return the summary as markdown: the TTFT table, then the throughput line."""
    ttft = summary["ttft_s"]
    lines = [
        f"Prompt of {summary['tokens']} tokens ({summary['documents']} documents of "
        f"{summary['doc_tokens']} tokens), default strategy, {summary['repeats']} repeats, "
        f"{summary['threads']} threads; median TTFT:",
        "",
        "| documents from | TTFT (s) | x memory | store lookups (s) |",
        "|---|---|---|---|",
        f"| (full prefill, no reuse) | {ttft['full (memory)']:.3f} | | |",
    ]
    for store, label in (("memory", "memory"), ("disk", "cold disk"), ("redis", "redis")):
        lines.append(
            f"| {store} | {ttft['default, ' + label]:.3f} | "
            f"{summary['ratio_to_memory'][store]:.2f} | {summary['lookup_s'][store]:.3f} |"
        )
    through = summary["throughput_4_processes"]
    lines += [
        "",
        f"Four processes reading the same {through['entries']} entries ({summary['rounds']} "
        f"rounds, {through['read_bytes_per_process'] / 2**20:.0f} MiB each) from one Redis "
        f"server: {through['read_mb_s']:.0f} MB/s in total; writing them back: "
        f"{through['write_mb_s']:.0f} MB/s in total.",
    ]
    return "\n".join(lines)
