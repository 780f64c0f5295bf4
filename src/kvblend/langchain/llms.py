"""`BlendLLM`: a LangChain string LLM whose prefill reuses the KV of known documents."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseLLM, LangSmithParams
from langchain_core.outputs import Generation, GenerationChunk, LLMResult

from ._shared import BlendRun, BlendSettings, iterate_in_thread, langchain_usage, run_in_thread


class BlendLLM(BlendSettings, BaseLLM):
    r"""String-prompt LLM over a kvblend engine.

    Documents precomputed by the engine (or returned by `BlendRetriever`) are found in the
    final prompt by exact match and their KV is reused wherever they land; everything else is
    computed normally. A prompt without known documents runs a normal prefill.

    Example:
        .. code-block:: python

            from kvblend.langchain import BlendLLM

            llm = BlendLLM(max_tokens=64)
            llm.invoke("Context: ...\n\nQuestion: ...")
    """

    chat_template: bool = True
    """Wrap each prompt as one user message in the model's chat template, as instruct models
    expect (the default, as in the LlamaIndex adapter). False sends the prompt text as is, for
    prompts that are already chat-formatted or for base models."""

    @property
    def _llm_type(self) -> str:
        return "kvblend"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model_name": self.model_name,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "blend_config": self.blend_config,
        }

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(
            ls_provider="kvblend",
            ls_model_name=str(kwargs.get("model") or self.model_name),
            ls_model_type="llm",
            ls_temperature=kwargs.get("temperature", self.temperature),
            ls_max_tokens=kwargs.get("max_tokens", self.max_tokens),
        )
        if stop or self.stop:
            params["ls_stop"] = stop or self.stop
        return params

    def _prompt(self, prompt: str) -> str:
        if not self.chat_template:
            return prompt
        return self._get_engine().apply_chat_template([{"role": "user", "content": prompt}])

    def _info(self, run: BlendRun) -> dict[str, Any]:
        return {
            "model_name": self.model_name,
            "finish_reason": run.finish_reason,
            "usage_metadata": langchain_usage(run),
            "kvblend": run.kvblend_metadata(),
        }

    def _generate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        generations = []
        input_tokens = output_tokens = cache_read = 0
        for prompt in prompts:
            run = self._complete(prompt, stop, run_manager, kwargs)
            generations.append([Generation(text=run.text, generation_info=self._info(run))])
            input_tokens += run.stats.prompt_tokens
            output_tokens += run.output_tokens
            cache_read += run.stats.reused_tokens
        token_usage = {
            "prompt_tokens": input_tokens,
            "completion_tokens": output_tokens,
            "total_tokens": input_tokens + output_tokens,
            "cache_read_tokens": cache_read,
        }
        return LLMResult(
            generations=generations,
            llm_output={"model_name": self.model_name, "token_usage": token_usage},
        )

    def _complete(
        self,
        prompt: str,
        stop: list[str] | None,
        run_manager: CallbackManagerForLLMRun | None,
        kwargs: dict[str, Any],
    ) -> BlendRun:
        if not self.streaming:
            return self._run(self._prompt(prompt), stop, kwargs)
        for item in self._run_stream(self._prompt(prompt), stop, kwargs):  # callbacks see tokens
            if isinstance(item, BlendRun):
                return item
            if run_manager is not None:
                run_manager.on_llm_new_token(item, chunk=GenerationChunk(text=item))
        raise AssertionError("the stream ended without a summary")  # pragma: no cover

    async def _agenerate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        return await run_in_thread(self._generate, prompts, stop, None, **kwargs)

    def _chunks(
        self, prompt: str, stop: list[str] | None, kwargs: dict[str, Any]
    ) -> Iterator[GenerationChunk]:
        for item in self._run_stream(self._prompt(prompt), stop, kwargs):
            if isinstance(item, BlendRun):
                yield GenerationChunk(text="", generation_info=self._info(item))
            else:
                yield GenerationChunk(text=item)

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        for chunk in self._chunks(prompt, stop, kwargs):
            if run_manager is not None and chunk.text:
                run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    async def _astream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[GenerationChunk]:
        async for chunk in iterate_in_thread(lambda: self._chunks(prompt, stop, kwargs)):
            if run_manager is not None and chunk.text:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk
