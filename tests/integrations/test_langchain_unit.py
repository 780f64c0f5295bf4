"""LangChain adapters without a model: the standard unit suite and the adapters' own logic.

A small fake engine stands in for `BlendEngine` (word "tokens", a canned reply), so these tests
check what the adapters send to the engine and how they report it, in milliseconds.
"""

from __future__ import annotations

import asyncio
import copy
import importlib
import pickle
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from langchain_core.callbacks import AsyncCallbackHandler, BaseCallbackHandler
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_tests.unit_tests import ChatModelUnitTests

from kvblend import BlendConfig, BlendStats, GenerationResult, Segment
from kvblend.integrations import background
from kvblend.integrations import shared as _adapters
from kvblend.langchain import BlendLLM, ChatBlend
from kvblend.matching import split_prompt

DOC_A = "Marta Quill lives in Lisbon."
DOC_B = "Tomas Reed works as a baker."


class FakePrefill:
    def __init__(self, stats: BlendStats) -> None:
        self.stats = stats


class FakeEngine:
    """Records what the adapters ask for; 'tokens' are whitespace-separated words."""

    name = "fake-model"

    def __init__(
        self, documents: Sequence[str] = (), reply: str = "Hello there, dear friend."
    ) -> None:
        self.documents = {text: f"seg{i}" for i, text in enumerate(documents)}
        self.reply = reply
        self.segments: list[list[Segment]] = []
        self.options: list[dict[str, Any]] = []
        self.configs: list[BlendConfig | None] = []
        self.batches: list[int] = []  # sizes of the generate_batch calls
        self.model_spec = "fake-model"

    def segments_for(self, prompt: str, *, cache_prefix: bool = False) -> list[Segment]:
        return split_prompt(prompt, self.documents, prefix_role=cache_prefix)

    def is_known(self, text: str) -> bool:
        return text in self.documents

    def segment_id(self, text: str) -> str:
        return self.documents[text]

    def tokenize(self, text: str) -> list[int]:
        return [len(word) for word in text.split()]

    def apply_chat_template(self, messages: Sequence[dict[str, str]]) -> str:
        return (
            "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages) + "<assistant>"
        )

    def prefill(
        self, segments: list[Segment], config: BlendConfig | None = None, *, cancel: Any = None
    ) -> FakePrefill:
        self.segments.append(list(segments))
        self.configs.append(config)
        stats = BlendStats(strategy=(config or BlendConfig()).strategy)
        stats.prompt_tokens = sum(len(self.tokenize(s.text)) for s in segments)
        stats.reused_tokens = sum(len(self.tokenize(s.text)) for s in segments if s.cache)
        stats.computed_tokens = stats.prompt_tokens - stats.reused_tokens
        return FakePrefill(stats)

    def _pieces(self, max_new_tokens: int, stop: Sequence[str] | None) -> list[str]:
        words = self.reply.split(" ")[:max_new_tokens]
        text = " ".join(words)
        for s in stop or ():
            if s in text:
                text = text[: text.index(s)]
        pieces = [w + " " for w in text.split(" ")]
        pieces[-1] = pieces[-1][:-1]
        return [p for p in pieces if p]

    def generate(
        self, segments: list[Segment], config: BlendConfig | None = None, **options: Any
    ) -> GenerationResult:
        stats = self.prefill(segments, config).stats
        self.options.append(options)
        text = "".join(self._pieces(options["max_new_tokens"], options["stop"]))
        return GenerationResult(text, self.tokenize(text), 0.01, 0.02, stats, "stop")

    def generate_batch(
        self, prompts: list[list[Segment]], config: BlendConfig | None = None, **options: Any
    ) -> list[GenerationResult]:
        self.batches.append(len(prompts))
        return [self.generate(prompt, config, **options) for prompt in prompts]

    def stream(self, prefill: FakePrefill, **options: Any) -> Iterator[str]:
        self.options.append(options)
        for piece in self._pieces(options["max_new_tokens"], options["stop"]):
            time.sleep(0.01)
            yield piece


