"""LlamaIndex adapters over a tiny random-init engine: what reaches the engine and what is reported.

The engine is a real `BlendEngine` (3 layers, byte tokenizer, no chat template, so chat messages
render as ``role: content`` lines); its answers are noise, but its prompts, segments and stats
are real, so these tests check byte-exact prompts and KV reuse in well under a second each.
"""

from __future__ import annotations

import asyncio
import copy
import importlib
import pickle
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from llama_index.core import VectorStoreIndex
from llama_index.core.base.llms.types import ChatMessage, ImageBlock, MessageRole, TextBlock
from llama_index.core.base.response.schema import Response, StreamingResponse
from llama_index.core.callbacks import CallbackManager, TokenCountingHandler
from llama_index.core.embeddings import MockEmbedding
from llama_index.core.prompts import PromptTemplate
from llama_index.core.schema import MetadataMode, NodeWithScore, TextNode

from conftest import TOY_BLEND_SETTINGS, byte_tokenizer, tiny_model
from kvblend import BlendConfig, BlendEngine, Segment
from kvblend.integrations import shared as _adapters
from kvblend.llamaindex import (
    SEGMENT_ID_KEY,
    BlendLLM,
    BlendNodePostprocessor,
    BlendSynthesizer,
    blend_query_engine,
)
from kvblend.store import MemoryKVStore

DOC_A = "Marta Quill lives in Lisbon {near} the river."
DOC_B = "  Tomas Reed bakes bread.\n"  # surrounding whitespace must survive
DOC_C = "The Orion Cafe opens at 7 am."
TEMPLATE = PromptTemplate("Context:\n{context_str}\n\nQuestion: {query_str}\nAnswer:")


@pytest.fixture(scope="module")
def engine() -> BlendEngine:
    return BlendEngine(tiny_model("llama"), byte_tokenizer(), store=MemoryKVStore(), name="tiny")


@pytest.fixture
def prompts(engine: BlendEngine, monkeypatch: pytest.MonkeyPatch) -> list[list[Segment]]:
    """Records the segments of every prefill the engine runs."""
    seen: list[list[Segment]] = []
    original = engine._prefill  # what prefill, generate and stream run after their checks

    def recording(segments: Any, config: Any, cancel: Any) -> Any:
        seen.append(list(segments))
        return original(segments, config, cancel)

    monkeypatch.setattr(engine, "_prefill", recording)
    return seen


def text_of(segments: list[Segment]) -> str:
    return "".join(segment.text for segment in segments)


def nodes(*texts: str, **metadata: Any) -> list[NodeWithScore]:
    return [
        NodeWithScore(node=TextNode(text=text, metadata=dict(metadata)), score=1.0 - i / 10)
        for i, text in enumerate(texts)
    ]


# ---------------------------------------------------------------------------- packaging
def test_import_without_llama_index_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(sys.modules):
        if name == "kvblend.llamaindex" or name.startswith("kvblend.llamaindex."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "llama_index.core", None)  # `import llama_index.core` fails
    # the extra's package, and the clone's install (kvblend is on no package index)
    wanted = (
        r"llama-index-core: pip install 'llama-index-core>=0\.14' "
        r".*pip install -e '\.\[llamaindex\]'"
    )
    with pytest.raises(ImportError, match=wanted):
        importlib.import_module("kvblend.llamaindex")


@pytest.mark.slow
def test_core_and_shared_glue_import_no_framework() -> None:
    code = (
        "import sys, kvblend, kvblend.matching, kvblend.integrations.shared, kvblend.integrations; "
        "bad = sorted(m for m in sys.modules if m.startswith(('langchain', 'llama_index'))); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_construction_is_cheap_and_engines_are_shared_per_model(
    monkeypatch: pytest.MonkeyPatch, engine: BlendEngine
) -> None:
    loads: list[str | None] = []

    def fake_load(model: str | None = None, **_: Any) -> BlendEngine:
        loads.append(model)
        return engine

    monkeypatch.setattr(_adapters, "_ENGINES", {})
    monkeypatch.setattr(_adapters.BlendEngine, "from_pretrained", fake_load)
    llms = [BlendLLM(model="spec-a") for _ in range(5)]
    postprocessor = BlendNodePostprocessor(model="spec-a")
    assert loads == [] and llms[0].model_name == "spec-a"  # nothing loaded yet
    assert {id(llm.get_engine()) for llm in llms} == {id(postprocessor.get_engine())}
    assert loads == ["spec-a"]


