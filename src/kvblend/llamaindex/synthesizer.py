"""`BlendSynthesizer` keeps every node's text intact in one prompt; `blend_query_engine` wires it.

LlamaIndex's default ``compact`` synthesizer strips each node, joins them and re-splits the text
to a token budget, so a document can be cut across several LLM calls and its precomputed KV no
longer matches. `BlendSynthesizer` instead formats the QA template once with the node texts
joined by a separator, byte for byte as the node postprocessor precomputed them. With a
`BlendLLM`, the `Response` it returns carries the prefill's reuse figures in its ``metadata``:
``response.metadata["kvblend"]`` (the stats `BlendLLM` puts in ``raw["kvblend"]``: reused,
recomputed and computed tokens, documents found and reused, the fallback reason...) and
``response.metadata["usage"]`` (prompt, completion and cached tokens); a streaming response
gets them once its stream has been read to the end.
"""

from __future__ import annotations

import contextvars
from collections.abc import Sequence
from typing import Any, Literal

from llama_index.core.callbacks.base import CallbackManager
from llama_index.core.indices.base import BaseIndex
from llama_index.core.indices.prompt_helper import PromptHelper
from llama_index.core.llms import LLM
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.prompts import BasePromptTemplate
from llama_index.core.prompts.default_prompt_selectors import DEFAULT_TEXT_QA_PROMPT_SEL
from llama_index.core.prompts.mixin import PromptDictType
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.response_synthesizers.base import BaseSynthesizer
from llama_index.core.schema import NodeWithScore
from llama_index.core.types import RESPONSE_TEXT_TYPE

from kvblend.llamaindex.llms import BlendLLM, reporting_raw
from kvblend.llamaindex.postprocessor import BlendNodePostprocessor

#: The figures of the answer just synthesized in this context, for `_prepare_response_output`.
_FIGURES: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "kvblend_llamaindex_figures", default=None
)


def _collect() -> dict[str, Any]:
    """Return a fresh dict for this call's figures, which `BlendLLM` fills as it answers."""
    figures: dict[str, Any] = {}
    _FIGURES.set(figures)
    return figures


def _fill(figures: dict[str, Any]) -> Any:  # noqa: ANN401 - a `reporting_raw` context
    def sink(raw: dict[str, Any]) -> None:
        figures["kvblend"] = raw.get("kvblend", {})
        figures["usage"] = raw.get("usage", {})

    return reporting_raw(sink)