def chat_with(engine: FakeEngine, **fields: Any) -> ChatBlend:
    chat = ChatBlend(model="fake-model", **fields)
    chat._engine = engine  # type: ignore[assignment]  # the private slot the lazy load fills
    return chat


def llm_with(engine: FakeEngine, **fields: Any) -> BlendLLM:
    llm = BlendLLM(model="fake-model", **fields)
    llm._engine = engine  # type: ignore[assignment]
    return llm


# ---------------------------------------------------------------------------- standard suite
class TestChatBlendUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatBlend]:
        return ChatBlend

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"model": "never-loaded-in-unit-tests"}

    @property
    def supports_model_override(self) -> bool:
        return False  # one engine per instance; switching models per call is refused


# ---------------------------------------------------------------------------- packaging
def test_import_without_langchain_core_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(sys.modules):
        if name == "kvblend.langchain" or name.startswith("kvblend.langchain."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "langchain_core", None)  # makes `import langchain_core` fail
    # the extra's package, and the clone's install (kvblend is on no package index)
    wanted = (
        r"langchain-core: pip install 'langchain-core>=1\.0' .*pip install -e '\.\[langchain\]'"
    )
    with pytest.raises(ImportError, match=wanted):
        importlib.import_module("kvblend.langchain")


def test_core_package_does_not_import_langchain() -> None:
    code = (
        "import sys, kvblend, kvblend.matching; "
        "bad = sorted(m for m in sys.modules if m.startswith(('langchain', 'llama_index'))); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[str | None]:
    """Model specs `BlendEngine.from_pretrained` was asked to load (each gives a FakeEngine)."""
    specs: list[str | None] = []

    def fake_load(model: str | None = None, **_: Any) -> FakeEngine:
        specs.append(model)
        return FakeEngine()

    monkeypatch.setattr(_adapters, "_ENGINES", {})
    monkeypatch.setattr(_adapters.BlendEngine, "from_pretrained", fake_load)
    return specs


def test_engine_is_loaded_lazily_and_once_per_model_spec(loads: list[str | None]) -> None:
    models = [ChatBlend(model="spec-a") for _ in range(5)] + [BlendLLM(model="spec-a")]
    assert loads == []  # construction never loads
    engines = {id(m._get_engine()) for m in models}
    assert len(engines) == 1 and loads == ["spec-a"]
    ChatBlend(model="spec-b")._get_engine()
    assert loads == ["spec-a", "spec-b"]


def test_an_engine_given_to_one_adapter_serves_those_built_without_one(
    loads: list[str | None], caplog: pytest.LogCaptureFixture
) -> None:
    from conftest import byte_tokenizer, tiny_model
    from kvblend import BlendEngine
    from kvblend.langchain import BlendRetriever
    from kvblend.store import MemoryKVStore

    given = BlendEngine(tiny_model("llama"), byte_tokenizer(), store=MemoryKVStore(), name="a")
    given.model_spec = _adapters.resolve_model("spec-a")  # as from_pretrained records it
    ChatBlend(engine=given)
    from langchain_core.retrievers import BaseRetriever

    class NoDocuments(BaseRetriever):
        def _get_relevant_documents(self, query: str, *, run_manager: Any) -> list[Any]:
            return []

    assert BlendRetriever(retriever=NoDocuments(), model="spec-a")._get_engine() is given
    assert loads == []  # no second copy of the model
    with caplog.at_level("WARNING"):
        ChatBlend(model="spec-b")._get_engine()  # another model: loaded, and said so
    assert loads == [_adapters.resolve_model("spec-b")]
    assert "another model in memory" in caplog.text


def test_ls_params_do_not_load_the_model() -> None:
    chat = ChatBlend(model="some/model", max_tokens=7, stop=["x"])
    params = chat._get_ls_params()
    assert params["ls_model_name"] == "some/model"
    assert params["ls_max_tokens"] == 7 and params["ls_stop"] == ["x"]
    assert chat._engine is None
    assert BlendLLM(model="m")._get_ls_params(model="other")["ls_model_name"] == "other"


# ---------------------------------------------------------------------------- chat model
def test_chat_finds_documents_in_the_rendered_prompt() -> None:
    engine = FakeEngine([DOC_A, DOC_B])
    chat = chat_with(engine)
    message = chat.invoke(
        [SystemMessage("Be brief."), HumanMessage(f"Context:\n{DOC_B}\n\n{DOC_A}\nWhere?")]
    )
    segments = engine.segments[-1]
    assert [s.text for s in segments if s.cache] == [DOC_B, DOC_A]
    assert "".join(s.text for s in segments) == (
        f"<system>Be brief.</system><user>Context:\n{DOC_B}\n\n{DOC_A}\nWhere?</user><assistant>"
    )
    assert message.content == "Hello there, dear friend."
    usage = message.usage_metadata
    assert usage is not None
    assert usage["input_token_details"]["cache_read"] == 11  # both documents, in words
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert message.response_metadata["model_name"] == "fake-model"
    assert message.response_metadata["kvblend"]["reused_tokens"] == 11


def test_chat_without_known_documents_runs_a_plain_prefill() -> None:
    engine = FakeEngine([DOC_A])
    chat_with(engine).invoke("No documents here.")
    assert [s.cache for s in engine.segments[-1]] == [False]


def test_chat_roles_and_text_blocks() -> None:
    engine = FakeEngine()
    chat = chat_with(engine)
    chat.invoke(
        [
            HumanMessage(content=[{"type": "text", "text": "a{b}"}, {"type": "text", "text": "c"}]),
            AIMessage("d"),
            ToolMessage("e", tool_call_id="1"),
        ]
    )
    prompt = "".join(s.text for s in engine.segments[-1])
    assert prompt == "<user>a{b}c</user><assistant>d</assistant><tool>e</tool><assistant>"
    with pytest.raises(ValueError, match="text only"):
        chat.invoke([HumanMessage(content=[{"type": "image", "url": "http://x/y.png"}])])


def test_options_fields_call_overrides_and_stop_precedence() -> None:
    engine = FakeEngine()
    chat = chat_with(engine, max_tokens=3, temperature=0.5, top_p=0.9, seed=7, stop=["dear"])
    assert chat.invoke("hi").content == "Hello there, "
    assert engine.options[-1] == {
        "max_new_tokens": 3, "temperature": 0.5, "top_p": 0.9, "seed": 7, "stop": ["dear"],
        "top_k": 0, "repetition_penalty": 1.0,
    }  # fmt: skip
    chat.invoke("hi", stop=["there"], max_tokens=2, temperature=0.0)
    assert engine.options[-1]["stop"] == ["there"]
    assert engine.options[-1]["max_new_tokens"] == 2 and engine.options[-1]["temperature"] == 0.0
    chat_with(engine, stop=[]).invoke("hi")
    assert engine.options[-1]["stop"] is None


def test_hf_generation_options_as_fields_model_kwargs_and_call_kwargs() -> None:
    engine = FakeEngine()
    chat = chat_with(
        engine, max_new_tokens=5, top_k=40, do_sample=True, model_kwargs={"repetition_penalty": 1.2}
    )
    chat.invoke("hi")
    assert engine.options[-1] | {"stop": None} == {
        "max_new_tokens": 5, "temperature": 0.0, "top_p": 1.0, "top_k": 40, "do_sample": True,
        "repetition_penalty": 1.2, "stop": None,
    }  # fmt: skip
    chat.invoke("hi", max_new_tokens=2, top_k=3, repetition_penalty=1.5, do_sample=False)
    assert engine.options[-1]["max_new_tokens"] == 2 and engine.options[-1]["top_k"] == 3
    assert engine.options[-1]["repetition_penalty"] == 1.5
    assert engine.options[-1]["do_sample"] is False
    with pytest.raises(ValueError, match="disagree"):
        chat.invoke("hi", max_tokens=2, max_new_tokens=3)
    llm = llm_with(engine, top_k=7)
    llm.invoke("hi", max_new_tokens=4)
    assert engine.options[-1]["top_k"] == 7 and engine.options[-1]["max_new_tokens"] == 4


def test_unknown_constructor_arguments_are_one_clear_error() -> None:
    with pytest.raises(
        TypeError, match="unexpected argument 'max_token'; did you mean 'max_tokens'"
    ):
        ChatBlend(model="fake-model", max_token=5)
    with pytest.raises(TypeError, match="unexpected argument 'generate_kwargs'"):
        BlendLLM(model="fake-model", generate_kwargs={})
    with pytest.raises(ValueError, match="model_kwargs key 'num_beams' means nothing"):
        ChatBlend(model="fake-model", model_kwargs={"num_beams": 2})
    with pytest.raises(ValueError, match="did you mean 'top_k'"):
        ChatBlend(model="fake-model", model_kwargs={"topk": 2})
    with pytest.raises(ValueError, match="both as an argument and in model_kwargs"):
        ChatBlend(model="fake-model", top_k=2, model_kwargs={"top_k": 3})
    with pytest.raises(ValueError, match="disagree"):
        ChatBlend(model="fake-model", max_tokens=2, max_new_tokens=3)
    # what LangChain's test suites pass to every chat model is accepted and has no effect
    chat = ChatBlend(model="fake-model", api_key="x", timeout=60, max_retries=2, streaming=True)
    assert not hasattr(chat, "api_key") and chat.streaming


def test_context_window_is_checked_with_one_error() -> None:
    engine = FakeEngine()
    engine.context_window = 10  # type: ignore[attr-defined]
    engine.encode = engine.tokenize  # type: ignore[attr-defined]
    chat = chat_with(engine, context_window=8, max_tokens=3)
    assert chat.invoke("a b").content  # the rendered prompt is 1 "token" + 3 <= 8
    with pytest.raises(ValueError, match=r"plus max_new_tokens=3 exceeds context_window=8"):
        chat.invoke("a b c d e f g")
    with pytest.raises(ValueError, match="context_window=11 is larger than fake-model's 10"):
        chat_with(engine, context_window=11).invoke("hi")


def test_unknown_kwargs_and_model_override_are_refused() -> None:
    chat = chat_with(FakeEngine())
    with pytest.raises(TypeError, match="frequency_penalty"):
        chat.invoke("hi", frequency_penalty=1.0)
    with pytest.raises(TypeError, match="did you mean 'top_k'"):
        chat.invoke("hi", topk=1.0)
    with pytest.raises(ValueError, match="per-call model"):
        chat.invoke("hi", model="another-model")
    assert chat.invoke("hi", model="fake-model").content  # naming its own model is fine


def test_blend_config_and_separator_mode_reach_the_engine() -> None:
    engine = FakeEngine([DOC_A])
    config = BlendConfig(strategy="epic", epic_tokens=4)
    llm = llm_with(engine, blend_config=config, separator="<SEP>", chat_template=False)
    llm.invoke(f"Head<SEP>{DOC_B}<SEP>{DOC_A}<SEP>Question?")
    assert engine.configs[-1] is config
    assert [(s.text, s.cache) for s in engine.segments[-1]] == [
        ("Head", False), (DOC_B, True), (DOC_A, True), ("Question?", False)
    ]  # fmt: skip


def test_cache_prefix_marks_the_template_head() -> None:
    engine = FakeEngine([DOC_A])
    llm_with(engine, cache_prefix=True).invoke(f"System head\n{DOC_A}\nQ?")
    assert [s.role for s in engine.segments[-1]] == ["prefix", "document", "document"]


def test_chat_stream_chunks_and_usage_on_the_last_chunk() -> None:
    engine = FakeEngine([DOC_A])
    chunks = list(chat_with(engine).stream(f"{DOC_A} Where?"))
    assert "".join(c.text for c in chunks) == "Hello there, dear friend."
    assert len([c for c in chunks if c.text]) == 4
    with_usage = [c for c in chunks if c.usage_metadata]
    assert len(with_usage) == 1 and with_usage[0] is chunks[-1]
    assert chunks[-1].chunk_position == "last"
    assert chunks[-1].usage_metadata["input_token_details"]["cache_read"] == 5
    assert chunks[-1].usage_metadata["output_tokens"] == 4
    full = chunks[0]
    for chunk in chunks[1:]:
        full += chunk
    assert full.response_metadata["model_name"] == "fake-model"


async def test_chat_astream_does_not_block_the_event_loop() -> None:
    chat = chat_with(FakeEngine(reply=" ".join(["word"] * 30)))
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.005)
            ticks += 1

    task = asyncio.create_task(ticker())
    pieces = [chunk.text async for chunk in chat.astream("hi")]
    task.cancel()
    assert "".join(pieces).split() == ["word"] * 30
    assert ticks >= 10  # the loop kept running while the (fake) engine slept 0.3 s


