"""Where a blended prefill's time goes on the CPU: the torch profiler's op table, blend and full.

Stored documents of about ``--doc-tokens`` tokens (`kvblend.bench.speed.synthetic`), placed in
another order than stored between a head and a question, prefilled by ``BlendConfig()`` and by
full prefill (median of ``--repeats``, 3, each after one warm-up), then one profiled run of each:

    python scripts/profile_blend.py --dtype fp32 --threads 1 [--model PATH] [--documents 8]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

import kvblend.blend.attention.rows as row_attention
from kvblend import BlendConfig, BlendEngine, Segment
from kvblend.bench.speed.synthetic import synthetic_text
from kvblend.store import MemoryKVStore

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def main() -> None:
    """Profile one blend and one full prefill of the same prompt; print both op tables."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--model", default=None, help="model folder, GGUF file or hub id")
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--documents", type=int, default=8)
    parser.add_argument("--doc-tokens", type=int, default=480)
    parser.add_argument("--rows", type=int, default=25, help="op rows printed per table")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each (median)")
    parser.add_argument("--warmups", type=int, default=1, help="untimed runs of each first")
    args = parser.parse_args()
    engine = BlendEngine.from_pretrained(
        args.model, store=MemoryKVStore(), dtype=DTYPES[args.dtype], threads=args.threads
    )
    docs = [
        synthetic_text(engine.tokenizer, args.doc_tokens, seed=i) for i in range(args.documents)
    ]
    for doc in docs:
        engine.precompute(doc)
    order = docs[:]
    random.Random(1).shuffle(order)
    segments = [
        Segment("You answer from the documents.\n", cache=False),
        *[Segment(doc + "\n") for doc in order],
        Segment("Question: what is the main topic of the third document?\nAnswer:", cache=False),
    ]

    def timed(config: BlendConfig) -> float:
        began = time.perf_counter()
        engine.prefill(segments, config)
        return time.perf_counter() - began

    configs = {"blend": BlendConfig(), "full": BlendConfig("full")}
    for config in configs.values():
        for _ in range(args.warmups):
            timed(config)
    seconds = {
        name: statistics.median(timed(config) for _ in range(args.repeats))
        for name, config in configs.items()
    }
    # the pieces the eager CPU loop attends by (query chunks, or blocks of products in bf16),
    # once per pass: (begin, end, first key, key end) and the rows' positions
    planned: list[tuple[list[tuple[int, int, int, int]], np.ndarray]] = []
    query_chunks, product_blocks = row_attention.query_chunks, row_attention.product_blocks

    def chunks_recorded(lower: np.ndarray, upper: np.ndarray, *rest: object) -> list:
        chunks = query_chunks(lower, upper, *rest)  # type: ignore[arg-type]
        planned.append(([tuple(c) for c in chunks], upper.copy()))
        return chunks

    def blocks_recorded(lower: np.ndarray, upper: np.ndarray) -> list:
        blocks = product_blocks(lower, upper)
        planned.append(([(b.begin, b.end, 0, b.key_end) for b in blocks], upper.copy()))
        return blocks

    row_attention.query_chunks = chunks_recorded
    row_attention.product_blocks = blocks_recorded
    stats = engine.prefill(segments, configs["blend"]).stats
    row_attention.query_chunks, row_attention.product_blocks = query_chunks, product_blocks
    print(
        f"{stats.prompt_tokens} prompt tokens, {args.dtype}, {torch.get_num_threads()} thread(s): "
        f"full {seconds['full']:.3f} s, BlendConfig() {seconds['blend']:.3f} s "
        f"({seconds['blend'] / seconds['full']:.2f}), compute {stats.compute_fraction:.2f}"
    )
    per_layer = stats.prompt_tokens * (stats.prompt_tokens + 1) / 2  # full prefill's pairs
    computed = sum(
        (end - begin) * (key_end - key_begin)
        for pieces, _ in planned
        for begin, end, key_begin, key_end in pieces
    )
    needed = sum(float((upper.astype(np.int64) + 1).sum()) for _, upper in planned)
    if planned:
        rows = planned[-1][1]
        print(
            f"the blend's query-key pairs per layer: {computed / per_layer:.2f} of full prefill's "
            f"computed, {needed / per_layer:.2f} needed; its last pass's {rows.size} rows sit at "
            f"{rows.mean() / stats.prompt_tokens:.2f} of the prompt on average"
        )
    else:
        print("the blend's query-key pairs: no sparse rows (every row or a dense path computed)")
    for name, config in configs.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            engine.prefill(segments, config)
        print(f"\n{name}:")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
