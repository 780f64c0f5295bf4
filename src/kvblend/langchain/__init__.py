"""LangChain integration: `BlendLLM`, `ChatBlend` and `BlendRetriever`.

Unmodified RAG chains get blended prefill: the retriever precomputes each document's KV once,
and the LLM finds those documents in the final prompt and reuses their KV wherever they land.
Needs the ``langchain`` extra: ``pip install "kvblend[langchain]"``.
"""

try:
    import langchain_core  # noqa: F401
except ImportError as error:  # pragma: no cover - exercised by a test that hides the package
    raise ImportError(
        'kvblend.langchain needs langchain-core; install it with: pip install "kvblend[langchain]"'
    ) from error

from kvblend.langchain.chat_models import ChatBlend
from kvblend.langchain.llms import BlendLLM
from kvblend.langchain.retrievers import SEGMENT_ID_KEY, BlendRetriever

__all__ = ["SEGMENT_ID_KEY", "BlendLLM", "BlendRetriever", "ChatBlend"]