async def test_astream_stops_the_producer_when_the_consumer_leaves() -> None:
    produced: list[int] = []

    def numbers() -> Iterator[int]:
        for i in range(1000):
            produced.append(i)
            time.sleep(0.002)
            yield i

    async for item in background.iterate_in_thread(numbers):
        if item == 3:
            break
    await asyncio.sleep(0.05)
    assert len(produced) < 100


async def test_astream_reraises_engine_errors() -> None:
    def failing() -> Iterator[int]:
        yield 1
        raise RuntimeError("engine failed")

    with pytest.raises(RuntimeError, match="engine failed"):
        async for _ in background.iterate_in_thread(failing):
            pass


async def test_chat_ainvoke_and_abatch() -> None:
    chat = chat_with(FakeEngine())
    assert (await chat.ainvoke("hi")).content == "Hello there, dear friend."
    assert [m.content for m in await chat.abatch(["a", "b"])] == ["Hello there, dear friend."] * 2


# ---------------------------------------------------------------------------- string LLM
class TokenRecorder(BaseCallbackHandler):
    def __init__(self) -> None:
        self.tokens: list[str] = []

    def on_llm_new_token(self, token: str, **kwargs: Any) -> None:
        self.tokens.append(token)


class AsyncTokenRecorder(AsyncCallbackHandler):
    def __init__(self) -> None:
        self.tokens: list[str] = []

    async def on_llm_new_token(self, token: str, **kwargs: Any) -> None:
        self.tokens.append(token)


