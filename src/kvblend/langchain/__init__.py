"""LangChain integration: `BlendLLM`, `ChatBlend` and `BlendRetriever`.

Unmodified RAG chains get blended prefill: the retriever precomputes each document's KV once,
and the LLM finds those documents in the final prompt and reuses their KV wherever they land.
Needs the ``langchain`` extra: ``pip install -e ".[langchain]"`` in a clone of kvblend, or
the built wheel with it (``pip install "dist/kvblend-0.1.0-py3-none-any.whl[langchain]"``).
"""

try:
    import langchain_core  # noqa: F401
except ImportError as error:  # pragma: no cover - exercised by a test that hides the package
    raise ImportError(
        "kvblend.langchain needs langchain-core: pip install 'langchain-core>=1.0' (the "
        "langchain extra; from a clone of kvblend: pip install -e '.[langchain]')"
    ) from error

from kvblend.langchain.chat_models import ChatBlend
from kvblend.langchain.llms import BlendLLM
from kvblend.langchain.retrievers import SEGMENT_ID_KEY, BlendRetriever

__all__ = ["SEGMENT_ID_KEY", "BlendLLM", "BlendRetriever", "ChatBlend"]