# ---------------------------------------------------------------------------- BlendLLM
def test_metadata_reports_the_models_context_window(engine: BlendEngine) -> None:
    metadata = BlendLLM(engine=engine, max_tokens=7).metadata
    assert metadata.context_window == engine.context_window == 1024
    assert metadata.num_output == 7 and metadata.is_chat_model
    assert metadata.model_name == "tiny"
    assert not BlendLLM(engine=engine, chat_template=False).metadata.is_chat_model


def test_complete_reuses_known_documents_and_reports_usage(
    engine: BlendEngine, prompts: list[list[Segment]]
) -> None:
    engine.precompute([DOC_A, DOC_C])
    counter = TokenCountingHandler(tokenizer=lambda text: text.split())
    llm = BlendLLM(engine=engine, max_tokens=5, callback_manager=CallbackManager([counter]),
                   blend_config=BlendConfig(**TOY_BLEND_SETTINGS))  # fmt: skip
    prompt = f"Context:\n{DOC_C}\n\n{DOC_A}\nWhere?"
    response = llm.complete(prompt, formatted=True)
    assert text_of(prompts[-1]) == prompt
    assert [s.text for s in prompts[-1] if s.cache] == [DOC_C, DOC_A]
    usage, stats = response.raw["usage"], response.raw["kvblend"]
    assert stats["segments_cached"] == 2 and stats["segments_precomputed"] == 0
    assert stats["reused_tokens"] > 0
    assert usage["prompt_tokens_details"]["cached_tokens"] == stats["reused_tokens"]
    assert usage["prompt_tokens"] == stats["prompt_tokens"] == len(engine.tokenize(prompt)) + 1
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert response.raw["model"] == "tiny"
    # TokenCountingHandler takes the engine's counts, not its own (word-count) tokenizer's.
    assert counter.prompt_llm_token_count == usage["prompt_tokens"]
    assert counter.completion_llm_token_count == usage["completion_tokens"] > 0


def test_complete_wraps_unformatted_prompts_in_the_chat_template(
    engine: BlendEngine, prompts: list[list[Segment]]
) -> None:
    BlendLLM(engine=engine, max_tokens=2, system_prompt="Be brief.").complete("Hi")
    assert text_of(prompts[-1]) == "system: Be brief.\nuser: Hi\nassistant:"
    BlendLLM(engine=engine, max_tokens=2, chat_template=False).complete("Hi")
    assert text_of(prompts[-1]) == "Hi"
    custom = BlendLLM(engine=engine, max_tokens=2, completion_to_prompt=lambda p: f"<<{p}>>")
    custom.complete("Hi")
    assert text_of(prompts[-1]) == "<<Hi>>"


def test_chat_uses_the_models_template_and_keeps_text_exact(
    engine: BlendEngine, prompts: list[list[Segment]]
) -> None:
    engine.precompute([DOC_B])
    llm = BlendLLM(engine=engine, max_tokens=3, blend_config=BlendConfig(**TOY_BLEND_SETTINGS))
    messages = [
        ChatMessage(role=MessageRole.SYSTEM, content="Answer."),
        ChatMessage(role=MessageRole.USER, content=f"Context:\n{DOC_B}\nWho bakes?"),
    ]
    response = llm.chat(messages)
    assert (
        text_of(prompts[-1]) == f"system: Answer.\nuser: Context:\n{DOC_B}\nWho bakes?\nassistant:"
    )
    assert [s.text for s in prompts[-1] if s.cache] == [DOC_B]
    assert response.message.role == MessageRole.ASSISTANT
    assert response.raw["kvblend"]["reused_tokens"] > 0
    image = ChatMessage(role="user", blocks=[TextBlock(text="x"), ImageBlock(url="http://x/y.png")])
    with pytest.raises(ValueError, match="text only"):
        llm.chat([image])
    custom = BlendLLM(engine=engine, max_tokens=2, messages_to_prompt=lambda ms: "|".join(
        m.content or "" for m in ms
    ))  # fmt: skip
    custom.chat(messages)
    assert text_of(prompts[-1]) == f"Answer.|Context:\n{DOC_B}\nWho bakes?"