def test_llm_generate_reports_usage_and_stats() -> None:
    engine = FakeEngine([DOC_A, DOC_B])
    result = llm_with(engine).generate([f"C: {DOC_A}\n{DOC_B}\nQ?", "no docs"])
    first, second = (g[0].generation_info for g in result.generations)
    assert first["usage_metadata"]["input_token_details"]["cache_read"] == 11
    assert second["usage_metadata"]["input_token_details"]["cache_read"] == 0
    assert first["kvblend"]["segments_cached"] == 0  # what the (fake) engine reported
    assert result.llm_output["token_usage"]["cache_read_tokens"] == 11
    assert result.llm_output["model_name"] == "fake-model"


def test_llm_stream_fires_token_callbacks() -> None:
    recorder = TokenRecorder()
    pieces = list(llm_with(FakeEngine()).stream("hi", config={"callbacks": [recorder]}))
    assert "".join(pieces) == "Hello there, dear friend."
    assert recorder.tokens == ["Hello ", "there, ", "dear ", "friend."]


def test_llm_streaming_field_streams_inside_invoke() -> None:
    recorder = TokenRecorder()
    llm = llm_with(FakeEngine(), streaming=True)
    assert llm.invoke("hi", config={"callbacks": [recorder]}) == "Hello there, dear friend."
    assert recorder.tokens == ["Hello ", "there, ", "dear ", "friend."]


