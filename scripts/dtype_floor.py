"""Full prefill in bfloat16 against full prefill in float32 on the same NQ prompts: KL, first token.

How far a prefill that only rounds differently is from float32's full prefill, at the first answer
token: the floor under the figures a blend is measured by (mean KL to full prefill, its first
token). The prompts are `kvblend bench shapes`' ``nq-10`` (ten retrieved passages, the gold one
among them; ``--shape`` another), both engines over the same model and tokenizer, one thread.
``--rounding``: the bfloat16 prefill's products ``emulated`` (float32 products of bfloat16
values, rounded: `kvblend.bench.quality.rounding`), ``native`` (torch's bfloat16 kernels), or
``both`` (each row gets both, and the KL between them).

    python scripts/dtype_floor.py --data ../shared/data/nq_open_gold_2000.jsonl.gz \
        --questions 100 [--skip 0] [--model PATH] [--rounding both] [--output FILE]
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
from kvblend.bench.quality.rounding import ROUNDINGS, RoundedPrefill
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
    parser.add_argument(
        "--rounding",
        default="native",
        choices=(*ROUNDINGS, "both"),
        help="the bfloat16 products: emulated, native, or both (default native)",
    )
    parser.add_argument("--output", help="write the per-question rows and the summary (json)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    reference = BlendEngine.from_pretrained(args.model, dtype=torch.float32)
    roundings = ROUNDINGS if args.rounding == "both" else (args.rounding,)
    rounded = {name: RoundedPrefill(reference, name) for name in roundings}
    corpus, questions = load_nq(args.data)
    retriever = Retriever(
        corpus, data_path=args.data, cache_dir=Path(args.cache_dir) if args.cache_dir else None
    )
    items = shape_items(reference, args.shape, args.skip + args.questions, args.seed,
                        lambda: (corpus, questions, retriever))[args.skip :]  # fmt: skip
    rows = []
    for count, item in enumerate(items, start=1):
        exact = reference.prefill(item.segments, BlendConfig("full"))
        first = exact.logits.float()
        row: dict = {"qid": item.qid}
        logits = {}
        for name, engine in rounded.items():
            other = engine.prefill(item.segments)
            if exact.token_ids != other.token_ids:
                raise RuntimeError(f"{item.qid}: the two engines read other token ids")
            logits[name] = other.logits.float()
            suffix = "" if name == roundings[0] else f"_{name}"
            row["kl" + suffix] = kl_divergence(first, logits[name])
            row["top1_agrees" + suffix] = int(first.argmax()) == int(logits[name].argmax())
        if len(logits) == 2:
            row["kl_between"] = kl_divergence(logits["native"], logits["emulated"])
        rows.append(row)
        print(f"{count}/{len(items)} {item.qid}: " + ", ".join(
            f"{key} {value:.5f}" for key, value in row.items() if key.startswith("kl")),
            flush=True)  # fmt: skip
    kls = [row["kl"] for row in rows]
    picks = np.random.default_rng(args.seed).integers(0, len(kls), (2000, len(kls)))
    means = np.asarray(kls)[picks].mean(axis=1)
    summary = {
        "model": reference.name, "questions": len(rows), "skip": args.skip,
        "mean_kl": statistics.mean(kls),
        "mean_kl_ci": [float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))],
        "median_kl": statistics.median(kls),
        "top1_agreement": sum(row["top1_agrees"] for row in rows) / len(rows),
        "rounding": roundings[0],
    }  # fmt: skip
    for name in roundings[1:]:
        other = [row[f"kl_{name}"] for row in rows]
        summary[f"mean_kl_{name}"] = statistics.mean(other)
        summary[f"mean_kl_{name}_minus_{roundings[0]}_ci"] = paired_interval(kls, other, args.seed)
        summary[f"top1_agreement_{name}"] = sum(row[f"top1_agrees_{name}"] for row in rows) / len(
            rows
        )
    if len(roundings) == 2:
        summary["mean_kl_between"] = statistics.mean(row["kl_between"] for row in rows)
    print(json.dumps(summary))
    if args.output:
        with open(args.output, "w", encoding="utf-8") as handle:
            json.dump({"command": "python scripts/dtype_floor.py", **vars(args),
                       "summary": summary, "rows": rows}, handle, indent=1)  # fmt: skip


def paired_interval(first: list[float], second: list[float], seed: int) -> list[float]:
    """95% bootstrap interval of mean(second) - mean(first) over the same questions."""
    difference = np.asarray(second) - np.asarray(first)
    picks = np.random.default_rng(seed).integers(0, len(difference), (2000, len(difference)))
    means = difference[picks].mean(axis=1)
    return [float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))]


if __name__ == "__main__":
    main()