def test_call_options_and_unknown_keywords(engine: BlendEngine) -> None:
    llm = BlendLLM(engine=engine, max_tokens=6)
    full = llm.complete("abc", formatted=True)
    assert full.raw["usage"]["completion_tokens"] <= 6
    short = llm.complete("abc", formatted=True, max_tokens=2)
    assert short.raw["usage"]["completion_tokens"] <= 2 and full.text.startswith(short.text)
    # the tiny model's greedy answer is longer than 2 tokens: cut by the limit
    assert short.raw["usage"]["completion_tokens"] == 2 and short.raw["finish_reason"] == "length"
    with pytest.raises(TypeError, match="frequency_penalty"):
        llm.complete("abc", frequency_penalty=1.0)


def test_stream_complete_matches_complete_and_carries_usage_last(engine: BlendEngine) -> None:
    counter = TokenCountingHandler(tokenizer=lambda text: text.split())
    llm = BlendLLM(engine=engine, max_tokens=6, callback_manager=CallbackManager([counter]))
    expected = llm.complete("Hello", formatted=True).text
    responses = list(llm.stream_complete("Hello", formatted=True))
    assert "".join(r.delta or "" for r in responses) == expected == responses[-1].text
    assert [r.raw is not None for r in responses] == [False] * (len(responses) - 1) + [True]
    prompt_tokens = len(engine.tokenize("Hello")) + 1  # with the BOS token
    assert (
        responses[-1].delta == "" and responses[-1].raw["usage"]["prompt_tokens"] == prompt_tokens
    )
    # both calls counted with the engine's numbers
    assert counter.prompt_llm_token_count == 2 * prompt_tokens
    chats = list(llm.stream_chat([ChatMessage(role="user", content="Hello")]))
    assert chats[-1].raw["usage"]["prompt_tokens"] > prompt_tokens
    assert chats[-1].message.content == "".join(c.delta or "" for c in chats)


async def test_async_variants_match_sync(engine: BlendEngine) -> None:
    llm = BlendLLM(engine=engine, max_tokens=5)
    messages = [ChatMessage(role="user", content="Hello")]
    assert (await llm.acomplete("Hello")).text == llm.complete("Hello").text
    assert (await llm.achat(messages)).message.content == llm.chat(messages).message.content
    pieces = [r.delta async for r in await llm.astream_complete("Hello")]
    assert "".join(p or "" for p in pieces) == llm.complete("Hello").text
    chats = [r async for r in await llm.astream_chat(messages)]
    assert chats[-1].message.content == llm.chat(messages).message.content
    assert chats[-1].raw["usage"]["completion_tokens"] > 0


async def test_async_methods_do_not_block_the_event_loop(
    engine: BlendEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    original_generate, original_stream = engine.generate, engine.stream

    def slow_generate(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.2)
        return original_generate(*args, **kwargs)

    def slow_stream(*args: Any, **kwargs: Any) -> Iterator[str]:
        time.sleep(0.2)
        yield from original_stream(*args, **kwargs)

    monkeypatch.setattr(engine, "generate", slow_generate)
    monkeypatch.setattr(engine, "stream", slow_stream)
    llm = BlendLLM(engine=engine, max_tokens=8)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.005)
            ticks += 1

    task = asyncio.create_task(ticker())
    await llm.acomplete("Hello")
    after_complete = ticks
    _ = [r async for r in await llm.astream_complete("Hello")]
    task.cancel()
    assert after_complete >= 10  # the loop ran while generate slept 0.2 s in a thread
    assert ticks - after_complete >= 10  # and while the stream slept