async def test_llm_astream_fires_async_token_callbacks() -> None:
    recorder = AsyncTokenRecorder()
    llm = llm_with(FakeEngine())
    pieces = [p async for p in llm.astream("hi", config={"callbacks": [recorder]})]
    assert "".join(pieces) == "Hello there, dear friend."
    assert recorder.tokens == ["Hello ", "there, ", "dear ", "friend."]
    assert await llm.ainvoke("hi", stop=["dear"]) == "Hello there, "


def test_llm_applies_the_chat_template_by_default() -> None:
    engine = FakeEngine([DOC_A])
    llm_with(engine).invoke(f"Context: {DOC_A}")
    segments = engine.segments[-1]
    assert "".join(s.text for s in segments) == f"<user>Context: {DOC_A}</user><assistant>"
    assert [s.text for s in segments if s.cache] == [DOC_A]
    llm_with(engine, chat_template=False).invoke(f"Context: {DOC_A}")
    assert "".join(s.text for s in engine.segments[-1]) == f"Context: {DOC_A}"


def test_chat_batch_and_abatch_decode_together() -> None:
    engine = FakeEngine()
    chat = chat_with(engine, max_tokens=2)
    answers = chat.batch(["a", "b", "c"], stop=["zzz"])
    assert [m.content for m in answers] == ["Hello there,"] * 3
    assert engine.batches == [3] and len(engine.segments) == 3  # no second run per invoke
    assert all(m.usage_metadata is not None for m in answers)
    assert asyncio.run(_abatch(chat, ["d", "e", "f", "g"])) == ["Hello there,"] * 4
    assert engine.batches == [3, 4] and len(engine.segments) == 7


