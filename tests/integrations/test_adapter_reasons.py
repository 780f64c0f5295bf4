"""What the adapters report and log, over a tiny engine: near misses through every adapter,
a prompt without documents, and each batched request's own prefill time."""

from __future__ import annotations

import logging

import pytest

from conftest import byte_tokenizer, tiny_model
from kvblend import BlendEngine
from kvblend.blend.forecast import NO_DOCUMENTS
from kvblend.store import MemoryKVStore

pytest.importorskip("langchain_core")
pytest.importorskip("llama_index.core")

DOCUMENT = "Marta Quill is a beekeeper who lives in Lisbon with her three dogs."
OTHER = "Tomas Elm makes violins in Cremona and plays them on Sundays at noon."


@pytest.fixture
def engine() -> BlendEngine:
    engine = BlendEngine(tiny_model("llama"), byte_tokenizer(), store=MemoryKVStore(), name="tiny")
    engine.precompute([DOCUMENT, OTHER])
    return engine


def _truncated() -> str:
    return f"Context: {OTHER}\n\n{DOCUMENT[:40]}\nQuestion: where?"


def _langchain_llm(engine: BlendEngine) -> dict:
    from kvblend.langchain import BlendLLM

    llm = BlendLLM(engine=engine, max_tokens=2)
    return llm.generate([_truncated()]).generations[0][0].generation_info["kvblend"]


def _langchain_chat(engine: BlendEngine) -> dict:
    from langchain_core.messages import HumanMessage

    from kvblend.langchain import ChatBlend

    chat = ChatBlend(engine=engine, max_tokens=2)
    return chat.invoke([HumanMessage(_truncated())]).response_metadata["kvblend"]


def _langchain_stream(engine: BlendEngine) -> dict:
    from kvblend.langchain import ChatBlend

    chunks = list(ChatBlend(engine=engine, max_tokens=2).stream(_truncated()))
    return next(c.response_metadata["kvblend"] for c in chunks if c.response_metadata)


def _llamaindex_complete(engine: BlendEngine) -> dict:
    from kvblend.llamaindex import BlendLLM

    return BlendLLM(engine=engine, max_tokens=2).complete(_truncated()).raw["kvblend"]


def _llamaindex_chat(engine: BlendEngine) -> dict:
    from llama_index.core.base.llms.types import ChatMessage

    from kvblend.llamaindex import BlendLLM

    llm = BlendLLM(engine=engine, max_tokens=2)
    return llm.chat([ChatMessage(role="user", content=_truncated())]).raw["kvblend"]


@pytest.mark.parametrize(
    "run",
    [_langchain_llm, _langchain_chat, _langchain_stream, _llamaindex_complete, _llamaindex_chat],
)
def test_a_truncated_document_is_a_near_miss_through_every_adapter(
    engine: BlendEngine, caplog: pytest.LogCaptureFixture, run
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvblend"):
        metadata = run(engine)
    assert metadata["documents_found"] == 1 and metadata["documents_reused"] <= 1
    assert (
        metadata["near_miss"] is not None
        and f"known document of {len(DOCUMENT)} characters" in (metadata["near_miss"])
    )
    warned = [r.getMessage() for r in caplog.records if "no precomputed document" in r.getMessage()]
    assert len(warned) == 1 and "truncated, rewritten or re-joined" in warned[0]


def test_a_prompt_without_documents_says_so_through_the_adapters(engine: BlendEngine) -> None:
    from kvblend.langchain import ChatBlend
    from kvblend.llamaindex import BlendLLM

    chat = ChatBlend(engine=engine, max_tokens=2).invoke("Hello there!")
    assert chat.response_metadata["kvblend"]["fallback"] == NO_DOCUMENTS
    assert chat.response_metadata["kvblend"]["strategy_run"] == "full"
    completion = BlendLLM(engine=engine, max_tokens=2).complete("Hello there!")
    assert completion.raw["kvblend"]["fallback"] == NO_DOCUMENTS


def test_each_batched_request_carries_its_own_prefill_time(engine: BlendEngine) -> None:
    from kvblend.langchain import BlendLLM, ChatBlend

    prompts = [f"Context: {DOCUMENT}\nQuestion: where?", f"Context: {OTHER} {DOCUMENT}\nQ: who?"]
    llm = BlendLLM(engine=engine, max_tokens=3)
    rows = [g[0].generation_info["kvblend"] for g in llm.generate(prompts).generations]
    assert [row["batch_size"] for row in rows] == [2, 2]
    assert rows[0]["ttft_s"] == rows[1]["ttft_s"]  # the batch's: every prompt prefilled first
    for row in rows:
        assert 0 < row["prefill_s"] <= row["ttft_s"]
    assert rows[0]["prefill_s"] + rows[1]["prefill_s"] <= rows[0]["ttft_s"]
    alone = ChatBlend(engine=engine, max_tokens=3).invoke(prompts[0])
    metadata = alone.response_metadata["kvblend"]
    assert metadata["batch_size"] == 1 and 0 < metadata["prefill_s"] <= metadata["ttft_s"]
    results = engine.generate_batch(prompts, max_new_tokens=3)
    assert [r.batch_size for r in results] == [2, 2]
    assert all(r.stats.timings["prefill_s"] <= r.ttft_s for r in results)
