"""`ChatBlend`: a LangChain chat model whose prefill reuses the KV of known documents."""

from __future__ import annotations

import collections
import contextvars
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from langchain_core.callbacks import (
    AsyncCallbackManagerForLLMRun,
    CallbackManagerForLLMRun,
)
from langchain_core.language_models import BaseChatModel
from langchain_core.language_models.base import LanguageModelInput
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, ChatMessage
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import RunnableConfig

from kvblend.integrations.background import iterate_in_thread
from kvblend.integrations.runs import BlendRun
from kvblend.langchain._shared import BlendSettings, langchain_usage

_ROLES = {"human": "user", "ai": "assistant", "system": "system", "tool": "tool"}


class ChatBlend(BlendSettings, BaseChatModel):
    r"""Chat model over a kvblend engine, prompting through the model's chat template.

    The messages are rendered with the model's chat template; documents precomputed by the
    engine (or returned by `BlendRetriever`) are found in the rendered prompt by exact match
    and their KV is reused wherever they land. Text-only: no tool calling or images.

    Example:
        .. code-block:: python

            from kvblend.langchain import ChatBlend

            chat = ChatBlend(max_tokens=64)
            chat.invoke([("system", "Be brief."), ("human", "Context: ...\nQuestion: ...")])
    """

    LS_MODEL_TYPE = "chat"

    @property
    def _llm_type(self) -> str:
        return "kvblend-chat"

    def get_num_tokens_from_messages(
        self, messages: list[BaseMessage], tools: Sequence[Any] | None = None
    ) -> int:
        """Tokens of ``messages`` rendered with the model's chat template (loads the model).

        What ``trim_messages(token_counter=chat)`` counts: the prompt the model reads, template
        included. ``custom_get_token_ids``, when set, counts the messages' text instead.
        """
        if tools:
            raise ValueError("ChatBlend has no tool calling; count messages without tools")
        if self.custom_get_token_ids is not None:
            return super().get_num_tokens_from_messages(messages)
        return len(self._get_engine().encode(self._prompt(messages)))

    def batch(
        self,
        inputs: list[LanguageModelInput],
        config: RunnableConfig | list[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> list[AIMessage]:
        """`invoke` on each input, with the answers decoded together in one batch.

        The prompts are prefilled one by one and decoded in one batched `generate` first; each
        input's `invoke` (callbacks and tracing as usual) then returns its answer.
        """
        primed = self._prime(inputs, kwargs)
        token = _PRIMED.set(primed)
        try:
            return super().batch(inputs, config, return_exceptions=return_exceptions, **kwargs)
        finally:
            _PRIMED.reset(token)

    def _prime(self, inputs: list[LanguageModelInput], kwargs: dict[str, Any]) -> _Primed:
        """Answers of every input, batched; empty when batching does not apply or fails."""
        if len(inputs) < 2 or self.streaming:
            return {}
        call = dict(kwargs)
        stop = call.pop("stop", None)
        try:
            prompts = [self._prompt(self._convert_input(i).to_messages()) for i in inputs]
            options = self._options(stop, call)
            runs = self._run_many(prompts, stop, call)
        except Exception:  # noqa: BLE001 - each invoke then reports its own error
            return {}
        primed: _Primed = {}
        for prompt, run in zip(prompts, runs, strict=True):
            primed.setdefault(_primed_key(prompt, options), collections.deque()).append(run)
        return primed

    def _prompt(self, messages: Sequence[BaseMessage]) -> str:
        chat = [{"role": _role(message), "content": _text(message)} for message in messages]
        return self._get_engine().apply_chat_template(chat)

    def _metadata(self, run: BlendRun) -> dict[str, Any]:
        return {
            "model_name": self.model_name,
            "finish_reason": run.finish_reason,
            "kvblend": run.kvblend_metadata(),
        }

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        prompt = self._prompt(messages)
        run = _take_primed(prompt, self._options(stop, kwargs)) or self._run(prompt, stop, kwargs)
        return self._chat_result(run)

    def _chat_result(self, run: BlendRun) -> ChatResult:
        message = AIMessage(
            content=run.text,
            usage_metadata=langchain_usage(run),
            response_metadata=self._metadata(run),
        )
        return ChatResult(generations=[ChatGeneration(message=message)])

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        run = await self._arun(lambda: self._prompt(messages), stop, kwargs)
        return self._chat_result(run)

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        # LangChain fires on_llm_new_token for chat chunks itself.
        for item in self._run_stream(self._prompt(messages), stop, kwargs):
            if isinstance(item, BlendRun):
                message = AIMessageChunk(
                    content="",
                    usage_metadata=langchain_usage(item),
                    response_metadata=self._metadata(item),
                    chunk_position="last",
                )
            else:
                message = AIMessageChunk(content=item)
            yield ChatGenerationChunk(message=message)

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        async for chunk in iterate_in_thread(lambda: self._stream(messages, stop, None, **kwargs)):
            yield chunk


_Primed = dict[tuple[str, str], "collections.deque[BlendRun]"]

#: Answers computed by `ChatBlend.batch` ahead of the per-input `invoke` calls it makes.
_PRIMED: contextvars.ContextVar[_Primed | None] = contextvars.ContextVar(
    "kvblend_primed", default=None
)


def _primed_key(prompt: str, options: dict[str, Any]) -> tuple[str, str]:
    return prompt, repr(sorted(options.items()))


def _take_primed(prompt: str, options: dict[str, Any]) -> BlendRun | None:
    """Return the answer `ChatBlend.batch` computed for this prompt and options, if any."""
    queue = (_PRIMED.get() or {}).get(_primed_key(prompt, options))
    try:
        return queue.popleft() if queue is not None else None
    except IndexError:  # every primed answer of this prompt is taken
        return None


def _role(message: BaseMessage) -> str:
    if isinstance(message, ChatMessage):
        return message.role
    role = _ROLES.get(message.type)
    if role is None:
        raise ValueError(f"ChatBlend cannot send a {type(message).__name__} to the model")
    return role


def _text(message: BaseMessage) -> str:
    """Return the message's text exactly as written (documents in it must stay byte-exact)."""
    if isinstance(message.content, str):
        return message.content
    parts = []
    for block in message.content:
        if isinstance(block, str):
            parts.append(block)
        elif block.get("type") == "text":
            parts.append(block["text"])
        else:
            raise ValueError(
                f"ChatBlend takes text only; got a {block.get('type')!r} content block"
            )
    return "".join(parts)