async def _abatch(chat: ChatBlend, inputs: list[str]) -> list[Any]:
    return [m.content for m in await chat.abatch(inputs)]


def test_llm_batch_decodes_together_and_streaming_ainvoke_fires_callbacks() -> None:
    engine = FakeEngine()
    llm = llm_with(engine, max_tokens=2)
    assert llm.batch(["a", "b"]) == ["Hello there,"] * 2
    assert engine.batches == [2]

    class Tokens(AsyncCallbackHandler):
        def __init__(self) -> None:
            self.tokens: list[str] = []

        async def on_llm_new_token(self, token: str, **kwargs: Any) -> None:
            self.tokens.append(token)

    handler = Tokens()
    streaming = llm_with(engine, max_tokens=3, streaming=True)
    text = asyncio.run(streaming.ainvoke("hi", config={"callbacks": [handler]}))
    assert handler.tokens == ["Hello ", "there, ", "dear"] and text == "".join(handler.tokens)


def test_token_counts_use_the_engines_tokenizer() -> None:
    engine = FakeEngine()
    engine.encode = engine.tokenize  # type: ignore[attr-defined]
    chat = chat_with(engine)
    assert chat.get_token_ids("one two three") == [3, 3, 5]
    assert chat.get_num_tokens("one two three") == 3
    messages = [SystemMessage("be brief"), HumanMessage("one two three")]
    rendered = chat._prompt(messages)
    assert chat.get_num_tokens_from_messages(messages) == len(rendered.split())
    assert llm_with(engine).get_num_tokens("a b") == 2
    custom = chat_with(engine, custom_get_token_ids=lambda text: [0] * len(text))
    assert custom.get_num_tokens("abc") == 3


def test_pickle_and_deepcopy_never_touch_the_live_object() -> None:
    engine = FakeEngine()
    chat = chat_with(engine, max_tokens=7)
    copied = copy.deepcopy(chat)
    assert copied._engine is engine and copied.max_tokens == 7  # the live engine is shared
    restored = pickle.loads(pickle.dumps(chat))
    assert restored._engine is None and restored.model == "fake-model"  # reloaded on use
    assert restored.max_tokens == 7
    assert chat._engine is engine and chat.invoke("hi").content  # the original still works
    llm = llm_with(engine)
    assert pickle.loads(pickle.dumps(llm)).model == "fake-model" and llm._engine is engine
    del engine.model_spec  # an engine with nothing to reload from: one clear error
    with pytest.raises(TypeError, match="cannot pickle ChatBlend: its engine wraps a model"):
        pickle.dumps(chat)
