"""The GPU benchmark: one run gives every figure the GPU path is judged by.

TTFT of ``full``, the default, ``cacheblend-value-0.15`` and ``reuse`` at 2K, 4K, 8K and 16K
prompt tokens, with the documents in memory and read from a cold disk tier (`run_ttft`, runs
interleaved), decode tokens/s after a full prefill and after the default, peak GPU memory of
every timed prefill (``torch.cuda.max_memory_allocated``, from `PeakMemory`) and of the whole
run, and documents/s of precompute, one by one vs batched (`run_ingest`). Nothing here is
specific to a GPU model: it runs unchanged on any CUDA machine, and on the CPU
(``--device cpu --lengths 1024 --dtype float32``) as a smoke test of the same code path.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from ..engine import BlendEngine
from .ingest import ingest_table, run_ingest
from .strategies import parse_strategies
from .ttft import run_ttft, ttft_table

DEFAULT_LENGTHS = "2048,4096,8192,16384"
DEFAULT_STRATEGIES = "full,default,cacheblend-value-0.15,reuse"


def add_gpu_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``kvblend bench gpu`` (the model options are added by the caller)."""
    parser.set_defaults(device="cuda", dtype="bf16")
    parser.add_argument("--lengths", default=DEFAULT_LENGTHS, help="prompt tokens, comma list")
    parser.add_argument("--strategies", default=DEFAULT_STRATEGIES, help="comma list")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--doc-tokens", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=32, help="0 to skip decode speed")
    parser.add_argument("--no-disk", action="store_true", help="skip the cold-disk runs")
    parser.add_argument("--ingest-documents", type=int, default=None,
                        help="documents of the precompute timing (default 64 on a GPU, 4 on "
                             "the CPU; 0 to skip it)")  # fmt: skip
    parser.add_argument("--batch-tokens", default="4096,16384",
                        help="token budgets of the batched precompute runs")  # fmt: skip
    parser.add_argument("--output", default="benchmarks/results/gpu.json")


def parse_lengths(text: str) -> list[int]:
    """Prompt lengths from a comma list; each a positive integer."""
    try:
        lengths = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--lengths must be a comma list of integers, got {text!r}") from None
    if not lengths or min(lengths) < 1:
        raise ValueError(f"--lengths must list positive token counts, got {text!r}")
    return lengths


def run_gpu(engine: BlendEngine, args: argparse.Namespace) -> dict[str, Any]:
    """Run the TTFT and ingestion parts on ``engine``'s device; return both and peak memory."""
    device = engine.decoder.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    ttft = run_ttft(
        engine, lengths=parse_lengths(args.lengths), strategies=parse_strategies(args.strategies),
        repeats=args.repeats, doc_tokens=args.doc_tokens, disk=not args.no_disk,
        disk_strategies=None, decode_tokens=args.decode_tokens, seed=args.seed,
    )  # fmt: skip
    documents = args.ingest_documents
    if documents is None:
        documents = 64 if device.type == "cuda" else 4
    ingest = None
    if documents > 0:
        ingest = run_ingest(
            engine, documents=documents, doc_tokens=args.doc_tokens,
            batch_tokens=parse_lengths(args.batch_tokens), repeats=args.repeats,
            seed=args.seed,
        )  # fmt: skip
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    return {
        "benchmark": "gpu",
        "elapsed_s": time.perf_counter() - started,
        "peak_gpu_mib": peak,
        "ttft": ttft,
        "ingest": ingest,
    }


def gpu_table(result: dict[str, Any]) -> str:
    """Markdown of a GPU run: the TTFT table, then ingestion."""
    peak = result["peak_gpu_mib"]
    parts = [
        "Peak GPU memory of the whole run: "
        + (f"{peak:.0f} MiB" if peak is not None else "n/a (not a CUDA device)"),
        "",
        ttft_table(result["ttft"]["summary"]),
    ]
    if result["ingest"] is not None:
        parts += ["", ingest_table(result["ingest"])]
    return "\n".join(parts)
