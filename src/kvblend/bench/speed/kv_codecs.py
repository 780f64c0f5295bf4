"""What each KV codec costs and saves: bytes per token, precompute and read speed per tier, TTFT.

``kvblend bench codecs`` (`kvblend.blend.kv_codec`), on the bundled model unless ``--model``:

- ``bytes``: stored bytes per token (codes and scales) of each codec against fp16 entries, for
  the model's shape and a Llama-3.1-8B shape (32 layers, 8 KV heads of 128) at several
  document lengths, from the format; and the size of a real 512-token entry file on disk;
- ``throughput``: documents precomputed into each tier (tokens/s, the model's forward
  included), then their entries read back and placed in a K/V buffer as the blend loop does
  (tokens/s and stored MB/s): a memory tier, a host one (when the model is not on the CPU), a
  cold disk tier (its files dropped from the page cache before every read) and Redis;
- ``ttft``: TTFT of `BlendConfig()` at ``--length`` tokens (512-token documents) with the
  documents on a cold disk and in Redis, every codec (and full prefill) in every repeat,
  interleaved, so ratios compare runs taken under the same machine load;
- ``decode``: the placement copy alone: one ``--doc-tokens`` entry of the model's K/V shape
  (random values: decoding does not depend on them) already in memory, placed into a buffer of
  the engine's dtype by each codec (``fp16``/``none``: a plain copy; with ``k8v4``, also its
  version 1, plain per-token codes, for comparison), interleaved over rounds; median ms per
  entry and tokens/s.

Codec labels: ``fp16`` is full precision stored in float16 (``kv_codec="none"``,
``kv_dtype=float16``), ``none`` full precision in the model's dtype, then ``int8``, ``k8v4``,
``int4``. Redis is a ``redis-server`` started for the run (or ``--redis-url``).

    kvblend bench codecs [--parts bytes,throughput,ttft,decode] [--codecs fp16,none,int8,k8v4,int4]
        [--length 4096] [--repeats 5] [--threads 1] [--model PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kvblend.bench.result_files import RESULTS_DIR
from kvblend.bench.speed.ttft import (
    QUESTION,
    SYSTEM,
    build_documents,
    drop_page_cache,
    time_prefill,
)
from kvblend.blend.kv_codec import NO_CODEC, EncodedKV, KVCodec, kv_codec
from kvblend.engine.engine import BlendEngine
from kvblend.engine.torch_threads import use_threads
from kvblend.store import DiskKVStore, MemoryKVStore, TieredKVStore

LABELS = ("fp16", "none", "int8", "k8v4", "int4")
PARTS = ("bytes", "throughput", "ttft", "decode")
#: KV shapes of the bytes table: (name, layers, KV heads, head_dim).
SHAPES = (("SmolLM2-135M", 30, 3, 64), ("Llama-3.1-8B", 32, 8, 128))
LENGTHS = (116, 512, 2048)


def engine_for(base: BlendEngine, label: str, store: Any) -> BlendEngine:
    """Return an engine over ``base``'s model storing KV as ``label`` says, over ``store``."""
    fp16 = label == "fp16"
    return BlendEngine(
        base.model,
        base.tokenizer,
        store=store,
        name=str(base.name),
        system_prompt=SYSTEM,
        kv_dtype=torch.float16 if fp16 else base.kv_dtype,
        kv_codec=NO_CODEC if fp16 else kv_codec(label),
        check_parity=False,
    )


def bytes_table_rows(labels: Sequence[str], model_shape: tuple[str, int, int, int]) -> list[dict]:
    """Return the stored bytes per token of each codec, from the format, against fp16's."""
    rows = []
    shapes = [model_shape] + [s for s in SHAPES if s[1:] != model_shape[1:]]
    for name, layers, heads, dim in shapes:
        for tokens in LENGTHS:
            fp16 = NO_CODEC.bytes_per_token(heads, dim, tokens) * layers
            for label in labels:
                if label in ("fp16", "none"):
                    continue
                stored = kv_codec(label).bytes_per_token(heads, dim, tokens) * layers
                rows.append(
                    {
                        "shape": name,
                        "tokens": tokens,
                        "codec": label,
                        "bytes_per_token": stored,
                        "fp16_bytes_per_token": fp16,
                        "of_fp16": stored / fp16,
                    }
                )
    return rows