class BlendSynthesizer(BaseSynthesizer):
    """Response synthesizer that puts each node's text into the prompt once, unchanged.

    The texts (``node.get_content(MetadataMode.LLM)``, in the order the postprocessors left
    them) are joined with ``separator`` and the QA template is formatted once: no stripping,
    no repacking, one LLM call. A prompt longer than the model's context window is refused by
    the engine (``ValueError``) rather than cut; retrieve fewer or smaller nodes.

    Works with any LLM; with `BlendLLM` and `BlendNodePostprocessor` sharing an engine, every
    node's KV is reused wherever the template puts it.
    """

    def __init__(
        self,
        llm: LLM | None = None,
        callback_manager: CallbackManager | None = None,
        prompt_helper: PromptHelper | None = None,
        text_qa_template: BasePromptTemplate | None = None,
        streaming: bool = False,
        separator: str = "\n\n",
        empty_response: str | None = None,
    ) -> None:
        """Build the synthesizer.

        Args:
            llm: the LLM to answer with (default ``Settings.llm``).
            callback_manager: callbacks for the synthesis (and the LLM).
            prompt_helper: passed to `BaseSynthesizer` (not used to repack).
            text_qa_template: QA prompt with ``{context_str}`` and ``{query_str}`` (default:
                LlamaIndex's text QA prompt, the chat version for chat models).
            streaming: return streaming responses.
            separator: text put between two nodes.
            empty_response: answer when the LLM returns nothing.
        """
        super().__init__(
            llm=llm,
            callback_manager=callback_manager,
            prompt_helper=prompt_helper,
            streaming=streaming,
            empty_response=empty_response,
        )
        self._text_qa_template = text_qa_template or DEFAULT_TEXT_QA_PROMPT_SEL
        self._separator = separator

    def _get_prompts(self) -> PromptDictType:
        return {"text_qa_template": self._text_qa_template}

    def _update_prompts(self, prompts: PromptDictType) -> None:
        if "text_qa_template" in prompts:
            self._text_qa_template = prompts["text_qa_template"]

    def _prompt(self, query_str: str, text_chunks: Sequence[str]) -> tuple[Any, str]:
        template = self._text_qa_template.partial_format(query_str=query_str)
        return template, self._separator.join(text_chunks)

    def get_response(
        self, query_str: str, text_chunks: Sequence[str], **response_kwargs: Any
    ) -> RESPONSE_TEXT_TYPE:
        """Answer ``query_str`` from all ``text_chunks`` in one LLM call."""
        template, context = self._prompt(query_str, text_chunks)
        with _fill(_collect()):
            if self._streaming:
                return self._llm.stream(template, context_str=context, **response_kwargs)
            answer = self._llm.predict(template, context_str=context, **response_kwargs)
        return answer or self._empty_response

    async def aget_response(
        self, query_str: str, text_chunks: Sequence[str], **response_kwargs: Any
    ) -> RESPONSE_TEXT_TYPE:
        """Async `get_response` (the LLM's async methods, which `BlendLLM` runs in threads)."""
        template, context = self._prompt(query_str, text_chunks)
        with _fill(_collect()):
            if self._streaming:
                return await self._llm.astream(template, context_str=context, **response_kwargs)
            answer = await self._llm.apredict(template, context_str=context, **response_kwargs)
        return answer or self._empty_response

    def _prepare_response_output(
        self, response_str: RESPONSE_TEXT_TYPE | None, source_nodes: list[NodeWithScore]
    ) -> Any:  # noqa: ANN401 - LlamaIndex's RESPONSE_TYPE
        """LlamaIndex's response, its ``metadata`` holding this answer's reuse figures.

        A streaming response's metadata is the very dict `BlendLLM` fills when the stream ends.
        """
        response = super()._prepare_response_output(response_str, source_nodes)
        figures = _FIGURES.get()
        _FIGURES.set(None)
        if figures is not None and hasattr(response, "metadata"):
            figures.update(response.metadata or {})
            response.metadata = figures
        return response


def blend_query_engine(
    index: BaseIndex[Any],
    llm: BlendLLM | None = None,
    *,
    similarity_top_k: int | None = None,
    streaming: bool = False,
    text_qa_template: BasePromptTemplate | None = None,
    order: Literal["retrieved", "most_relevant_last"] = "retrieved",
    node_postprocessors: Sequence[BaseNodePostprocessor] = (),
    callback_manager: CallbackManager | None = None,
    **retriever_kwargs: Any,
) -> RetrieverQueryEngine:
    """Query engine over ``index`` that reuses each retrieved node's KV.

    Equivalent to ``index.as_query_engine(llm=llm, response_synthesizer=BlendSynthesizer(...),
    node_postprocessors=[*node_postprocessors, BlendNodePostprocessor(...)])``, with the
    postprocessor and the LLM sharing one engine. Loads the model (its context window is
    needed to build the synthesizer).

    Args:
        index: any LlamaIndex index (``index.as_retriever(**retriever_kwargs)`` is used).
        llm: the `BlendLLM` to answer with (default ``BlendLLM()``, the default model).
        similarity_top_k: number of nodes to retrieve (None = the retriever's default).
        streaming: return streaming responses.
        text_qa_template: QA prompt (default: LlamaIndex's text QA prompt).
        order: node order in the prompt, see `BlendNodePostprocessor.order`.
        node_postprocessors: postprocessors run before the KV precomputation.
        callback_manager: callbacks for the query engine and the synthesizer.
        retriever_kwargs: passed to ``index.as_retriever``.
    """
    llm = llm if llm is not None else BlendLLM()
    if similarity_top_k is not None:
        retriever_kwargs["similarity_top_k"] = similarity_top_k
    precompute = BlendNodePostprocessor(engine=llm.get_engine(), order=order)
    synthesizer = BlendSynthesizer(
        llm=llm,
        callback_manager=callback_manager,
        text_qa_template=text_qa_template,
        streaming=streaming,
    )
    return RetrieverQueryEngine(
        retriever=index.as_retriever(**retriever_kwargs),
        response_synthesizer=synthesizer,
        node_postprocessors=[*node_postprocessors, precompute],
        callback_manager=callback_manager,
    )
