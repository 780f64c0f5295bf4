"""LangChain's standard integration suites, run against the bundled model (CPU, offline)."""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.messages import AIMessage, AIMessageChunk
from langchain_core.retrievers import BaseRetriever
from langchain_tests.integration_tests import ChatModelIntegrationTests, RetrieversIntegrationTests

from conftest import TOY_BLEND_SETTINGS
from conftest_langchain import (
    CORPUS,
    corpus_vectorstore,
    requires_model,
    requires_rag_stack,
    session_engine,
)
from kvblend import BlendConfig
from kvblend.langchain import BlendRetriever, ChatBlend

pytestmark = [requires_model, pytest.mark.slow]

# Every generation of the suite is short: the suite checks plumbing, not prose.
MAX_TOKENS = 16


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # none from kvblend; from the suite
class TestChatBlendIntegration(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[ChatBlend]:
        return ChatBlend

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"engine": session_engine(), "max_tokens": MAX_TOKENS}

    @property
    def supports_model_override(self) -> bool:
        return False  # one engine per instance; a per-call `model` is refused

    @property
    def supported_usage_metadata_details(self) -> dict[str, list[Any]]:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        """A prompt holding two precomputed documents: their KV is read from the store."""
        engine = session_engine()
        engine.precompute(CORPUS[:2])
        model = ChatBlend(
            engine=engine, max_tokens=4, blend_config=BlendConfig(**TOY_BLEND_SETTINGS)
        )
        prompt = f"Context:\n{CORPUS[0]}\n\n{CORPUS[1]}\n\nQuestion: Where does Marta Quill live?"
        if not stream:
            message = model.invoke(prompt)
        else:
            full: AIMessageChunk | None = None
            for chunk in model.stream(prompt):
                full = chunk if full is None else full + chunk
            assert full is not None
            message = full
        assert message.usage_metadata is not None
        assert message.usage_metadata["input_token_details"]["cache_read"] > 0
        return message


@requires_rag_stack
class TestBlendRetrieverIntegration(RetrieversIntegrationTests):
    @property
    def retriever_constructor(self) -> type[BaseRetriever]:
        return BlendRetriever

    @property
    def retriever_constructor_params(self) -> dict[str, Any]:
        return {"retriever": corpus_vectorstore().as_retriever(), "engine": session_engine()}

    @property
    def retriever_query_example(self) -> str:
        return "Where does Marta Quill live?"
