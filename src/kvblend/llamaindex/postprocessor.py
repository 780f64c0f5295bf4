"""`BlendNodePostprocessor`: precompute the KV of exactly the node text the prompt will hold."""

from __future__ import annotations

from typing import Literal

from llama_index.core.bridge.pydantic import ConfigDict, Field, PrivateAttr, field_validator
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import BaseNode, MetadataMode, NodeWithScore, QueryBundle

from kvblend.engine.engine import BlendEngine
from kvblend.integrations.conventions import EngineHolder
from kvblend.integrations.shared import SEGMENT_ID_KEY, adopt_engine, lazy_engine, precompute_texts


class BlendNodePostprocessor(EngineHolder, BaseNodePostprocessor):
    """Node postprocessor that precomputes the KV of every node it passes on.

    Query engines put ``node.get_content(MetadataMode.LLM)`` into the prompt: the node's text
    with the metadata lines LlamaIndex prints before it. That exact string is precomputed and
    registered with the engine, so `BlendLLM` sharing the engine finds it in the final prompt.
    The returned nodes are copies (the retrieved nodes are not changed) with
    ``metadata["kvblend_segment_id"]`` set and that key excluded from LLM and embedding
    metadata, so the tag never reaches the prompt. Put it last among the postprocessors.
    Pickling keeps the engine's model spec (reloaded lazily); a deep copy shares the engine.

    Example:
        .. code-block:: python

            engine = BlendEngine.from_pretrained()
            llm = BlendLLM(engine=engine)
            query_engine = index.as_query_engine(
                llm=llm,
                response_synthesizer=BlendSynthesizer(llm=llm),
                node_postprocessors=[BlendNodePostprocessor(engine=engine)],
            )
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    engine: BlendEngine | None = Field(
        default=None,
        exclude=True,
        description="The engine that precomputes and later reuses the nodes' KV; share it with "
        "BlendLLM. When None, the engine shared per `model` spec is used.",
    )
    model: str | None = Field(
        default=None, description="Model spec of the shared engine when no `engine` is given."
    )
    threads: int | None = Field(
        default=None,
        ge=1,
        description="torch CPU threads, for the whole process, from the first call on (None: "
        "the engine's load-aware default).",
    )
    order: Literal["retrieved", "most_relevant_last"] = Field(
        default="retrieved",
        description="Node order. Blended KV does not depend on position, so the order can "
        "favour quality: 'most_relevant_last' reverses the retriever's (most relevant first) "
        "order, putting the best node nearest a question that follows the context.",
    )

    _engine: BlendEngine | None = PrivateAttr(default=None)

    @field_validator("engine")
    @classmethod
    def _share_engine(cls, engine: BlendEngine | None) -> BlendEngine | None:
        return adopt_engine(engine)

    @classmethod
    def class_name(cls) -> str:
        """Name LlamaIndex serializes this class under."""
        return "BlendNodePostprocessor"

    def get_engine(self) -> BlendEngine:
        """Return the engine, loading the shared one for ``model`` on first use."""
        return lazy_engine(self)

    def _postprocess_nodes(
        self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None
    ) -> list[NodeWithScore]:
        engine = self.get_engine()
        copies = [NodeWithScore(node=_untagged(item.node), score=item.score) for item in nodes]
        contents = [item.node.get_content(metadata_mode=MetadataMode.LLM) for item in copies]
        precompute_texts(engine, dict.fromkeys(text for text in contents if text.strip()))
        for item, content in zip(copies, contents, strict=True):
            if content.strip() and engine.is_known(content):
                item.node.metadata[SEGMENT_ID_KEY] = engine.segment_id(content)
        return copies[::-1] if self.order == "most_relevant_last" else copies


def _untagged(node: BaseNode) -> BaseNode:
    """Copy of ``node`` whose segment-id key is unset and kept out of LLM and embedding text."""
    metadata = {key: value for key, value in node.metadata.items() if key != SEGMENT_ID_KEY}
    return node.model_copy(
        update={
            "metadata": metadata,
            "excluded_llm_metadata_keys": _with_key(node.excluded_llm_metadata_keys),
            "excluded_embed_metadata_keys": _with_key(node.excluded_embed_metadata_keys),
        }
    )


def _with_key(keys: list[str]) -> list[str]:
    return list(keys) if SEGMENT_ID_KEY in keys else [*keys, SEGMENT_ID_KEY]