def entry_files(base: BlendEngine, labels: Sequence[str], folder: Path) -> list[dict]:
    """Return the disk size of a real 512-token entry per codec (header and metadata included)."""
    text = build_documents(base, 512, 512, seed=1)[0]
    rows: list[dict[str, Any]] = []
    for label in labels:
        store = DiskKVStore(folder / label)
        engine = engine_for(base, label, store)
        engine.precompute([text], progress=False)
        size = sum(path.stat().st_size for path in (folder / label).glob("*/*/*.val"))
        rows.append({"codec": label, "tokens": len(engine.tokenize(text)), "file_bytes": size})
        store.close()
    fp16 = next((int(r["file_bytes"]) for r in rows if r["codec"] == "fp16"), None)
    for row in rows:
        row["of_fp16"] = row["file_bytes"] / fp16 if fp16 else None
    return rows


def _tiers(folder: Path, redis_url: str | None, device: torch.device) -> dict[str, Any]:
    from kvblend.store import RedisKVStore, RemoteTieredKVStore

    tiers: dict[str, Any] = {"memory": MemoryKVStore(8 << 30, device=device)}
    if device.type != "cpu":
        tiers["host"] = MemoryKVStore(8 << 30)
    tiers["disk"] = TieredKVStore(MemoryKVStore(0), DiskKVStore(folder / "disk"))
    if redis_url is not None:
        remote = RedisKVStore(redis_url, prefix="kvblend-codec-bench:")
        remote.clear()
        tiers["redis"] = RemoteTieredKVStore(MemoryKVStore(0), None, remote=remote)
    return tiers


def _make_cold(store: Any, folder: Path) -> None:
    if isinstance(store, TieredKVStore) and store.memory is not None:
        store.memory.clear()
    drop_page_cache(folder)


def _read_and_place(engine: BlendEngine, keys: Sequence[str], tokens: Sequence[int]) -> int:
    """Open each entry, read it whole and place it in a K/V buffer; return the stored bytes."""
    device = engine.decoder.device
    stored = 0
    for key, count in zip(keys, tokens, strict=True):
        entry = engine.library.segment_kv.open_entry(key, count, device)
        if entry is None:
            raise RuntimeError(f"entry {key} missing from the store")
        tensors = {name: entry[name] for name in entry}
        stored += sum(t.nbytes for t in tensors.values())
        dtype, shape = engine.library.segment_kv.entry_shape(count)
        buffer = torch.empty(shape, dtype=engine.decoder.dtype, device=device)
        if engine.kv_codec.quantized:
            encoded: EncodedKV = engine.kv_codec.open(tensors, shape)
            encoded.place(buffer)
        else:
            buffer.copy_(tensors["kv"])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return stored


def run_throughput(
    base: BlendEngine,
    labels: Sequence[str],
    redis_url: str | None,
    *,
    documents: int,
    doc_tokens: int,
    repeats: int,
    log: Any,
) -> list[dict]:
    """Precompute into, then read from, every tier, every codec; one row per (tier, codec)."""
    folder = Path(tempfile.mkdtemp(prefix="kvblend-codec-bench-"))
    tiers = _tiers(folder, redis_url, base.decoder.device)
    texts = build_documents(base, documents * doc_tokens, doc_tokens, seed=7)
    rows = []
    try:
        for tier, store in tiers.items():
            for label in labels:
                engine = engine_for(base, label, store)
                started = time.perf_counter()
                keys = engine.precompute(texts, progress=False, force=True)
                precompute_s = time.perf_counter() - started
                tokens = [len(engine.library.segment_kv.layout(text).ids) for text in texts]
                reads = []
                for _ in range(repeats):
                    _make_cold(store, folder)
                    started = time.perf_counter()
                    stored = _read_and_place(engine, keys, tokens)
                    reads.append(time.perf_counter() - started)
                read_s = statistics.median(reads)
                total = sum(tokens)
                rows.append(
                    {
                        "tier": tier,
                        "codec": label,
                        "documents": len(texts),
                        "tokens": total,
                        "stored_bytes": stored,
                        "precompute_tok_s": total / precompute_s,
                        "read_tok_s": total / read_s,
                        "read_mb_s": stored / read_s / 1e6,
                        "read_s": reads,
                    }
                )
                log(
                    f"{tier} {label}: precompute {total / precompute_s:,.0f} tok/s, read "
                    f"{total / read_s:,.0f} tok/s ({stored / read_s / 1e6:,.0f} MB/s)"
                )
    finally:
        _close(tiers, folder)
    return rows


