"""Prompt handling cost: tokenizing and matching a string prompt vs the tokenizer alone.

A string prompt is planned by finding the known documents in it (`DocumentRegistry.find`),
getting the tokenizer's ids and offsets of the whole text (`prompt_tokens`: the text between
documents tokenized, the documents' memoised tokens spliced in where the tokenizer's rules
prove it exact, else the whole text), and locating every document's cached tokens in that
sequence (`plan_prefill`, over memoised per-document layouts). ``kvblend bench plan`` times that
(`BlendEngine.plan`) against ``tokenizer(prompt)`` on the same chat-formatted RAG prompt,
documents precomputed, medians of interleaved repeats. The documents are synthetic prose, or
with ``--nq`` real NQ passages in the "Lost in the Middle" prompt (`kvblend.bench.quality.nq`).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from kvblend.bench.speed.synthetic import synthetic_text
from kvblend.engine.engine import BlendEngine
from kvblend.prompt.splice import splice_rules

SYSTEM = "You are a helpful assistant. Answer using the documents."


def tokenizer_engine(tokenizer: Any) -> BlendEngine:
    """Build an engine over ``tokenizer`` and a tiny random Llama with a 64K-token window.

    Planning never runs the model, so its size does not matter; the window does (12K-token
    prompts are longer than the bundled model's).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvblend.store import MemoryKVStore

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=65536,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    return BlendEngine(
        model, tokenizer, store=MemoryKVStore(), system_prompt=SYSTEM, check_parity=False
    )


def rag_prompt_string(engine: BlendEngine, documents: list[str], question: str) -> str:
    """Return the chat-formatted RAG prompt over ``documents`` as one string."""
    segments = engine.rag_segments(question, documents, system=SYSTEM)
    return "".join(segment.text for segment in segments)


def synthetic_prompt(engine: BlendEngine, prompt_tokens: int, doc_tokens: int) -> list[str]:
    """Documents of ``doc_tokens`` synthetic tokens filling ``prompt_tokens``; the prompt last."""
    count = max(1, prompt_tokens // doc_tokens)
    documents = [synthetic_text(engine.tokenizer, doc_tokens, 7000 + i) for i in range(count)]
    prompt = rag_prompt_string(engine, documents, "Which document mentions the harbour?")
    return [*documents, prompt]


def nq_prompt(engine: BlendEngine, path: str | Path, prompt_tokens: int) -> list[str]:
    """NQ passages filling about ``prompt_tokens`` in the paper's prompt; the prompt last.

    The passages are the data file's first ones, labelled ``Document [i](Title: ...)``, under
    its first question (`kvblend.bench.quality.nq.nq_segments`).
    """
    from kvblend.bench.quality.nq import load_nq, nq_segments

    corpus, questions = load_nq(path)
    chosen, tokens = [], 0
    for passage in corpus:
        if tokens >= prompt_tokens:
            break
        chosen.append(passage)
        tokens += len(engine.tokenize(passage.text)) + 12  # and its label
    segments = nq_segments(engine.tokenizer, questions[0].question, chosen)
    documents = [s.text for s in segments if s.cache and s.role == "document"]
    return [*documents, "".join(segment.text for segment in segments)]


def run_planning(
    engine: BlendEngine,
    prompt_tokens: int,
    doc_tokens: int,
    repeats: int,
    nq: str | Path | None = None,
) -> dict[str, Any]:
    """Time ``tokenizer(prompt)`` and ``engine.plan(prompt)``; return medians and their ratio.

    ``nq``: an NQ jsonl(.gz) whose passages are the documents (else synthetic ones).
    """
    if nq is None:
        *documents, prompt = synthetic_prompt(engine, prompt_tokens, doc_tokens)
    else:
        *documents, prompt = nq_prompt(engine, nq, prompt_tokens)
    engine.register(documents)
    engine.plan(prompt)  # every document's layout memoised, as after its first use
    tokenizer_s, plan_s = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        engine.tokenizer(prompt)
        tokenizer_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        plan = engine.plan(prompt)
        plan_s.append(time.perf_counter() - started)
    found = sum(1 for row in plan.report if row.role == "document" and row.reused)
    tokenizer_median, plan_median = statistics.median(tokenizer_s), statistics.median(plan_s)
    return {
        "prompt_tokens": len(plan.token_ids),
        "documents": len(documents),
        "documents_found": found,
        "spliced": splice_rules(engine.tokenizer) is not None,
        "tokenizer_s": tokenizer_median,
        "plan_s": plan_median,
        "ratio": plan_median / tokenizer_median,
        "ratio_of_minimums": min(plan_s) / min(tokenizer_s),
    }


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvblend bench plan`` (the model options are added by the caller)."""
    parser.add_argument("--tokens", type=int, default=12288, help="prompt tokens")
    parser.add_argument("--doc-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--nq", help="NQ jsonl(.gz): its passages are the documents")


def planning_line(result: dict[str, Any]) -> str:
    """One line: both medians and the ratio."""
    return (
        f"{result['prompt_tokens']}-token prompt, {result['documents_found']} of "
        f"{result['documents']} documents found: tokenizer {result['tokenizer_s'] * 1e3:.1f} ms, "
        f"tokenize + match (engine.plan) {result['plan_s'] * 1e3:.1f} ms "
        f"-> {result['ratio']:.2f}x the tokenizer (target <= 1.1; "
        f"{result['ratio_of_minimums']:.2f}x by the fastest runs; documents' tokens "
        f"{'spliced' if result.get('spliced') else 'not spliced: the whole text tokenized'})"
    )
