"""How finding documents in a prompt scales with the number of documents known.

The document registry (`kvblend.documents.registry`) indexes documents by a hash of their first
characters, so a search costs one hash lookup per prompt position whatever the number of known
documents. This benchmark registers N synthetic documents (paragraph-sized, random words) in a
registry over a store folder, then times:

- ``find_ms``: searching a prompt of ``docs_in_prompt`` known documents plus template text
  (median over repeats), for each N;
- ``load_s``: how long a fresh registry over the same folder (a new process, a restart) takes to
  read the N records before its first search.

No model is loaded: it measures the registry alone.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from typing import Any

from kvblend.documents.registry import DocumentRegistry

__all__ = ["registry_table", "run_registry"]

_WORDS = (
    "the of river city founded king war music album season team film station church island "
    "league county born village records party election army school village bridge novel song "
    "series north south power energy law court museum castle tower valley lake coast history"
).split()


def _document(rng: random.Random, words: int = 110) -> str:
    text = " ".join(rng.choice(_WORDS) for _ in range(words))
    return f"{rng.randrange(10**9)} {text.capitalize()}."


def run_registry(
    counts: tuple[int, ...] = (100, 100_000),
    docs_in_prompt: int = 10,
    repeats: int = 20,
    seed: int = 0,
) -> dict[str, Any]:
    """Time searches and loads at each registry size; return a JSON-able result."""
    from kvblend.store import DiskKVStore

    rng = random.Random(seed)
    rows = []
    for count in counts:
        documents = [_document(rng) for _ in range(count)]
        picked = rng.sample(documents, min(docs_in_prompt, count))
        prompt = (
            "<|im_start|>system\nAnswer from the documents.<|im_end|>\n<|im_start|>user\n"
            + "".join(f"Document [{i}] {text}\n\n" for i, text in enumerate(picked, 1))
            + "Question: which one?<|im_end|>\n<|im_start|>assistant\n"
        )
        with tempfile.TemporaryDirectory() as folder:
            writer = DocumentRegistry(DiskKVStore(folder), "documents-bench", capacity=count)
            started = time.perf_counter()
            for start in range(0, count, 1000):
                writer.add(documents[start : start + 1000])
            add_s = time.perf_counter() - started
            reader = DocumentRegistry(DiskKVStore(folder), "documents-bench", capacity=count)
            started = time.perf_counter()
            reader.refresh()
            load_s = time.perf_counter() - started
            times = []
            for _ in range(repeats):
                started = time.perf_counter()
                found = reader.find(prompt)
                times.append(time.perf_counter() - started)
            if len(found) != len(picked):
                raise RuntimeError(f"found {len(found)} of {len(picked)} documents")
        rows.append(
            {
                "documents": count,
                "prompt_chars": len(prompt),
                "found": len(found),
                "find_ms": 1000 * statistics.median(times),
                "add_s": add_s,
                "load_s": load_s,
            }
        )
    return {"docs_in_prompt": docs_in_prompt, "repeats": repeats, "rows": rows}


def registry_table(result: dict[str, Any]) -> str:
    """Markdown table of a `run_registry` result."""
    lines = [
        "| known documents | prompt chars | found | search (median ms) | register (s) | "
        "load in a new process (s) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['documents']:,} | {row['prompt_chars']:,} | {row['found']} | "
            f"{row['find_ms']:.2f} | {row['add_s']:.2f} | {row['load_s']:.2f} |"
        )
    return "\n".join(lines)
