"""`BlendLLM`: a LlamaIndex LLM whose prefill reuses the KV of known documents.

Its fields, their checks, its engine and the merging of decoding options are
`BlendLLMSettings`' (`kvblend.llamaindex._settings`); this module answers LlamaIndex's calls:
the completion and chat API (sync, streaming, async), prompts rendered with the model's chat
template, and the responses with their usage and kvblend stats. `reporting_raw` hands each
response's ``raw`` to whoever asked for it around a call that returns text only (LlamaIndex's
``predict`` and ``stream``), which is how `BlendSynthesizer` puts the reuse figures into a query
engine's ``Response.metadata``.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from llama_index.core.base.llms.generic_utils import (
    messages_to_prompt as generic_messages_to_prompt,
)
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
    TextBlock,
)
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM
from llama_index.core.llms.llm import default_completion_to_prompt

from kvblend.engine.engine import BlendEngine
from kvblend.integrations.background import gather_prompt, iterate_in_thread
from kvblend.integrations.conventions import check_context_window, load_engine
from kvblend.integrations.runs import BlendRun, run_prompt, stream_prompt
from kvblend.integrations.shared import prompt_segments
from kvblend.llamaindex._settings import BlendLLMSettings

#: Called with each response's ``raw`` (usage, kvblend stats) while `reporting_raw` is active.
_RAW_SINK: contextvars.ContextVar[Callable[[dict[str, Any]], None] | None] = contextvars.ContextVar(
    "kvblend_llamaindex_raw_sink", default=None
)


@contextlib.contextmanager
def reporting_raw(sink: Callable[[dict[str, Any]], None]) -> Iterator[None]:
    """Hand ``sink`` the ``raw`` of every `BlendLLM` response made within (this context).

    For callers of LlamaIndex APIs that return text only (``llm.predict``, ``llm.stream``): a
    stream started within reports when it ends, wherever it is read.
    """
    token = _RAW_SINK.set(sink)
    try:
        yield
    finally:
        _RAW_SINK.reset(token)


def _report(raw: dict[str, Any], sink: Callable[[dict[str, Any]], None] | None = None) -> None:
    sink = sink if sink is not None else _RAW_SINK.get()
    if sink is not None:
        sink(raw)


_ROLES = {
    MessageRole.SYSTEM: "system",
    MessageRole.DEVELOPER: "system",
    MessageRole.USER: "user",
    MessageRole.ASSISTANT: "assistant",
    MessageRole.CHATBOT: "assistant",
    MessageRole.MODEL: "assistant",
    MessageRole.TOOL: "tool",
    MessageRole.FUNCTION: "tool",
}


class BlendLLM(BlendLLMSettings, CustomLLM):
    """LlamaIndex LLM over a kvblend engine.

    Documents precomputed by the engine (for example by `BlendNodePostprocessor`) are found in
    the final prompt by exact match and their KV is reused wherever they land; everything else
    is computed normally. Chat messages go through the model's own chat template.

    Unknown constructor arguments raise one `TypeError` naming the closest field (``api_key``,
    ``timeout`` and ``max_retries`` are accepted without effect); `from_model_id` loads a model
    as ``HuggingFaceLLM(model_name=..., device_map=..., model_kwargs=...)`` does. Pickling keeps
    the engine's model spec and reloads (or shares) that engine lazily; a deep copy shares the
    live engine; neither changes this object.

    Example:
        .. code-block:: python

            from kvblend.llamaindex import BlendLLM

            llm = BlendLLM(max_tokens=64)
            print(llm.complete("Where does Marta Quill live?"))
    """

    @classmethod
    def from_model_id(
        cls,
        model_name: str,
        *,
        device: int | str | None = None,
        device_map: str | dict[str, Any] | None = None,
        dtype: Any = "auto",
        revision: str | None = None,
        trust_remote_code: bool = False,
        model_kwargs: dict[str, Any] | None = None,
        engine_kwargs: dict[str, Any] | None = None,
        **fields: Any,
    ) -> BlendLLM:
        """Load ``model_name`` and build the LLM on it, as ``HuggingFaceLLM(model_name=...)``.

        ``model_name`` is a hub id (needs the Hugging Face cache or a network), a folder or a
        GGUF file. ``device`` / ``device_map`` (one device: ``"auto"``, ``"cpu"``,
        ``"cuda:0"``), ``dtype`` (default ``"auto"``: bfloat16 where the device has bfloat16
        matrix units unless the checkpoint is float32, else float32), ``revision``,
        ``trust_remote_code`` and ``model_kwargs``
        (loading options such as ``attn_implementation``; ``torch_dtype`` is read as
        ``dtype``) go to transformers; ``engine_kwargs`` to `BlendEngine` (``store``,
        ``system_prompt``...); other keywords are the LLM's fields (``generate_kwargs``,
        ``context_window``, ``max_new_tokens``...).
        """
        engine = load_engine(
            model_name,
            device=device,
            device_map=device_map,
            dtype=dtype,
            revision=revision,
            trust_remote_code=trust_remote_code,
            model_kwargs=model_kwargs,
            engine_kwargs=engine_kwargs,
        )
        return cls(engine=engine, model=engine.model_spec, **fields)

    @classmethod
    def class_name(cls) -> str:
        """Name LlamaIndex serializes this class under."""
        return "kvblend_llm"

    @property
    def metadata(self) -> LLMMetadata:
        """Context window of the loaded model (loads it), output budget and chat mode."""
        return LLMMetadata(
            context_window=self.context_window or self.get_engine().context_window,
            num_output=self._options({})["max_new_tokens"],
            is_chat_model=self.chat_template,
            model_name=self.model_name,
        )

    # ------------------------------------------------------------------ prompts
    def _completion_prompt(self, prompt: str, formatted: bool) -> str:
        if formatted:
            return prompt
        if self.query_wrapper_prompt is not None:
            prompt = self.query_wrapper_prompt.format(query_str=prompt)
        convert = self.completion_to_prompt
        if convert is not None and convert is not default_completion_to_prompt:
            return convert(prompt)
        if self.chat_template:
            system = (
                [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
            )
            user = [{"role": "user", "content": prompt}]
            return self.get_engine().apply_chat_template(system + user)
        return f"{self.system_prompt}\n\n{prompt}" if self.system_prompt else prompt

    def _chat_prompt(self, messages: Sequence[ChatMessage]) -> str:
        render = self.messages_to_prompt or generic_messages_to_prompt
        if render is not generic_messages_to_prompt or not self.chat_template:
            return render(messages)
        chat = [{"role": _role(message), "content": _text(message)} for message in messages]
        return self.get_engine().apply_chat_template(chat)

    def _prepared(self, prompt: str, options: dict[str, Any]) -> tuple[BlendEngine, list[Any]]:
        """Return the engine and the prompt's segments, once it fits ``context_window``."""
        engine = self.get_engine()
        check_context_window(engine, prompt, options["max_new_tokens"], self.context_window)
        segments = prompt_segments(
            engine, prompt, separator=self.separator, cache_prefix=self.cache_prefix
        )
        return engine, segments

    # ------------------------------------------------------------------ runs
    def _raw(self, run: BlendRun) -> dict[str, Any]:
        """Usage (read by `TokenCountingHandler`), reused tokens and the prefill's stats."""
        prompt_tokens = run.stats.prompt_tokens
        return {
            "model": self.model_name,
            "finish_reason": run.finish_reason,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": run.output_tokens,
                "total_tokens": prompt_tokens + run.output_tokens,
                "prompt_tokens_details": {"cached_tokens": run.stats.reused_tokens},
            },
            "kvblend": run.kvblend_metadata(),
        }

    def _complete(self, prompt: str, options: dict[str, Any]) -> CompletionResponse:
        engine, segments = self._prepared(prompt, options)
        run = run_prompt(engine, segments, self.blend_config, options)
        raw = self._raw(run)
        _report(raw)
        return CompletionResponse(text=run.text, raw=raw)

    async def _acomplete(self, prompt: Any, kwargs: dict[str, Any]) -> CompletionResponse:
        """`_complete` from asyncio, decoded together with the loop's concurrent calls.

        ``prompt`` renders the prompt text (milliseconds, run on the loop once the model is
        loaded). LlamaIndex's async fan-out (``tree_summarize`` with ``use_async``,
        ``asyncio.gather`` of queries) thus gets one batched decode.
        """
        if self.engine is None and self._engine is None:
            await asyncio.to_thread(self.get_engine)  # a first load takes seconds: off the loop
        options = self._options(kwargs)
        engine, segments = self._prepared(prompt(), options)
        run = await gather_prompt(engine, segments, self.blend_config, options)
        raw = self._raw(run)
        _report(raw)
        return CompletionResponse(text=run.text, raw=raw)

    def _stream(
        self,
        prompt: str,
        options: dict[str, Any],
        sink: Callable[[dict[str, Any]], None] | None = None,
    ) -> CompletionResponseGen:
        """Responses as text is decoded; a last one with an empty delta carries ``raw``.

        ``sink`` (default: `reporting_raw`'s, as the stream is started) receives ``raw`` then.
        """
        sink = sink if sink is not None else _RAW_SINK.get()

        def responses() -> CompletionResponseGen:
            engine, segments = self._prepared(prompt, options)
            text = ""
            for item in stream_prompt(engine, segments, self.blend_config, options):
                if isinstance(item, BlendRun):
                    raw = self._raw(item)
                    _report(raw, sink)
                    yield CompletionResponse(text=text, delta="", raw=raw)
                else:
                    text += item
                    yield CompletionResponse(text=text, delta=item)

        return responses()

    def _complete_body(
        self, prompt: str, formatted: bool, kwargs: dict[str, Any]
    ) -> CompletionResponse:
        options = self._options(kwargs)
        return self._complete(self._completion_prompt(prompt, formatted), options)

    def _chat_body(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> ChatResponse:
        options = self._options(kwargs)
        return _chat_response(self._complete(self._chat_prompt(messages), options))

    # ------------------------------------------------------------------ completion API
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        """Complete ``prompt``; ``raw`` holds usage and the prefill's kvblend stats."""
        return self._complete_body(prompt, formatted, kwargs)

    @llm_completion_callback()
    def stream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseGen:
        """Stream the completion; the last response (empty delta) carries ``raw``."""
        options = self._options(kwargs)
        return self._stream(self._completion_prompt(prompt, formatted), options)

    @llm_completion_callback()
    async def acomplete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponse:
        """Like `complete`; decoded in a thread, together with concurrent calls."""
        return await self._acomplete(lambda: self._completion_prompt(prompt, formatted), kwargs)

    @llm_completion_callback()
    async def astream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseAsyncGen:
        """Like `stream_complete`; the engine runs in a thread feeding the event loop."""
        options = self._options(kwargs)
        text = await asyncio.to_thread(self._completion_prompt, prompt, formatted)
        sink = _RAW_SINK.get()
        return iterate_in_thread(lambda: self._stream(text, options, sink))

    # ------------------------------------------------------------------ chat API
    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        """Answer ``messages`` rendered with the model's chat template."""
        return self._chat_body(messages, kwargs)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        """Stream the answer; the last response (empty delta) carries ``raw``."""
        options = self._options(kwargs)
        return _chat_stream(self._stream(self._chat_prompt(messages), options))

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        """Like `chat`; decoded in a thread, together with concurrent calls."""
        return _chat_response(await self._acomplete(lambda: self._chat_prompt(messages), kwargs))

    @llm_chat_callback()
    async def astream_chat(
        self, messages: Sequence[ChatMessage], **kwargs: Any
    ) -> ChatResponseAsyncGen:
        """Like `stream_chat`; the engine runs in a thread feeding the event loop."""
        options = self._options(kwargs)
        prompt = await asyncio.to_thread(self._chat_prompt, messages)
        sink = _RAW_SINK.get()
        return iterate_in_thread(lambda: _chat_stream(self._stream(prompt, options, sink)))


def _chat_response(response: CompletionResponse) -> ChatResponse:
    message = ChatMessage(role=MessageRole.ASSISTANT, content=response.text)
    return ChatResponse(message=message, delta=response.delta, raw=response.raw)


def _chat_stream(responses: Iterator[CompletionResponse]) -> ChatResponseGen:
    for response in responses:
        yield _chat_response(response)


def _role(message: ChatMessage) -> str:
    role = _ROLES.get(MessageRole(message.role))
    if role is None:  # pragma: no cover - every MessageRole is mapped
        raise ValueError(f"BlendLLM cannot send a {message.role!r} message to the model")
    return role


def _text(message: ChatMessage) -> str:
    """Return the message's text exactly as written (documents in it must stay byte-exact)."""
    for block in message.blocks:
        if not isinstance(block, TextBlock):
            raise ValueError(f"BlendLLM takes text only; got a {type(block).__name__}")
    return message.content or ""
