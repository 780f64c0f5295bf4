"""Full prefill in bfloat16 against full prefill in float32 on the same NQ prompts: KL, first token.

How far a prefill that only rounds differently is from float32's full prefill, at the first answer
token: the floor under the figures a blend is measured by (mean KL to full prefill, its first
token). The prompts are `kvblend bench shapes`' ``nq-10`` (ten retrieved passages, the gold one
among them; ``--shape`` another), both engines over the same model and tokenizer, one thread.

    python scripts/dtype_floor.py --data ../shared/data/nq_open_gold_2000.jsonl.gz \
        --questions 100 [--skip 0] [--model PATH] [--output FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np
import torch

from kvblend import BlendConfig, BlendEngine
from kvblend.bench.quality.nq import Retriever, load_nq
from kvblend.bench.quality.qa_bench import kl_divergence
from kvblend.bench.quality.shapes import shape_items


def main() -> None:
    """Prefill every prompt in both dtypes; print the mean KL and the first tokens' agreement."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--data", required=True, help="the NQ-open jsonl(.gz) file")
    parser.add_argument("--model", default=None, help="model folder, GGUF file or hub id")
    parser.add_argument("--questions", type=int, default=100)
    parser.add_argument("--skip", type=int, default=0, help="questions before the first one")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shape", default="nq-10", help="a `kvblend bench shapes` NQ shape")
    parser.add_argument("--cache-dir", help="corpus embeddings cache (default: kvblend's)")
    parser.add_argument("--output", help="write the per-question rows and the summary (json)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    reference = BlendEngine.from_pretrained(args.model, dtype=torch.float32)
    rounded = BlendEngine.from_pretrained(args.model, dtype=torch.bfloat16)
    corpus, questions = load_nq(args.data)
    retriever = Retriever(
        corpus, data_path=args.data, cache_dir=Path(args.cache_dir) if args.cache_dir else None
    )
    items = shape_items(reference, args.shape, args.skip + args.questions, args.seed,
                        lambda: (corpus, questions, retriever))[args.skip :]  # fmt: skip
    rows = []
    for count, item in enumerate(items, start=1):
        exact = reference.prefill(item.segments, BlendConfig("full"))
        other = rounded.prefill(item.segments, BlendConfig("full"))
        if exact.token_ids != other.token_ids:
            raise RuntimeError(f"{item.qid}: the two engines read other token ids")
        first, second = exact.logits.float(), other.logits.float()
        rows.append({"qid": item.qid, "kl": kl_divergence(first, second),
                     "top1_agrees": int(first.argmax()) == int(second.argmax())})  # fmt: skip
        print(f"{count}/{len(items)} {item.qid}: KL {rows[-1]['kl']:.5f}", flush=True)
    kls = [row["kl"] for row in rows]
    picks = np.random.default_rng(args.seed).integers(0, len(kls), (2000, len(kls)))
    means = np.asarray(kls)[picks].mean(axis=1)
    summary = {
        "model": reference.name, "questions": len(rows), "skip": args.skip,
        "mean_kl": statistics.mean(kls),
        "mean_kl_ci": [float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))],
        "median_kl": statistics.median(kls),
        "top1_agreement": sum(row["top1_agrees"] for row in rows) / len(rows),
    }  # fmt: skip
    print(json.dumps(summary))
    if args.output:
        with open(args.output, "w", encoding="utf-8") as handle:
            json.dump({"command": "python scripts/dtype_floor.py", **vars(args),
                       "summary": summary, "rows": rows}, handle, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
