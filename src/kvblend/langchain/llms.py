"""`BlendLLM`: a LangChain string LLM whose prefill reuses the KV of known documents."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from functools import partial
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseLLM
from langchain_core.outputs import Generation, GenerationChunk, LLMResult

from kvblend.integrations.background import iterate_in_thread, run_in_thread
from kvblend.integrations.runs import BlendRun
from kvblend.langchain._shared import BlendSettings, langchain_usage


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
        if self.streaming or len(prompts) < 2:
            runs = [self._complete(prompt, stop, run_manager, kwargs) for prompt in prompts]
        else:  # LangChain's batch() sends every prompt here at once: decode them together
            runs = self._run_many([self._prompt(prompt) for prompt in prompts], stop, kwargs)
        return self._result(runs)

    def _result(self, runs: list[BlendRun]) -> LLMResult:
        generations = [[Generation(text=run.text, generation_info=self._info(run))] for run in runs]
        input_tokens = sum(run.stats.prompt_tokens for run in runs)
        output_tokens = sum(run.output_tokens for run in runs)
        token_usage = {
            "prompt_tokens": input_tokens,
            "completion_tokens": output_tokens,
            "total_tokens": input_tokens + output_tokens,
            "cache_read_tokens": sum(run.stats.reused_tokens for run in runs),
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
        if not self.streaming and len(prompts) == 1:  # batched with concurrent calls
            run = await self._arun(lambda: self._prompt(prompts[0]), stop, kwargs)
            return self._result([run])
        if not self.streaming:
            return await run_in_thread(self._generate, prompts, stop, None, **kwargs)
        runs = []
        for prompt in prompts:  # callbacks see every token, as in the sync path
            text = await run_in_thread(self._prompt, prompt)
            async for item in iterate_in_thread(partial(self._run_stream, text, stop, kwargs)):
                if isinstance(item, BlendRun):
                    runs.append(item)
                elif run_manager is not None:
                    await run_manager.on_llm_new_token(item, chunk=GenerationChunk(text=item))
        return self._result(runs)

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
