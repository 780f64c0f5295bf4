"""Throughput of batched requests: 4 prompts generated one by one vs `BlendEngine.generate_batch`.

Each prompt is a chat RAG prompt over three of five precomputed corpus documents (the
LangChain tests' corpus), in another order per prompt; the documents' KV is reused. Both ways
run the same blended prefills; the batch decodes the four answers in one transformers
`generate`. The same through LangChain: `ChatBlend.batch` vs one `invoke` per prompt. Greedy
outputs are checked equal. Repeats alternate the ways. Writes ``batch.json``
and ``batch.md``.

    kvblend bench batch [--repeats 3] [--max-new-tokens 48] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from kvblend import BlendConfig, BlendEngine
from kvblend.bench.result_files import RESULTS_DIR
from kvblend.store import MemoryKVStore

CORPUS = [
    "Marta Quill is a painter. She lives in Lisbon, in a small yellow house near the river. "
    "She has two cats named Pip and Mo.",
    "Tomas Reed is a baker. His shop on Elm Street sells bread and cakes. "
    "He gets up at four o'clock every morning.",
    "The Orion Cafe is on Market Square. It opens at 7 am and closes at 6 pm. "
    "Its most popular dish is apple pie.",
    "Lena Park is a music teacher. She rides a red bicycle to school every day "
    "and plays the violin.",
    "The river Vell flows into Lake Amber. Fishermen catch trout in the lake during the summer.",
]
QUESTIONS = [
    "Where does Marta Quill live?",
    "When does Tomas Reed get up?",
    "What is the Orion Cafe's most popular dish?",
    "What does Lena Park ride to school?",
]


def prompts(engine: BlendEngine) -> list[str]:
    """Return the chat RAG prompts: three of the corpus documents each, in turn, and a question."""
    out = []
    for i, question in enumerate(QUESTIONS):
        docs = [CORPUS[(i + j) % len(CORPUS)] for j in range(3)][::-1]
        user = "Documents:\n\n" + "\n\n".join(docs) + f"\n\nQuestion: {question}"
        out.append(engine.apply_chat_template([{"role": "user", "content": user}]))
    return out


def langchain_chat(engine: BlendEngine, config: BlendConfig, max_new_tokens: int) -> Any:
    """`ChatBlend` on the engine and the four user turns, or ``(None, [])`` without LangChain."""
    try:
        from kvblend.langchain import ChatBlend
    except ImportError:
        return None, []
    chat = ChatBlend(engine=engine, blend_config=config, max_tokens=max_new_tokens)
    questions = []
    for i, question in enumerate(QUESTIONS):
        docs = [CORPUS[(i + j) % len(CORPUS)] for j in range(3)][::-1]
        questions.append("Documents:\n\n" + "\n\n".join(docs) + f"\n\nQuestion: {question}")
    return chat, questions


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark: ``kvblend bench batch [options]``."""
    parser = argparse.ArgumentParser(
        prog="kvblend bench batch", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = BlendEngine.from_pretrained(args.model, store=MemoryKVStore(), threads=args.threads)
    engine.precompute(CORPUS, progress=False)
    texts = prompts(engine)
    config = BlendConfig(min_recompute=0)  # the short documents blend (not full prefill)
    options = {"max_new_tokens": args.max_new_tokens}
    engine.generate_batch(texts[:2], config, **options)  # warm-up
    times: dict[str, list[float]] = {"sequential": [], "batched": []}
    chat, questions = langchain_chat(engine, config, args.max_new_tokens)
    if chat is not None:
        times |= {"ChatBlend.invoke x4": [], "ChatBlend.batch": []}
    tokens = {}
    for _ in range(args.repeats):
        if chat is not None:
            _time_chat(chat, questions, times)
        tokens = _time_engine(engine, texts, config, options, times)
    report = {
        "model": str(engine.name),
        "device": str(engine.decoder.device) if hasattr(engine.decoder, "device") else "cpu",
        "threads": args.threads,
        "requests": len(texts),
        "max_new_tokens": args.max_new_tokens,
        **tokens,
    }
    _add_rates(report, times, len(texts), chat is not None)
    _write_report(report, times, args)


def _time_chat(chat: Any, questions: list[str], times: dict[str, list[float]]) -> None:
    """Time the questions through ``ChatBlend.invoke`` one by one, then ``ChatBlend.batch``."""
    started = time.perf_counter()
    one_by_one = [chat.invoke(question) for question in questions]
    times["ChatBlend.invoke x4"].append(time.perf_counter() - started)
    started = time.perf_counter()
    if [m.text for m in chat.batch(questions)] != [m.text for m in one_by_one]:
        raise SystemExit("ChatBlend.batch answers differ from the one-by-one answers")
    times["ChatBlend.batch"].append(time.perf_counter() - started)


def _time_engine(
    engine: BlendEngine,
    texts: list[str],
    config: BlendConfig,
    options: dict[str, Any],
    times: dict[str, list[float]],
) -> dict[str, int]:
    """Time the prompts one by one, then in one batch; return the batch's token counts."""
    started = time.perf_counter()
    one = [engine.generate(text, config, **options) for text in texts]
    times["sequential"].append(time.perf_counter() - started)
    started = time.perf_counter()
    many = engine.generate_batch(texts, config, **options)
    times["batched"].append(time.perf_counter() - started)
    if [r.token_ids for r in one] != [r.token_ids for r in many]:
        raise SystemExit("batched greedy outputs differ from the one-by-one outputs")
    return {
        "output_tokens": sum(len(r.token_ids) for r in many),
        "reused_tokens": sum(r.stats.reused_tokens for r in many),
        "prompt_tokens": sum(r.stats.prompt_tokens for r in many),
    }


def _add_rates(
    report: dict[str, Any], times: dict[str, list[float]], requests: int, chat: bool
) -> None:
    """Add each way's times, rates and the speedups to ``report``."""
    for way, seconds in times.items():
        median = statistics.median(seconds)
        report[way] = {
            "seconds": [round(s, 3) for s in seconds],
            "median_s": round(median, 3),
            "requests_per_s": round(requests / median, 3),
            "output_tokens_per_s": round(report["output_tokens"] / median, 1),
        }
    report["speedup"] = round(report["sequential"]["median_s"] / report["batched"]["median_s"], 2)
    if chat:
        report["langchain_speedup"] = round(
            report["ChatBlend.invoke x4"]["median_s"] / report["ChatBlend.batch"]["median_s"], 2
        )


def _write_report(
    report: dict[str, Any], times: dict[str, list[float]], args: argparse.Namespace
) -> None:
    """Write ``batch.json`` and ``batch.md`` into the results folder; print the table."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "batch.json").write_text(json.dumps(report, indent=2) + "\n")
    rows = [
        "| way | median s | requests/s | output tokens/s |",
        "|---|---|---|---|",
        *(
            f"| {way} | {report[way]['median_s']} | {report[way]['requests_per_s']} | "
            f"{report[way]['output_tokens_per_s']} |"
            for way in times
        ),
    ]
    header = (
        f"{report['requests']} requests, {report['model']}, {args.threads} thread(s), "
        f"{args.max_new_tokens} new tokens at most ({report['output_tokens']} generated), "
        f"{args.repeats} repeats; batched is {report['speedup']}x sequential"
        + (
            f", ChatBlend.batch {report['langchain_speedup']}x"
            if "langchain_speedup" in report
            else ""
        )
        + "\n\n"
    )
    (RESULTS_DIR / "batch.md").write_text(header + "\n".join(rows) + "\n")
    print(header + "\n".join(rows))


if __name__ == "__main__":
    main()
