"""TTFT with documents read from Redis vs memory vs cold local disk, and Redis store throughput.

    python benchmarks/redis_ttft.py [--length 4096] [--repeats 5] [--redis-url URL]

Without ``--redis-url`` the script starts its own ``redis-server`` on a free loopback port (in
a temporary folder) and stops it at the end. One prompt of about ``--length`` tokens over
512-token synthetic documents on the bundled model, the default blend strategy; each repeat
times full prefill, then the blend with documents from memory, from a cold disk tier (memory
emptied, files dropped from the page cache) and from Redis (nothing kept locally: every lookup
crosses the network), interleaved. Then four processes read (and write) the same entries on
Redis at once: aggregate MB/s. Results: benchmarks/results/redis_ttft.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def start_redis(folder: Path) -> tuple[str, int]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    subprocess.run(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder),
         "--save", "", "--appendonly", "no", "--daemonize", "yes"],
        check=True,
    )  # fmt: skip
    for _ in range(200):
        if subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True).returncode:
            time.sleep(0.05)
        else:
            break
    return f"redis://127.0.0.1:{port}/0", port


def _throughput_worker(url: str, prefix: str, keys: list[str], worker: int, rounds: int) -> dict:
    """Read every entry ``rounds`` times (all tensors), then write them under new keys."""
    from kvblend.store import RedisKVStore

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--doc-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2, help="throughput: reads per entry")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--redis-url")
    args = parser.parse_args()

    import torch

    from kvblend import BlendEngine
    from kvblend.bench.strategies import strategy
    from kvblend.bench.ttft import QUESTION, SYSTEM, ColdDisk, build_documents, time_prefill
    from kvblend.store import MemoryKVStore, RedisKVStore, RemoteTieredKVStore

    torch.set_num_threads(args.threads)
    temp = Path(tempfile.mkdtemp(prefix="kvblend-redis-bench-"))
    port = None
    url = args.redis_url
    if url is None:
        if shutil.which("redis-server") is None:
            sys.exit("redis-server not found: apt-get install -y redis-server, or --redis-url")
        url, port = start_redis(temp)
    try:
        memory = BlendEngine.from_pretrained(store=MemoryKVStore(8 << 30), system_prompt=SYSTEM)
        cold = ColdDisk(memory, temp / "disk")
        remote = RedisKVStore(url, prefix="kvblend-bench:")
        remote.clear()
        over_redis = BlendEngine(
            memory.model, memory.tokenizer, name=memory.name, system_prompt=SYSTEM,
            store=RemoteTieredKVStore(MemoryKVStore(0), None, remote=remote),
        )  # fmt: skip
        documents = build_documents(memory, args.length, args.doc_tokens, seed=args.length)
        segments = memory.rag_segments(QUESTION, documents, system=SYSTEM)
        engines = {"memory": memory, "disk": cold.engine, "redis": over_redis}
        for engine in engines.values():
            engine.precompute(documents, progress=False)
        full, default = strategy("full"), strategy("default")
        for engine in engines.values():  # warm-up; stores the prompt head everywhere
            engine.prefill(default.segments(segments), default.config)
        rows = []
        for repeat in range(args.repeats):
            rows.append({"repeat": repeat, "store": "memory", "strategy": "full",
                         **time_prefill(memory, segments, full)})  # fmt: skip
            for name, engine in engines.items():
                if name == "disk":
                    cold.make_cold()
                row = time_prefill(engine, segments, default)
                assert row["segments_precomputed"] == 0, (name, row)
                rows.append({"repeat": repeat, "store": name, "strategy": "default", **row})
            print(
                f"repeat {repeat + 1}: "
                + ", ".join(f"{r['store']}/{r['strategy']} {r['ttft_s']:.3f}s" for r in rows[-4:]),
                file=sys.stderr,
            )

        def median(store: str, strat: str, field: str = "ttft_s") -> float:
            return statistics.median(
                r[field] for r in rows if r["store"] == store and r["strategy"] == strat
            )

        def ratio(store: str) -> float:
            return statistics.median(
                a["ttft_s"] / b["ttft_s"]
                for a, b in zip(
                    [r for r in rows if r["store"] == store and r["strategy"] == "default"],
                    [r for r in rows if r["store"] == "memory" and r["strategy"] == "default"],
                    strict=True,
                )
            )

        keys = [memory.segment_id(d) for d in documents]
        redis_bytes = remote.stats().bytes
        context = multiprocessing.get_context("spawn")
        with context.Pool(4) as pool:
            started = time.perf_counter()
            work = [(url, remote.prefix, keys, worker, args.rounds) for worker in range(4)]
            parts = pool.starmap(_throughput_worker, work)
            wall = time.perf_counter() - started
        summary = {
            "tokens": rows[0]["prompt_tokens"],
            "documents": len(documents),
            "repeats": args.repeats,
            "threads": args.threads,
            "ttft_s": {
                "full (memory)": median("memory", "full"),
                "default, memory": median("memory", "default"),
                "default, cold disk": median("disk", "default"),
                "default, redis": median("redis", "default"),
            },
            "lookup_s": {s: median(s, "default", "lookup_s") for s in engines},
            "ratio_to_memory": {s: ratio(s) for s in engines},
            "throughput_4_processes": {
                "read_mb_s": sum(p["read_bytes"] for p in parts)
                / max(p["read_s"] for p in parts)
                / 1e6,
                "write_mb_s": sum(p["write_bytes"] for p in parts)
                / max(p["write_s"] for p in parts)
                / 1e6,
                "read_bytes_per_process": parts[0]["read_bytes"],
                "wall_s": wall,
            },
            "redis_bytes": redis_bytes,
        }
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "redis_ttft.json").write_text(
            json.dumps({"summary": summary, "rows": rows}, indent=2)
        )
        lines = [
            f"Prompt of {summary['tokens']} tokens ({len(documents)} documents of "
            f"{args.doc_tokens} tokens), default strategy, {args.repeats} repeats, "
            f"{args.threads} threads; median TTFT:",
            "",
            "| documents from | TTFT (s) | x memory | store lookups (s) |",
            "|---|---|---|---|",
            f"| (full prefill, no reuse) | {median('memory', 'full'):.3f} | | |",
        ]
        for store in engines:
            lines.append(
                f"| {store} | {median(store, 'default'):.3f} | {ratio(store):.2f} | "
                f"{median(store, 'default', 'lookup_s'):.3f} |"
            )
        through = summary["throughput_4_processes"]
        lines += [
            "",
            f"Four processes reading the same {len(keys)} entries ({args.rounds} rounds, "
            f"{through['read_bytes_per_process'] / 2**20:.0f} MiB each) from one Redis server: "
            f"{through['read_mb_s']:.0f} MB/s in total; writing them back: "
            f"{through['write_mb_s']:.0f} MB/s in total.",
        ]
        (RESULTS / "redis_ttft.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        remote.clear()
        remote.close()
        cold.store.close()
    finally:
        if port is not None:
            subprocess.run(
                ["redis-cli", "-p", str(port), "shutdown", "nosave"], capture_output=True
            )
        shutil.rmtree(temp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
