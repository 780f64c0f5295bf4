"""`BlendRetriever`: wraps any retriever and makes sure each returned document's KV is cached."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

from langchain_core.callbacks import (
    AsyncCallbackManagerForRetrieverRun,
    CallbackManagerForRetrieverRun,
)
from langchain_core.documents import Document
from langchain_core.prompts import BasePromptTemplate, format_document
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnableConfig
from pydantic import ConfigDict, Field, PrivateAttr, field_validator

from kvblend.engine.engine import BlendEngine
from kvblend.integrations.conventions import EngineHolder
from kvblend.integrations.shared import SEGMENT_ID_KEY, adopt_engine, lazy_engine, precompute_texts

_EXECUTOR: concurrent.futures.ThreadPoolExecutor | None = None
_EXECUTOR_LOCK = threading.Lock()


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    """One background worker: precomputing is compute bound, more threads would not help."""
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            _EXECUTOR = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="kvblend-precompute"
            )
        return _EXECUTOR


class BlendRetriever(EngineHolder, BaseRetriever):
    """Retriever wrapper that precomputes the KV of every document it returns.

    The returned documents are new `Document` objects (the wrapped retriever's are not changed)
    with ``metadata["kvblend_segment_id"]`` set. Their texts are registered with the engine, so
    `BlendLLM` / `ChatBlend` sharing that engine find them in the final prompt and reuse their
    KV wherever the prompt template puts them. With ``document_prompt`` the text cached is each
    document as that template formats it, so a title or source it adds is reused with the
    document instead of computed in every prompt. Pickling keeps the engine's model spec (the
    engine is reloaded, or shared, on first use) and drops pending background work; a deep
    copy shares the live engine. Neither changes this object.

    Example:
        .. code-block:: python

            retriever = BlendRetriever(retriever=vectorstore.as_retriever(), engine=engine, k=3)
            llm = ChatBlend(engine=engine)
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    retriever: BaseRetriever
    """The retriever whose documents are returned (any LangChain retriever)."""

    engine: BlendEngine | None = Field(default=None, exclude=True)
    """The engine that precomputes and later reuses the documents' KV; share it with the LLM.
    When None, the engine shared per ``model`` spec is used (as `BlendLLM` does)."""

    model: str | None = None
    """Model spec for the shared engine when no ``engine`` is given (None = the default)."""

    threads: int | None = Field(default=None, ge=1)
    """torch CPU threads, for the whole process, from the first call on (None: the engine's
    load-aware default)."""

    k: int | None = Field(default=None, ge=1)
    """Number of documents to return: passed to the wrapped retriever as ``k`` and used to cut
    its result. A ``k`` given to ``invoke`` wins. None leaves the wrapped retriever's default."""

    background: bool = False
    """Precompute missing KV in a background thread so retrieval returns at once. A document
    still being precomputed when the prompt runs is computed during that prefill instead."""

    order: Literal["retrieved", "most_relevant_last"] = "retrieved"
    """Document order. Blended KV does not depend on position, so the order can favour quality:
    ``"most_relevant_last"`` reverses the wrapped retriever's (most relevant first) order, which
    puts the best document nearest a question that follows the context."""

    document_prompt: BasePromptTemplate | None = None
    """The template the chain formats each document with before joining them into the context
    (``create_stuff_documents_chain(..., document_prompt=...)``, or ``format_document(doc,
    prompt)`` in an LCEL ``format_docs``). Each document's KV is then precomputed for its text
    as this template formats it, the metadata it adds (``"Source: {title}\\n{page_content}"``)
    included, and found whole in the prompt. None: the page content alone, what the stuff
    chain's default ``{page_content}`` puts in the prompt; text a template adds around it is
    then computed in every prompt. A document missing a variable the template reads raises
    `ValueError` naming it, as the chain would."""

    _engine: BlendEngine | None = PrivateAttr(default=None)

    @field_validator("engine")
    @classmethod
    def _share_engine(cls, engine: BlendEngine | None) -> BlendEngine | None:
        return adopt_engine(engine)

    _pending: list[concurrent.futures.Future[Any]] = PrivateAttr(default_factory=list)
    _UNPICKLED_PRIVATE: ClassVar[tuple[str, ...]] = ("_pending",)

    def _get_engine(self) -> BlendEngine:
        return lazy_engine(self)

    def wait_precomputed(self, timeout: float | None = None) -> None:
        """Block until the background precomputation started by this retriever has finished."""
        pending, self._pending = self._pending, []
        for future in concurrent.futures.as_completed(pending, timeout=timeout):
            future.result()

    def _call_kwargs(self, kwargs: dict[str, Any]) -> tuple[int | None, dict[str, Any]]:
        k = kwargs.get("k", self.k)
        return k, ({**kwargs, "k": k} if k is not None else kwargs)

    def _prepare(self, documents: Sequence[Document], k: int | None) -> list[Document]:
        """Cut to ``k``, precompute (or schedule) the KV and return tagged copies in order."""
        documents = list(documents)[:k] if k is not None else list(documents)
        engine = self._get_engine()
        formatted = [self._cached_text(d) for d in documents]
        texts = list(dict.fromkeys(text for text in formatted if text.strip()))
        if texts and self.background:
            engine.register(texts)
            self._pending = [f for f in self._pending if not f.done()]
            self._pending.append(_executor().submit(precompute_texts, engine, texts))
        elif texts:
            precompute_texts(engine, texts)
        ids = {text: engine.segment_id(text) for text in texts if engine.is_known(text)}
        tagged = [
            Document(
                page_content=doc.page_content,
                metadata={**doc.metadata, SEGMENT_ID_KEY: ids[text]}
                if text in ids
                else dict(doc.metadata),
                id=doc.id,
            )
            for doc, text in zip(documents, formatted, strict=True)
        ]
        return tagged[::-1] if self.order == "most_relevant_last" else tagged

    def _cached_text(self, document: Document) -> str:
        """Return the document's text as it reaches the prompt: formatted by ``document_prompt``."""
        if self.document_prompt is None:
            return document.page_content
        return format_document(document, self.document_prompt)

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun, **kwargs: Any
    ) -> list[Document]:
        k, kwargs = self._call_kwargs(kwargs)
        config = RunnableConfig(callbacks=run_manager.get_child())
        documents = self.retriever.invoke(query, config=config, **kwargs)
        return self._prepare(documents, k)

    async def _aget_relevant_documents(
        self, query: str, *, run_manager: AsyncCallbackManagerForRetrieverRun, **kwargs: Any
    ) -> list[Document]:
        k, kwargs = self._call_kwargs(kwargs)
        config = RunnableConfig(callbacks=run_manager.get_child())
        documents = await self.retriever.ainvoke(query, config=config, **kwargs)
        return await asyncio.to_thread(self._prepare, documents, k)