#: ``k8v4`` as version 1 stored it (per-token values on an even grid): the decode part's baseline.
K8V4_V1 = KVCodec("k8v4", 8, 4)


def run_decode(
    base: BlendEngine, labels: Sequence[str], *, doc_tokens: int, rounds: int
) -> list[dict[str, Any]]:
    """Time placing one entry of ``doc_tokens`` per codec, interleaved; one row per codec."""
    shape = base.decoder.shape
    kv_shape = (shape.num_layers, 2, shape.num_kv_heads, doc_tokens, shape.head_dim)
    device, dtype = base.decoder.device, base.decoder.dtype
    kv = torch.randn(kv_shape, generator=torch.Generator().manual_seed(0)).to(device)
    sources = _decode_sources(kv, labels, dtype)
    target = torch.empty(kv_shape, dtype=dtype, device=device)
    times = _time_placements(sources, target, rounds)
    rows: list[dict[str, Any]] = []
    for label, seconds in times.items():
        median = statistics.median(seconds[1:])
        rows.append(
            {
                "codec": label,
                "tokens": doc_tokens,
                "dtype": str(dtype).split(".")[-1],
                "median_ms": median * 1e3,
                "tok_s": doc_tokens / median,
                "ms": [t * 1e3 for t in seconds[1:]],
            }
        )
    copy = next((r["median_ms"] for r in rows if r["codec"] in ("fp16", "none")), None)
    for row in rows:
        row["vs_copy"] = row["median_ms"] / copy if copy else None
    return rows


def _decode_sources(kv: torch.Tensor, labels: Sequence[str], dtype: torch.dtype) -> dict[str, Any]:
    """Each codec's entry of ``kv`` as read from a store (``fp16``, ``none``: a plain tensor)."""
    sources: dict[str, Any] = {}
    for label in labels:
        if label in ("fp16", "none"):
            sources[label] = kv.to(torch.float16 if label == "fp16" else dtype)
            continue
        codec = kv_codec(label)
        sources[label] = codec.open(codec.encode(kv), tuple(kv.shape))
        if label == "k8v4":
            sources["k8v4 v1"] = K8V4_V1.open(K8V4_V1.encode(kv), tuple(kv.shape))
    return sources


def _time_placements(
    sources: dict[str, Any], target: torch.Tensor, rounds: int
) -> dict[str, list[float]]:
    """Time placing each source into ``target``, interleaved, ``rounds + 1`` times each."""
    device = target.device
    times: dict[str, list[float]] = {label: [] for label in sources}
    for _ in range(rounds + 1):  # the first round warms up and is not kept
        for label, source in sources.items():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            started = time.perf_counter()
            if isinstance(source, EncodedKV):
                source.place(target)
            else:
                target.copy_(source)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[label].append(time.perf_counter() - started)
    return times


def _close(tiers: dict[str, Any], folder: Path) -> None:
    for store in tiers.values():
        store.clear()
        store.close()
    shutil.rmtree(folder, ignore_errors=True)


def run_codec_ttft(
    base: BlendEngine,
    labels: Sequence[str],
    redis_url: str | None,
    *,
    length: int,
    doc_tokens: int,
    repeats: int,
    log: Any,
) -> list[dict]:
    """TTFT of the default blend, documents on a cold disk and in Redis, every codec interleaved."""
    from kvblend.bench.strategies import strategy

    folder = Path(tempfile.mkdtemp(prefix="kvblend-codec-ttft-"))
    tiers = {
        name: store
        for name, store in _tiers(folder, redis_url, base.decoder.device).items()
        if name in ("disk", "redis")
    }
    engines = {
        (tier, label): engine_for(base, label, store)
        for tier, store in tiers.items()
        for label in labels
    }
    documents = build_documents(base, length, doc_tokens, seed=length)
    segments = base.rag_segments(QUESTION, documents, system=SYSTEM)
    full, default = strategy("full"), strategy("default")
    rows = []
    try:
        for engine in engines.values():
            engine.precompute(documents, progress=False)
            engine.prefill(default.segments(segments), default.config)  # warm; stores the head
        memory = engine_for(base, "none", MemoryKVStore(1 << 30))
        for repeat in range(repeats):
            rows.append(
                {
                    "repeat": repeat,
                    "tier": "-",
                    "codec": "-",
                    "strategy": "full",
                    **time_prefill(memory, segments, full),
                }
            )
            for (tier, label), engine in engines.items():
                _make_cold(tiers[tier], folder)
                row = time_prefill(engine, segments, default)
                if row["segments_precomputed"]:
                    raise RuntimeError(f"{tier}/{label}: documents were computed, not read")
                rows.append(
                    {"repeat": repeat, "tier": tier, "codec": label, "strategy": "default", **row}
                )
            timed = ", ".join(
                f"{r['tier']}/{r['codec']} {r['ttft_s']:.2f}s"
                for r in rows
                if r["repeat"] == repeat
            )
            log(f"repeat {repeat + 1}/{repeats}: {timed}")
    finally:
        _close(tiers, folder)
    return rows


