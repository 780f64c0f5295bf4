"""Accuracy and KL of blending when documents are precomputed behind different contexts.

Usage: python benchmarks/doc_context.py [--questions 80] [--contexts bos,prefix,sys]
       [--configs reuse,cb15,cb15L2,cb30,epic16] [--model PATH]

``bos``: documents start the sequence (the engine's default); ``prefix``: behind the exact prefix
segment that ``BlendEngine.rag_segments`` builds; ``sys``: behind the chat template head only.
Writes benchmarks/results/doc_context.json (one row per question and setting).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from kvblend import BlendConfig, BlendEngine
from kvblend.bench.qa import generate_qa, score
from kvblend.bench.quality import STOP, kl_divergence, prompt_segments
from kvblend.store import MemoryKVStore

CONFIGS = {
    "reuse": BlendConfig("reuse"),
    "cb15": BlendConfig(recompute_ratio=0.15),
    "cb15L2": BlendConfig(recompute_ratio=0.15, check_layer=2),
    "cb20": BlendConfig(recompute_ratio=0.2),
    "cb20L2": BlendConfig(recompute_ratio=0.2, check_layer=2),
    "cb15L3": BlendConfig(recompute_ratio=0.15, check_layer=3),
    "cbg30to15": BlendConfig(ratio_schedule=((1, 0.3), (3, 0.15))),
    "cb30": BlendConfig(recompute_ratio=0.3),
    "cbk15": BlendConfig(recompute_ratio=0.15, deviation="key"),
    "att15": BlendConfig("attention", recompute_ratio=0.15),
    "att20": BlendConfig("attention", recompute_ratio=0.2),
    "att30": BlendConfig("attention", recompute_ratio=0.3),
    "epic4": BlendConfig("epic", epic_tokens=4),
    "epic8": BlendConfig("epic", epic_tokens=8),
    "epic16": BlendConfig("epic", epic_tokens=16),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--questions", type=int, default=80)
    parser.add_argument("--contexts", default="bos,prefix,sys")
    parser.add_argument("--configs", default="reuse,cb15,cb15L2,cb30,epic16")
    parser.add_argument("--output", default="benchmarks/results/doc_context.json")
    args = parser.parse_args()
    configs = args.configs.split(",")
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown config {unknown}; choose from {', '.join(CONFIGS)}")

    base = BlendEngine.from_pretrained(args.model, store=MemoryKVStore())
    items = generate_qa(max(240, args.questions))[: args.questions]
    prefix_text = prompt_segments(base, items[0])[0].text
    doc_prefixes = {"bos": None, "prefix": prefix_text, "sys": prefix_text.split("Documents:")[0]}
    engines = {}
    for name in args.contexts.split(","):
        if name not in doc_prefixes:
            parser.error(f"unknown context {name!r}; choose from {', '.join(doc_prefixes)}")
        engines[name] = BlendEngine(
            base.model, base.tokenizer, store=MemoryKVStore(), doc_prefix=doc_prefixes[name],
            name=base.name,
        )  # fmt: skip

    rows: list[dict] = []
    started = time.perf_counter()
    for index, item in enumerate(items):
        segments = prompt_segments(base, item)
        full = base.prefill(segments, BlendConfig("full"))
        full_answer = base.generate(full, max_new_tokens=12, stop=list(STOP)).text.strip()
        correct = score(full_answer, item.answers, item.wrong)
        rows.append({"qid": item.qid, "context": "-", "config": "full", "correct": correct,
                     "kl": 0.0, "recompute_fraction": 0.0, "answer": full_answer})  # fmt: skip
        for context, engine in engines.items():
            for name in configs:
                pre = engine.prefill(segments, CONFIGS[name])
                answer = engine.generate(pre, max_new_tokens=12, stop=list(STOP)).text.strip()
                rows.append({
                    "qid": item.qid, "context": context, "config": name,
                    "correct": score(answer, item.answers, item.wrong),
                    "kl": kl_divergence(full.logits, pre.logits),
                    "recompute_fraction": pre.stats.recompute_fraction, "answer": answer,
                })  # fmt: skip
        if (index + 1) % 20 == 0 or index + 1 == len(items):
            elapsed = time.perf_counter() - started
            print(f"[{index + 1}/{len(items)} in {elapsed:.0f} s]", file=sys.stderr)
            groups: dict[tuple[str, str], list[dict]] = {}
            for row in rows:
                groups.setdefault((row["context"], row["config"]), []).append(row)
            for (context, name), group in groups.items():
                accuracy = sum(r["correct"] for r in group) / len(group)
                kl = statistics.fmean(r["kl"] for r in group)
                recompute = statistics.fmean(r["recompute_fraction"] for r in group)
                print(f"  {context:7s} {name:8s} accuracy {accuracy:.1%}  KL {kl:.3f}  "
                      f"recomputed {recompute:.0%}", file=sys.stderr)  # fmt: skip
            Path(args.output).parent.mkdir(parents=True, exist_ok=True)
            Path(args.output).write_text(json.dumps({"questions": index + 1, "rows": rows}))


if __name__ == "__main__":
    main()