@pytest.fixture
def options_seen(engine: BlendEngine, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Records the decoding options of every `generate` / `generate_batch` call."""
    seen: list[dict[str, Any]] = []
    generate, generate_batch = engine.generate, engine.generate_batch

    def recording(segments: Any, config: Any = None, **options: Any) -> Any:
        seen.append(options)
        return generate(segments, config, **options)

    def recording_batch(prompts: Any, config: Any = None, **options: Any) -> Any:
        seen.append({**options, "batch": len(prompts)})
        return generate_batch(prompts, config, **options)

    monkeypatch.setattr(engine, "generate", recording)
    monkeypatch.setattr(engine, "generate_batch", recording_batch)
    return seen


def test_hf_options_as_fields_generate_kwargs_and_call_kwargs(
    engine: BlendEngine, options_seen: list[dict[str, Any]]
) -> None:
    llm = BlendLLM(
        engine=engine, max_new_tokens=4, top_k=9, generate_kwargs={"repetition_penalty": 1.1}
    )
    llm.complete("abc", formatted=True)
    assert options_seen[-1] == {
        "max_new_tokens": 4, "temperature": 0.0, "top_p": 1.0, "top_k": 9,
        "repetition_penalty": 1.1, "stop": None,
    }  # fmt: skip
    llm.complete("abc", formatted=True, max_new_tokens=2, do_sample=False, top_k=3)
    assert options_seen[-1]["max_new_tokens"] == 2 and options_seen[-1]["top_k"] == 3
    assert options_seen[-1]["do_sample"] is False
    assert llm.metadata.num_output == 4
    with pytest.raises(TypeError, match="did you mean 'top_k'"):
        llm.complete("abc", topk=3)


def test_unknown_constructor_arguments_are_one_clear_error(engine: BlendEngine) -> None:
    with pytest.raises(TypeError, match="'max_token'; did you mean 'max_tokens'"):
        BlendLLM(engine=engine, max_token=3)
    with pytest.raises(TypeError, match=r"BlendLLM.from_model_id\(model_name"):
        BlendLLM(model_name="HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(ValueError, match="generate_kwargs key 'num_beams' means nothing"):
        BlendLLM(engine=engine, generate_kwargs={"num_beams": 2})
    assert BlendLLM(engine=engine, api_key="x", timeout=5, max_retries=1).max_tokens == 256


def test_query_wrapper_prompt_string_and_context_window(
    engine: BlendEngine, prompts: list[list[Segment]]
) -> None:
    llm = BlendLLM(
        engine=engine, chat_template=False, query_wrapper_prompt="[Q] {query_str} [A]",
        context_window=64, max_tokens=4,
    )  # fmt: skip
    llm.complete("hello")
    assert text_of(prompts[-1]) == "[Q] hello [A]"
    llm.complete("hello", formatted=True)  # a formatted prompt is sent as is
    assert text_of(prompts[-1]) == "hello"
    assert llm.metadata.context_window == 64
    with pytest.raises(ValueError, match="plus max_new_tokens=4 exceeds context_window=64"):
        llm.complete("x" * 61, formatted=True)  # 61 bytes + BOS + 4 > 64
    with pytest.raises(ValueError, match="context_window=2000 is larger than tiny's 1024"):
        BlendLLM(engine=engine, context_window=2000).complete("hi")


def test_tokenizer_is_the_engines(engine: BlendEngine) -> None:
    llm = BlendLLM(engine=engine)
    assert llm.tokenizer("Marta lives") == engine.tokenize("Marta lives")
    counter = TokenCountingHandler(tokenizer=llm.tokenizer)
    assert counter.tokenizer("abc") == engine.tokenize("abc")


async def test_concurrent_async_calls_decode_together(
    engine: BlendEngine, options_seen: list[dict[str, Any]]
) -> None:
    llm = BlendLLM(engine=engine, max_tokens=5)
    questions = ["Hello", "Where is Marta?", "Hi"]
    alone = [llm.complete(q).text for q in questions]
    options_seen.clear()
    together = await asyncio.gather(*(llm.acomplete(q) for q in questions))
    assert [r.text for r in together] == alone
    assert [o.get("batch") for o in options_seen] == [3]
    chats = await asyncio.gather(
        *(llm.achat([ChatMessage(role="user", content=q)]) for q in questions)
    )
    assert options_seen[-1].get("batch") == 3 and all(c.raw for c in chats)


def test_pickle_and_deepcopy_never_touch_the_live_object(
    engine: BlendEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = BlendLLM(engine=engine, max_tokens=3, query_wrapper_prompt="Q: {query_str}")
    postprocessor = BlendNodePostprocessor(engine=engine)
    with pytest.raises(TypeError, match="cannot pickle BlendLLM: its engine wraps a model"):
        pickle.dumps(llm)  # an engine built in memory has nothing to reload from
    monkeypatch.setattr(engine, "model_spec", "tiny-spec", raising=False)
    restored = pickle.loads(pickle.dumps(llm))
    assert restored.engine is None and restored.model == "tiny-spec" and restored.max_tokens == 3
    assert llm.engine is engine and llm.complete("hi").text is not None  # untouched
    copied = copy.deepcopy(llm)
    assert copied.engine is engine and copied is not llm
    assert copied.query_wrapper_prompt is not None
    again = pickle.loads(pickle.dumps(postprocessor))
    assert again.engine is None and again.model == "tiny-spec" and postprocessor.engine is engine
    assert copy.deepcopy(postprocessor).engine is engine


# ---------------------------------------------------------------------------- postprocessor
def test_postprocessor_tags_copies_and_precomputes_the_llm_text(engine: BlendEngine) -> None:
    retrieved = nodes(DOC_A, DOC_C, "   ", file_name="notes.txt")
    for item in retrieved[1:]:
        item.node.excluded_llm_metadata_keys = ["file_name"]
    before = [item.node.model_dump() for item in retrieved]
    out = BlendNodePostprocessor(engine=engine).postprocess_nodes(retrieved)
    assert [item.node.model_dump() for item in retrieved] == before  # inputs unchanged
    assert [item.score for item in out] == [item.score for item in retrieved]
    first, second, blank = (item.node for item in out)
    llm_text = first.get_content(metadata_mode=MetadataMode.LLM)
    assert llm_text == f"file_name: notes.txt\n\n{DOC_A}"  # metadata printed before the text
    assert second.get_content(metadata_mode=MetadataMode.LLM) == DOC_C
    assert engine.is_known(llm_text) and engine.is_known(DOC_C)
    assert first.metadata[SEGMENT_ID_KEY] == engine.segment_id(llm_text)
    assert second.metadata[SEGMENT_ID_KEY] == engine.segment_id(DOC_C)
    assert engine.store.contains(engine.segment_id(DOC_C))
    assert SEGMENT_ID_KEY not in blank.metadata  # blank LLM text: not cached, not tagged
    for node in (first, second):
        assert SEGMENT_ID_KEY not in node.get_content(metadata_mode=MetadataMode.LLM)
        assert SEGMENT_ID_KEY not in node.get_content(metadata_mode=MetadataMode.EMBED)
        assert SEGMENT_ID_KEY in node.get_content(metadata_mode=MetadataMode.ALL)
    again = BlendNodePostprocessor(engine=engine).postprocess_nodes(out)  # idempotent
    assert again[0].node.excluded_llm_metadata_keys.count(SEGMENT_ID_KEY) == 1
    assert again[0].node.metadata[SEGMENT_ID_KEY] == first.metadata[SEGMENT_ID_KEY]


async def test_postprocessor_order_and_async(engine: BlendEngine) -> None:
    retrieved = nodes(DOC_A, DOC_C)
    processor = BlendNodePostprocessor(engine=engine, order="most_relevant_last")
    out = await processor.apostprocess_nodes(retrieved)
    assert [item.node.get_content() for item in out] == [DOC_C, DOC_A]


# ---------------------------------------------------------------------------- synthesizer
def test_synthesizer_puts_each_text_in_once_byte_exact(
    engine: BlendEngine, prompts: list[list[Segment]]
) -> None:
    llm = BlendLLM(engine=engine, max_tokens=3)
    processed = BlendNodePostprocessor(engine=engine).postprocess_nodes(nodes(DOC_A, DOC_B))
    synthesizer = BlendSynthesizer(llm=llm, text_qa_template=TEMPLATE)
    response = synthesizer.synthesize("Who bakes?", processed)
    assert isinstance(response, Response) and response.source_nodes == processed
    prompt = text_of(prompts[-1])
    assert f"Context:\n{DOC_A}\n\n{DOC_B}\n\nQuestion: Who bakes?\nAnswer:" in prompt
    assert [s.text for s in prompts[-1] if s.cache] == [DOC_A, DOC_B]
    synthesizer.update_prompts({"text_qa_template": PromptTemplate("{context_str}|{query_str}")})
    synthesizer.synthesize("Q", processed)
    assert f"{DOC_A}\n\n{DOC_B}|Q" in text_of(prompts[-1])


def test_synthesizer_streams(engine: BlendEngine) -> None:
    llm = BlendLLM(engine=engine, max_tokens=5)
    processed = BlendNodePostprocessor(engine=engine).postprocess_nodes(nodes(DOC_A))
    plain = BlendSynthesizer(llm=llm, text_qa_template=TEMPLATE).synthesize("Q", processed)
    streamed = BlendSynthesizer(llm=llm, text_qa_template=TEMPLATE, streaming=True).synthesize(
        "Q", processed
    )
    assert isinstance(streamed, StreamingResponse)
    assert "".join(streamed.response_gen) == plain.response


def test_blend_query_engine_over_an_index(
    engine: BlendEngine, prompts: list[list[Segment]]
) -> None:
    index = VectorStoreIndex(
        [node.node for node in nodes(DOC_A, DOC_C)], embed_model=MockEmbedding(embed_dim=8)
    )
    query_engine = blend_query_engine(
        index, BlendLLM(engine=engine, max_tokens=3), similarity_top_k=2, text_qa_template=TEMPLATE
    )
    response = query_engine.query("Where?")
    assert len(response.source_nodes) == 2
    assert all(SEGMENT_ID_KEY in item.node.metadata for item in response.source_nodes)
    segments = prompts[-1]
    assert sorted(s.text for s in segments if s.cache) == sorted([DOC_A, DOC_C])
    assert response.metadata is not None


def test_plain_query_engine_keeps_working(
    engine: BlendEngine, prompts: list[list[Segment]]
) -> None:
    index = VectorStoreIndex(
        [node.node for node in nodes(DOC_C)], embed_model=MockEmbedding(embed_dim=8)
    )
    llm = BlendLLM(engine=engine, max_tokens=3)
    response = index.as_query_engine(llm=llm, similarity_top_k=1).query("When?")
    assert isinstance(response, Response) and response.response
    assert DOC_C in text_of(prompts[-1])  # the default (compact) QA prompt reached the engine


def test_a_query_engine_response_carries_the_reuse_figures(
    engine: BlendEngine, prompts: list[list[Segment]]
) -> None:
    index = VectorStoreIndex(
        [node.node for node in nodes(DOC_A, DOC_C)], embed_model=MockEmbedding(embed_dim=8)
    )
    llm = BlendLLM(engine=engine, max_tokens=3)
    query_engine = blend_query_engine(index, llm, similarity_top_k=2, text_qa_template=TEMPLATE)
    response = query_engine.query("Where?")
    direct = llm.complete(text_of(prompts[-1]), formatted=True).raw
    figures = response.metadata["kvblend"]
    assert figures["documents_found"] == 2 and figures["prompt_tokens"] > 0
    assert {"reused_tokens", "recomputed_tokens", "computed_tokens", "fallback"} <= set(figures)
    assert response.metadata["usage"]["prompt_tokens"] == direct["usage"]["prompt_tokens"]
    assert all(item.node.node_id in response.metadata for item in response.source_nodes)
    streamed = blend_query_engine(
        index, llm, similarity_top_k=2, text_qa_template=TEMPLATE, streaming=True
    ).query("Where?")
    assert "kvblend" not in streamed.metadata  # known once the stream is read
    "".join(streamed.response_gen)
    assert streamed.metadata["kvblend"]["documents_found"] == 2


async def test_an_async_query_carries_the_reuse_figures(engine: BlendEngine) -> None:
    index = VectorStoreIndex(
        [node.node for node in nodes(DOC_A, DOC_C)], embed_model=MockEmbedding(embed_dim=8)
    )
    llm = BlendLLM(engine=engine, max_tokens=3)
    query_engine = blend_query_engine(index, llm, similarity_top_k=2, text_qa_template=TEMPLATE)
    response = await query_engine.aquery("Where?")
    assert response.metadata["kvblend"]["documents_found"] == 2