def ttft_summary(rows: Sequence[dict], labels: Sequence[str]) -> list[dict]:
    """Median TTFT per tier and codec, and the median per-repeat ratio to fp16's (and none's)."""
    full = statistics.median(r["ttft_s"] for r in rows if r["strategy"] == "full")
    out = []
    for tier in dict.fromkeys(r["tier"] for r in rows if r["tier"] != "-"):
        mine = {
            label: {r["repeat"]: r for r in rows if (r["tier"], r["codec"]) == (tier, label)}
            for label in labels
        }
        out += [_tier_codec(tier, label, mine, full) for label in labels]
    return out


def _tier_codec(tier: str, label: str, mine: dict[str, dict[int, dict]], full: float) -> dict:
    """Return one codec's medians from ``tier`` (``mine``: each codec's runs by repeat)."""
    runs = mine[label]
    entry = {
        "tier": tier,
        "codec": label,
        "ttft_median_s": statistics.median(r["ttft_s"] for r in runs.values()),
        "load_median_s": statistics.median(r["load_s"] or 0.0 for r in runs.values()),
        "ttft_vs_full": statistics.median(r["ttft_s"] for r in runs.values()) / full,
    }
    for reference in ("fp16", "none"):
        if reference in mine and reference != label:
            entry[f"vs_{reference}"] = statistics.median(
                runs[k]["ttft_s"] / mine[reference][k]["ttft_s"]
                for k in runs
                if k in mine[reference]
            )
    return entry


