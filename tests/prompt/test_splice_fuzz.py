"""Random RAG prompts on every offline tokenizer: the plan reads ``tokenizer(prompt)``'s ids.

A fuzzer over `kvblend.prompt.splice` (`splice_fuzz`, tokenizers in `fuzz_tokenizers`): an
engine over a tiny random model and each tokenizer, its documents registered, plans prompts in
the shapes real applications build (chat template, LangChain, LlamaIndex, "Document [i]"
labels, glued, repeated, truncated documents) over adversarial documents; the plan's ids must be
the tokenizer's on the whole text, the spliced ids and offsets the whole text's, the reuse
decisions those made from the whole text's tokens. Dense short prompts (junk next to cuts,
special tokens' text, NFKC-changing characters) check the spliced tokens directly. Each
tokenizer must splice (not silently tokenize the whole text) wherever a document has cuts.

A fixed seed and a few prompts per tokenizer here; a larger run, on NQ passages and with the
Qwen2.5 tokenizer (one line per tokenizer; a mismatch stops it with the prompt)::

    PYTHONPATH=src:tests python tests/prompt/splice_fuzz.py --prompts 400 --dense 2000 \\
        --nq nq_open_gold_2000.jsonl.gz \\
        --qwen "$(python scripts/bench_models.py qwen2.5-0.5b)"
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fuzz_tokenizers import tokenizers
from kvblend.prompt.splice import splice_rules
from splice_fuzz import PASSAGES, dense_fuzz, fuzz

PROMPTS = 24
DENSE = 150
#: Tokenizers whose prefix space gives a window's first token odd offsets: such windows are
#: refused (the whole text tokenized), so these are held to the ids, not to splicing.
MAY_FALL_BACK = {"gpt2-bpe-prefix-space", "llama3-bpe-nfkd-prefix-space"}
#: NFKC writes ``´`` and ``¨`` (dense junk) as a space and a combining mark, whose offsets go
#: back by one: a window holding one is refused.
DENSE_MAY_FALL_BACK = {"llama3-bpe-nfkc"}
#: Shares of RAG and dense prompts spliced, where fewer documents have cuts: an EOS after a
#: document, or ``the`` an added token (in every passage here).
LEAST_SPLICED = {"mistral-v1-eos": (0.2, 0.2), "qwen2-bpe-added-phrases": (0.0, 0.05)}
NAMES = [
    "smollm2",
    "mistral-v1",
    "mistral-v1-nonlegacy",
    "mistral-v1-eos",
    "mistral-v3",
    "mistral-v7",
    "tekken-240911",
    "tekken-vocabulary-llama3-rule",
    "byte",
    "gpt2-bpe",
    "gpt2-bpe-prefix-space",
    "qwen2-bpe-nfc",
    "qwen2-bpe-added-phrases",
    "llama3-bpe-nfkc",
    "llama3-bpe-nfkd-prefix-space",
]


@pytest.fixture(scope="module")
def factories(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return tokenizers(Path(tmp_path_factory.mktemp("tokenizers")))


def test_every_tokenizer_of_the_fuzzer_is_run_here() -> None:
    """The suite runs every tokenizer the fuzzer knows offline (a Qwen2.5 GGUF aside)."""
    same = {"mistral-v2", "tekken-240718", "tekken-vocabulary-gpt2-rule", "qwen2-bpe"}
    same.add("mistral-v3-added-phrases")  # pipelines run here already, or slow to load
    assert set(tokenizers(Path("unused"))) - same == set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_random_rag_prompts_read_the_ids_of_the_tokenizer(
    name: str, factories: dict[str, Any]
) -> None:
    tokenizer = factories[name]()
    assert splice_rules(tokenizer) is not None  # every one of them splices
    counts = fuzz(tokenizer, PROMPTS, seed=0, passages=PASSAGES)
    assert counts["prompts"] == PROMPTS and counts["reused spans"] >= counts["documents"] // 2
    dense = dense_fuzz(tokenizer, DENSE, seed=0)
    assert dense["prompts"] == DENSE
    if name in MAY_FALL_BACK:
        return
    assert counts["fell back with cuts"] == 0, counts
    assert dense["fell back with cuts"] == 0 or name in DENSE_MAY_FALL_BACK, dense
    least, least_dense = LEAST_SPLICED.get(name, (0.5, 0.5))
    assert counts["spliced"] >= least * PROMPTS, counts
    assert dense["spliced"] >= least_dense * DENSE, dense
