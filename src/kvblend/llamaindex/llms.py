"""`BlendLLM`: a LlamaIndex LLM whose prefill reuses the KV of known documents."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
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
from llama_index.core.bridge.pydantic import ConfigDict, Field, PrivateAttr, field_validator
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM
from llama_index.core.llms.llm import default_completion_to_prompt

from .._adapters import (
    BlendRun,
    adopt_engine,
    iterate_in_thread,
    lazy_engine,
    model_name,
    prompt_segments,
    run_in_thread,
    run_prompt,
    stream_prompt,
)
from ..engine import BlendConfig, BlendEngine

# Per-call keyword arguments accepted by complete()/chat() and their streaming variants.
_CALL_OPTIONS = ("max_tokens", "temperature", "top_p", "seed", "stop")

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


class BlendLLM(CustomLLM):
    """LlamaIndex LLM over a kvblend engine.

    Documents precomputed by the engine (for example by `BlendNodePostprocessor`) are found in
    the final prompt by exact match and their KV is reused wherever they land; everything else
    is computed normally. Chat messages go through the model's own chat template.

    Example:
        .. code-block:: python

            from kvblend.llamaindex import BlendLLM

            llm = BlendLLM(max_tokens=64)
            print(llm.complete("Where does Marta Quill live?"))
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    engine: BlendEngine | None = Field(
        default=None,
        exclude=True,
        description="A ready BlendEngine (share it with BlendNodePostprocessor). When None, one "
        "is built on first use from `model` and shared per model spec.",
    )
    model: str | None = Field(
        default=None,
        description="Model to load when no `engine` is given: a folder, GGUF file or hub id. "
        "None means KVBLEND_MODEL or the bundled SmolLM2-135M-Instruct.",
    )
    blend_config: BlendConfig | None = Field(
        default=None,
        description="How the blended prefill recomputes reused tokens (None = BlendConfig()).",
    )
    max_tokens: int = Field(default=256, ge=1, description="Largest number of tokens to generate.")
    temperature: float = Field(
        default=0.0, ge=0.0, description="Sampling temperature; 0 decodes greedily."
    )
    top_p: float = Field(
        default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass (when temperature > 0)."
    )
    seed: int | None = Field(default=None, description="Random seed for sampling.")
    stop: list[str] | None = Field(
        default=None, description="Stop sequences: the output is cut before the first one."
    )
    separator: str | None = Field(
        default=None,
        description="Explicit separator mode: split the prompt on this string (removed) and "
        "treat each piece between two separators as a cached document.",
    )
    cache_prefix: bool = Field(
        default=False,
        description="Also cache the text before the first document as a prefix reused at its "
        "own position.",
    )
    chat_template: bool = Field(
        default=True,
        description="Use the model's chat template: chat messages are rendered with it and a "
        "complete() prompt (unless formatted=True) is sent as one user message. Reported as "
        "metadata.is_chat_model, so query engines send chat messages.",
    )

    _engine: BlendEngine | None = PrivateAttr(default=None)

    @field_validator("engine")
    @classmethod
    def _share_engine(cls, engine: BlendEngine | None) -> BlendEngine | None:
        return adopt_engine(engine)

    @classmethod
    def class_name(cls) -> str:
        """Name LlamaIndex serializes this class under."""
        return "kvblend_llm"

    def get_engine(self) -> BlendEngine:
        """Return the engine, loading the shared one for ``model`` on first use."""
        return lazy_engine(self)

    @property
    def model_name(self) -> str:
        """Name of the model, without loading it."""
        return model_name(self.engine or self._engine, self.model)

    @property
    def metadata(self) -> LLMMetadata:
        """Context window of the loaded model (loads it), output budget and chat mode."""
        return LLMMetadata(
            context_window=self.get_engine().context_window,
            num_output=self.max_tokens,
            is_chat_model=self.chat_template,
            model_name=self.model_name,
        )

    # ------------------------------------------------------------------ prompts
    def _completion_prompt(self, prompt: str, formatted: bool) -> str:
        if formatted:
            return prompt
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

    def _options(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Merge the fields with one call's keyword arguments into decoding options."""
        unknown = set(kwargs) - set(_CALL_OPTIONS)
        if unknown:
            raise TypeError(f"unexpected keyword arguments: {', '.join(sorted(unknown))}")
        values = {name: kwargs.get(name, getattr(self, name)) for name in _CALL_OPTIONS}
        return {
            "max_new_tokens": values["max_tokens"],
            "temperature": values["temperature"],
            "top_p": values["top_p"],
            "seed": values["seed"],
            "stop": values["stop"] or None,
        }

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
        engine = self.get_engine()
        segments = prompt_segments(
            engine, prompt, separator=self.separator, cache_prefix=self.cache_prefix
        )
        run = run_prompt(engine, segments, self.blend_config, options)
        return CompletionResponse(text=run.text, raw=self._raw(run))

    def _stream(self, prompt: str, options: dict[str, Any]) -> CompletionResponseGen:
        """Responses as text is decoded; a last one with an empty delta carries ``raw``."""
        engine = self.get_engine()
        segments = prompt_segments(
            engine, prompt, separator=self.separator, cache_prefix=self.cache_prefix
        )
        text = ""
        for item in stream_prompt(engine, segments, self.blend_config, options):
            if isinstance(item, BlendRun):
                yield CompletionResponse(text=text, delta="", raw=self._raw(item))
            else:
                text += item
                yield CompletionResponse(text=text, delta=item)

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
        """Like `complete`, run in a thread so the event loop keeps running."""
        return await run_in_thread(self._complete_body, prompt, formatted, kwargs)

    @llm_completion_callback()
    async def astream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseAsyncGen:
        """Like `stream_complete`; the engine runs in a thread feeding the event loop."""
        options = self._options(kwargs)
        text = await asyncio.to_thread(self._completion_prompt, prompt, formatted)
        return iterate_in_thread(lambda: self._stream(text, options))

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
        """Like `chat`, run in a thread so the event loop keeps running."""
        return await run_in_thread(self._chat_body, messages, kwargs)

    @llm_chat_callback()
    async def astream_chat(
        self, messages: Sequence[ChatMessage], **kwargs: Any
    ) -> ChatResponseAsyncGen:
        """Like `stream_chat`; the engine runs in a thread feeding the event loop."""
        options = self._options(kwargs)
        prompt = await asyncio.to_thread(self._chat_prompt, messages)
        return iterate_in_thread(lambda: _chat_stream(self._stream(prompt, options)))


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