def codecs_report(result: dict[str, Any]) -> str:
    """Markdown of every part a run measured."""
    parts = [
        f"KV codecs, {result['machine']['model']}, {result['machine']['torch_threads']} "
        f"thread(s), {result['machine']['date']}"
    ]
    if "bytes" in result:
        lines = [
            "| shape | document tokens | codec | bytes per token | of fp16 |",
            "|---|---|---|---|---|",
        ]
        for r in result["bytes"]:
            lines.append(
                f"| {r['shape']} | {r['tokens']} | {r['codec']} | "
                f"{r['bytes_per_token']:,.0f} | {r['of_fp16']:.3f} |"
            )
        lines += ["", "| codec | entry file (512-token document) | of fp16 |", "|---|---|---|"]
        for r in result["entry_files"]:
            share = f"{r['of_fp16']:.3f}" if r["of_fp16"] else "-"
            lines.append(
                f"| {r['codec']} | {r['file_bytes']:,} B ({r['tokens']} tokens) | {share} |"
            )
        parts.append("\n".join(lines))
    if "throughput" in result:
        lines = [
            "| tier | codec | precompute tok/s | read and place tok/s | read MB/s (stored) |",
            "|---|---|---|---|---|",
        ]
        for r in result["throughput"]:
            lines.append(
                f"| {r['tier']} | {r['codec']} | {r['precompute_tok_s']:,.0f} | "
                f"{r['read_tok_s']:,.0f} | {r['read_mb_s']:,.0f} |"
            )
        parts.append("\n".join(lines))
    if "ttft_summary" in result:
        lines = [
            "| documents from | codec | TTFT median (s) | x full prefill | x fp16 | load (s) |",
            "|---|---|---|---|---|---|",
        ]
        for r in result["ttft_summary"]:
            vs = f"{r['vs_fp16']:.3f}" if "vs_fp16" in r else "-"
            lines.append(
                f"| {r['tier']} | {r['codec']} | {r['ttft_median_s']:.3f} | "
                f"{r['ttft_vs_full']:.3f} | {vs} | {r['load_median_s']:.3f} |"
            )
        parts.append("\n".join(lines))
    if "decode" in result:
        lines = [
            "| codec | buffer dtype | entry tokens | place, ms (median) | tok/s | x copy |",
            "|---|---|---|---|---|---|",
        ]
        for r in result["decode"]:
            vs = f"{r['vs_copy']:.2f}" if r["vs_copy"] else "-"
            lines.append(
                f"| {r['codec']} | {r['dtype']} | {r['tokens']} | "
                f"{r['median_ms']:.2f} | {r['tok_s']:,.0f} | {vs} |"
            )
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``kvblend bench codecs``."""
    from kvblend.bench.engines import load_engine
    from kvblend.bench.result_files import describe_machine, write_result

    args, parts, labels = _arguments(argv)
    base = load_engine(argparse.Namespace(**vars(args), doc_prefix="auto"), SYSTEM)
    if args.threads:  # as asked, whatever the load (an engine's default follows the load)
        use_threads(args.threads)
    result: dict[str, Any] = {
        "benchmark": "codecs",
        "machine": describe_machine(base),
        "codecs": labels,
        "parts": sorted(parts),
    }
    shape = base.decoder.shape
    if "bytes" in parts:
        model_shape = (str(base.name), shape.num_layers, shape.num_kv_heads, shape.head_dim)
        result["bytes"] = bytes_table_rows(labels, model_shape)
        with tempfile.TemporaryDirectory() as folder:
            result["entry_files"] = entry_files(base, labels, Path(folder))
    if parts & {"throughput", "ttft"}:
        result |= _tier_parts(base, labels, parts, args)
    if "decode" in parts:
        result["decode"] = run_decode(
            base, labels, doc_tokens=args.doc_tokens, rounds=10 * args.repeats
        )
    result["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    write_result(result, Path(args.output), codecs_report(result))


def _arguments(argv: list[str] | None) -> tuple[argparse.Namespace, set[str], list[str]]:
    """Parse ``kvblend bench codecs``' options: the options, the parts, the codecs' labels."""
    parser = argparse.ArgumentParser(
        prog="kvblend bench codecs", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--model", help="model folder, GGUF file or hub id (default: bundled)")
    parser.add_argument("--device", default="auto")
    parser.add_argument(
        "--dtype",
        default="auto",
        help="auto, float32, bf16, fp16 (default auto: the engine's default)",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    parser.add_argument("--parts", default="bytes,throughput,ttft")
    parser.add_argument("--codecs", default=",".join(LABELS))
    parser.add_argument("--length", type=int, default=4096, help="TTFT prompt tokens")
    parser.add_argument("--doc-tokens", type=int, default=512)
    parser.add_argument("--documents", type=int, default=8, help="throughput: documents")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--redis-url", help="a running server (default: start redis-server)")
    parser.add_argument("--no-redis", action="store_true", help="skip the Redis tier")
    parser.add_argument("--output", default=str(RESULTS_DIR / "codecs.json"))
    args = parser.parse_args(argv)
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    if parts - set(PARTS):
        parser.error(f"unknown part(s) {sorted(parts - set(PARTS))}; use {', '.join(PARTS)}")
    labels = [label.strip() for label in args.codecs.split(",") if label.strip()]
    for label in labels:
        if label != "fp16":
            kv_codec(label)  # an unknown name is refused before the model loads
    return args, parts, labels


def _tier_parts(
    base: BlendEngine, labels: list[str], parts: set[str], args: argparse.Namespace
) -> dict[str, Any]:
    """Run the parts that read the store tiers (Redis's too, unless ``--no-redis``)."""
    from kvblend.bench.speed.redis_ttft import redis_server

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    result: dict[str, Any] = {}
    server = contextlib.nullcontext(None) if args.no_redis else redis_server(args.redis_url)
    with server as redis_url:
        if "throughput" in parts:
            result["throughput"] = run_throughput(
                base,
                labels,
                redis_url,
                documents=args.documents,
                doc_tokens=args.doc_tokens,
                repeats=args.repeats,
                log=log,
            )
        if "ttft" in parts:
            rows = run_codec_ttft(
                base,
                labels,
                redis_url,
                length=args.length,
                doc_tokens=args.doc_tokens,
                repeats=args.repeats,
                log=log,
            )
            result["ttft_rows"], result["ttft_summary"] = rows, ttft_summary(rows, labels)
    return result
