"""The CPU loop's two attention paths for sparse rows, on the same real prompts: KL and time.

NQ-open questions with 10 retrieved passages (the prompts of ``kvblend bench nq``), each
prefilled in full, then by ``BlendConfig()`` with the rows attended by blocks of products
(``KVBLEND_ATTENTION=products``) and by SDPA's query chunks (``chunks``), in the same process on
the same stored documents. Per path: mean KL(full || blend) at the first answer token, how often
the blend's first token is full prefill's, the median prefill time; the paired difference of the
KLs with a 95% bootstrap interval, and the KL between the two paths' own logits.

    python scripts/attention_paths.py --data ../shared/data/nq_open_gold_2000.jsonl.gz \
        --questions 60 --skip 1900 [--model PATH] [--dtype bf16] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

from kvblend import BlendConfig, BlendEngine
from kvblend.bench.quality.nq import Retriever, load_nq
from kvblend.bench.quality.qa_bench import kl_divergence
from kvblend.bench.quality.shapes import shape_items

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PATHS = ("products", "chunks")


def main() -> None:
    """Run both paths on ``--questions`` questions after the first ``--skip``; print a summary."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--data", required=True, help="the NQ-open jsonl(.gz) file")
    parser.add_argument("--model", default=None, help="model folder, GGUF file or hub id")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--questions", type=int, default=60)
    parser.add_argument("--skip", type=int, default=1900, help="questions before the first one")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", help="write the per-question rows and the summary (json)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = BlendEngine.from_pretrained(args.model, dtype=DTYPES[args.dtype])
    corpus, questions = load_nq(args.data)
    retriever = Retriever(corpus, data_path=args.data)
    items = shape_items(engine, "nq-10", args.skip + args.questions, args.seed,
                        lambda: (corpus, questions, retriever))[args.skip :]  # fmt: skip
    rows = []
    for count, item in enumerate(items, start=1):
        engine.precompute(item.documents, progress=False)
        full = engine.prefill(item.segments, BlendConfig("full")).logits
        row: dict[str, object] = {"qid": item.qid}
        logits = {}
        for path in PATHS:
            os.environ["KVBLEND_ATTENTION"] = path
            began = time.perf_counter()
            pre = engine.prefill(item.segments, BlendConfig())
            row[f"{path}_s"] = time.perf_counter() - began
            logits[path] = pre.logits
            row[f"{path}_kl"] = kl_divergence(full, pre.logits)
            row[f"{path}_same_token"] = bool(pre.logits.argmax() == full.argmax())
        os.environ.pop("KVBLEND_ATTENTION")
        row["between_paths_kl"] = kl_divergence(logits["chunks"], logits["products"])
        row["prompt_tokens"] = pre.stats.prompt_tokens
        rows.append(row)
        print(f"[{count}/{len(items)}] {item.qid} {row['prompt_tokens']} tokens: " + ", ".join(
            f"{path} KL {row[f'{path}_kl']:.4f} in {row[f'{path}_s']:.2f} s" for path in PATHS
        ), file=sys.stderr, flush=True)  # fmt: skip
    summary = summarize(rows, args.seed)
    print(json.dumps(summary, indent=1))
    if args.output:
        with open(args.output, "w", encoding="utf-8") as file:
            json.dump({"command": " ".join(sys.argv), "threads": args.threads,
                       "summary": summary, "rows": rows}, file, indent=1)  # fmt: skip


def summarize(rows: list[dict], seed: int, resamples: int = 10_000) -> dict[str, object]:
    """Per path: mean KL, first-token agreement, median time; the paired KL difference's 95% CI."""
    kl = {path: np.array([row[f"{path}_kl"] for row in rows]) for path in PATHS}
    difference = kl["products"] - kl["chunks"]
    picks = np.random.default_rng(seed).integers(0, len(rows), (resamples, len(rows)))
    means = difference[picks].mean(axis=1)
    return {
        "n": len(rows),
        **{f"{path}_kl_mean": float(kl[path].mean()) for path in PATHS},
        **{
            f"{path}_same_first_token": float(np.mean([row[f"{path}_same_token"] for row in rows]))
            for path in PATHS
        },  # fmt: skip
        **{
            f"{path}_median_s": statistics.median(row[f"{path}_s"] for row in rows)
            for path in PATHS
        },  # fmt: skip
        "kl_difference": float(difference.mean()),
        "kl_difference_ci": [float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))],
        "between_paths_kl_mean": float(np.mean([row["between_paths_kl"] for row in rows])),
    }


if __name__ == "__main__":
    main()
