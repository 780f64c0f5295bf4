"""Decode speed from the static cache vs the dynamic one, after the same prefill.

For each prompt length, one full prefill of synthetic prose; then `engine.generate` from that
prefill with ``KVBLEND_DECODE_CACHE=static`` and ``=dynamic``, alternated in every repeat.
Decode tokens/s is the tokens after the first over the time after the first (the cache's
construction included); greedy outputs are checked equal. Writes ``decode.json`` and
``decode.md`` into the results folder (``kvblend-bench/``, see `kvblend.bench.result_files`).

    kvblend bench decode [--lengths 512,2048,4096] [--tokens 32] [--repeats 5] [--threads 1]
        [--device cuda] [--output-dir DIR]

With ``KVBLEND_DECODE_COMPILE=1`` on CUDA the static cache's decode step is compiled (the
results' ``meta.compiled``); the dynamic cache never is. ``--model-shape NAME`` (a shape of
`kvblend.bench.gpu.random_models`, with ``--tokenizer FOLDER`` or ``--model``'s tokenizer) times
random weights: speed needs no trained weights, but their near-even logits can break greedy
ties differently in the two caches, so there unequal outputs are recorded
(``outputs_equal``), not an error.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path
from typing import Any

import torch

from kvblend import BlendConfig, BlendEngine
from kvblend.bench.gpu.figures import shape_tokenizer
from kvblend.bench.gpu.random_models import MODEL_SHAPES, random_model
from kvblend.bench.result_files import RESULTS_DIR
from kvblend.bench.speed.synthetic import synthetic_text
from kvblend.decoding.cache import CACHE_ENV, COMPILE_ENV, KINDS
from kvblend.models.loading import resolve_device, resolve_dtype
from kvblend.store import MemoryKVStore


def decode_rate(engine: BlendEngine, pre: Any, kind: str, tokens: int) -> tuple[float, list[int]]:
    """Tokens/s after the first token, decoding ``pre`` from a ``kind`` cache."""
    os.environ[CACHE_ENV] = kind
    out = engine.generate(pre, max_new_tokens=tokens)
    if out.output_tokens < 2:
        raise SystemExit(f"the answer ended at its first token after {len(pre.token_ids)} tokens")
    return (out.output_tokens - 1) / (out.total_s - out.ttft_s), out.token_ids


def run(
    engine: BlendEngine, lengths: list[int], tokens: int, repeats: int, exact: bool = True
) -> list[dict]:
    """One row per length; ``exact``: unequal greedy outputs of the two caches are an error."""
    rows = []
    for length in lengths:
        prose = synthetic_text(engine.tokenizer, length, seed=length)
        pre = engine.prefill([prose, "\nContinue the story:"], BlendConfig("full"))
        rates: dict[str, list[float]] = {kind: [] for kind in KINDS}
        outputs: dict[str, list[int]] = {}
        for _ in range(repeats):
            for kind in KINDS:
                rate, outputs[kind] = decode_rate(engine, pre, kind, tokens)
                rates[kind].append(rate)
        equal = outputs["static"] == outputs["dynamic"]
        if exact and not equal:
            raise SystemExit(f"the caches decoded different tokens at {length} tokens")
        row: dict[str, Any] = {
            "prompt_tokens": len(pre.token_ids),
            "decoded": len(outputs["static"]),
            "outputs_equal": equal,
        }
        row |= {f"{kind}_tok_s": statistics.median(rates[kind]) for kind in KINDS}
        row["static_over_dynamic"] = row["static_tok_s"] / row["dynamic_tok_s"]
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    """Return the markdown table of the rows."""
    lines = [
        "| prompt | tokens decoded | dynamic tok/s | static tok/s | static / dynamic |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['prompt_tokens']} | {row['decoded']} | {row['dynamic_tok_s']:.2f} | "
            f"{row['static_tok_s']:.2f} | {row['static_over_dynamic']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def shaped_engine(shape: str, model: str | None, tokenizer: str | None, device: str) -> Any:
    """Return an engine over random weights of ``shape`` on ``device`` (bf16 on CUDA, else fp32)."""
    chosen = resolve_device(device)
    words = shape_tokenizer(model, tokenizer)
    weights = random_model(shape, words, chosen, resolve_dtype(None, chosen))
    return BlendEngine(weights, words, store=MemoryKVStore(), name=f"{shape} (random weights)")


def results(engine: BlendEngine, args: argparse.Namespace, rows: list[dict]) -> dict[str, Any]:
    """Return the JSON written: the settings (``meta``; ``compiled`` as decoding ran), rows."""
    compiled = os.environ.get(COMPILE_ENV, "0").strip() == "1"
    meta = {
        "model": engine.name,
        "device": str(engine.decoder.device),
        "threads": args.threads,
        "repeats": args.repeats,
        "tokens": args.tokens,
        "model_shape": getattr(args, "model_shape", None),
        "compiled": compiled and engine.decoder.device.type == "cuda",
    }
    return {"meta": meta, "rows": rows}


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark: ``kvblend bench decode [options]``."""
    parser = argparse.ArgumentParser(
        prog="kvblend bench decode", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--lengths", default="512,2048,4096")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per answer")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model", default=None, help="default: KVBLEND_MODEL or the bundled one")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--name", default="decode", help="results file name (without suffix)")
    parser.add_argument(
        "--output-dir", type=Path, default=RESULTS_DIR, help="folder of the results"
    )
    parser.add_argument(
        "--model-shape",
        choices=sorted(MODEL_SHAPES),
        default=None,
        help="random weights of this shape instead of --model",
    )
    parser.add_argument("--tokenizer", default=None, help="with --model-shape: tokenizer folder")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.model_shape:
        engine = shaped_engine(args.model_shape, args.model, args.tokenizer, args.device)
    else:
        engine = BlendEngine.from_pretrained(
            args.model, MemoryKVStore(), device=args.device, threads=args.threads
        )
    lengths = [int(x) for x in args.lengths.split(",")]
    rows = run(engine, lengths, args.tokens, args.repeats, exact=args.model_shape is None)
    result = results(engine, args, rows)
    rows = result["rows"]
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.output_dir / f"{args.name}.md").write_text(table(rows))
    print(table(rows))


if __name__ == "__main__":
    main()
