"""What `BlendLLM` and `ChatBlend` share: settings, LangChain usage, one prompt's run.

The framework-neutral parts (the per-model engine cache, cutting a prompt into segments over the
engine's known documents, running and streaming one prompt, the async glue) live in
`kvblend.integrations.shared` and are shared with the LlamaIndex adapter; this module adds the
LangChain settings and LangChain's usage format.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, Literal

from langchain_core.language_models import LangSmithParams
from langchain_core.messages.ai import InputTokenDetails, OutputTokenDetails, UsageMetadata
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from kvblend.blend.config import BlendConfig
from kvblend.engine.engine import BlendEngine
from kvblend.integrations.background import gather_prompt
from kvblend.integrations.conventions import (
    FRAMEWORK_EXTRAS,
    GENERATION_OPTIONS,
    EngineHolder,
    check_arguments,
    check_context_window,
    check_passthrough,
    check_window_fits,
    decode_options,
    load_engine,
)
from kvblend.integrations.runs import BlendRun, run_prompt, run_prompts, stream_prompt
from kvblend.integrations.shared import (
    adopt_engine,
    lazy_engine,
    model_name,
    prompt_segments,
)
from kvblend.prompt.segments import Segment

__all__ = ["BlendSettings", "langchain_usage"]

# Per-call keyword arguments accepted by invoke()/stream() besides the generation options:
# LangChain passes ``stream``, and ``model`` is checked against the instance's model.
_CALL_EXTRAS = ("model", "stream")


class BlendSettings(EngineHolder, BaseModel):
    """Fields and helpers common to the kvblend LangChain models.

    Unknown constructor arguments raise one `TypeError` naming the closest field; ``api_key``,
    ``timeout`` and ``max_retries`` (passed to every model by LangChain's test suites) are
    accepted and have no effect. Pickling keeps the engine's model spec and reloads (or shares)
    that engine lazily; a deep copy shares the live engine.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    #: What LangSmith's run metadata calls the model: a chat model or a completion LLM.
    LS_MODEL_TYPE: ClassVar[Literal["chat", "llm"]] = "llm"

    engine: BlendEngine | None = Field(default=None, exclude=True)
    """A ready `BlendEngine` to use (share one between the LLM and `BlendRetriever`).
    When None, one is built on first use from ``model`` and shared per model spec."""

    model: str | None = None
    """Model to load when no ``engine`` is given: a folder, GGUF file or hub id. None means
    ``KVBLEND_MODEL`` or the bundled SmolLM2-135M-Instruct."""

    blend_config: BlendConfig | None = None
    """How the blended prefill recomputes reused tokens (None = `BlendConfig()` defaults)."""

    threads: int | None = Field(default=None, ge=1)
    """torch CPU threads, for the whole process, from the first call on (None: the engine's
    load-aware default, the cores the last minute's load leaves idle; see docs/guides.md)."""

    max_tokens: int = Field(default=256, ge=1)
    """Largest number of tokens to generate."""

    max_new_tokens: int | None = Field(default=None, ge=1)
    """transformers' name for ``max_tokens`` (set one of them; when set, this one is used)."""

    temperature: float = Field(default=0.0, ge=0.0)
    """Sampling temperature; 0 decodes greedily (unless ``do_sample=True``)."""

    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass (used when sampling)."""

    top_k: int = Field(default=0, ge=0)
    """Sample among the ``top_k`` most likely tokens only (0: no limit; used when sampling)."""

    repetition_penalty: float = Field(default=1.0, gt=0.0)
    """transformers' repetition penalty over the prompt and the output (1: none)."""

    do_sample: bool | None = None
    """Sample (True) or decode greedily (False); None samples when ``temperature > 0``. True
    with ``temperature=0`` samples at temperature 1, as transformers does."""

    seed: int | None = None
    """Random seed for sampling, for reproducible outputs."""

    model_kwargs: dict[str, Any] = Field(default_factory=dict)
    """More generation options by name (as ChatOpenAI's ``model_kwargs``): any of
    ``max_tokens``, ``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``,
    ``repetition_penalty``, ``do_sample``, ``seed``; other keys are refused. A call's keyword
    arguments win over them."""

    context_window: int | None = Field(default=None, ge=1)
    """Tokens of prompt plus ``max_tokens`` a call may use (None: the model's own window, where
    the output is cut short at the model's limit instead); a call over it raises one error."""

    stop: list[str] | None = None
    """Stop sequences: the output is cut before the first one. A call's ``stop`` wins."""

    separator: str | None = None
    """Explicit separator mode: when set, the prompt is split on this string (which is removed)
    and each piece between two separators is a cached document, instead of finding known
    documents in the prompt by exact match."""

    cache_prefix: bool = False
    """Also cache the text before the first document (template head, system prompt) as a
    prefix reused at its own position. Each distinct head is stored once."""

    streaming: bool = False
    """Whether ``invoke`` streams internally (so callbacks receive tokens)."""

    _engine: BlendEngine | None = PrivateAttr(default=None)

    @field_validator("engine")
    @classmethod
    def _share_engine(cls, engine: BlendEngine | None) -> BlendEngine | None:
        return adopt_engine(engine)

    @model_validator(mode="before")
    @classmethod
    def _known_arguments(cls, data: Any) -> Any:
        """Refuse unknown constructor arguments; drop the framework-wide no-op ones."""
        if not isinstance(data, dict):
            return data
        known = set(cls.model_fields) | {
            f.alias for f in cls.model_fields.values() if f.alias is not None
        }
        check_arguments(cls.__name__, data, known | set(FRAMEWORK_EXTRAS), "argument")
        tokens, new_tokens = data.get("max_tokens"), data.get("max_new_tokens")
        if None not in (tokens, new_tokens) and tokens != new_tokens:
            raise ValueError(
                f"{cls.__name__}: max_tokens={tokens} and max_new_tokens={new_tokens} disagree; "
                "give one (max_new_tokens is transformers' name for max_tokens)"
            )
        passthrough = data.get("model_kwargs")
        check_passthrough(cls.__name__, "model_kwargs", passthrough)
        for name in passthrough or {}:
            if name in data:
                raise ValueError(
                    f"{cls.__name__}: {name!r} is given both as an argument and in model_kwargs"
                )
        return {key: value for key, value in data.items() if key not in FRAMEWORK_EXTRAS}

    @classmethod
    def from_model_id(
        cls,
        model_id: str,
        *,
        device: int | str | None = None,
        device_map: str | dict[str, Any] | None = None,
        dtype: Any = "auto",
        revision: str | None = None,
        trust_remote_code: bool = False,
        model_kwargs: dict[str, Any] | None = None,
        pipeline_kwargs: dict[str, Any] | None = None,
        engine_kwargs: dict[str, Any] | None = None,
        **fields: Any,
    ) -> Any:
        """Load ``model_id`` and build the model on it, as ``HuggingFacePipeline.from_model_id``.

        ``model_id`` is a hub id (needs the Hugging Face cache or a network), a folder or a GGUF
        file. ``device`` (-1 CPU, N CUDA device N, or a name) or ``device_map`` (one device:
        ``"auto"``, ``"cpu"``, ``"cuda:0"``), ``dtype`` (default ``"auto"``: bfloat16 where the
        device has bfloat16 matrix units unless the checkpoint is float32, else float32; or
        ``"float32"``, ``"bf16"``, ``torch.float16``...), ``revision`` and ``trust_remote_code``
        go to transformers;
        ``model_kwargs`` too (loading options such as ``attn_implementation``, as in
        langchain-huggingface). ``pipeline_kwargs`` are generation options (as
        ``model_kwargs`` of the constructor), ``engine_kwargs`` `BlendEngine` arguments
        (``store``, ``system_prompt``...), other keywords the model's fields.
        """
        engine = load_engine(
            model_id,
            device=device,
            device_map=device_map,
            dtype=dtype,
            revision=revision,
            trust_remote_code=trust_remote_code,
            model_kwargs=model_kwargs,
            engine_kwargs=engine_kwargs,
        )
        if pipeline_kwargs:
            fields["model_kwargs"] = {**fields.get("model_kwargs", {}), **pipeline_kwargs}
        return cls(engine=engine, model=engine.model_spec, **fields)

    def _get_engine(self) -> BlendEngine:
        engine = lazy_engine(self)
        check_window_fits(type(self).__name__, self.context_window, engine)
        return engine

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model_name": self.model_name,
            "max_tokens": self.max_new_tokens or self.max_tokens,
            "temperature": self.temperature,
            "blend_config": self.blend_config,
        }

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(
            ls_provider="kvblend",
            ls_model_name=str(kwargs.get("model") or self.model_name),
            ls_model_type=self.LS_MODEL_TYPE,
            ls_temperature=kwargs.get("temperature", self.temperature),
            ls_max_tokens=kwargs.get("max_tokens", self.max_new_tokens or self.max_tokens),
        )
        if stop or self.stop:
            params["ls_stop"] = stop or self.stop
        return params

    def get_token_ids(self, text: str) -> list[int]:
        """Token ids of ``text`` by the engine's own tokenizer (loads the model).

        ``custom_get_token_ids``, when set, wins (as in every LangChain model).
        """
        custom = getattr(self, "custom_get_token_ids", None)
        if custom is not None:
            return list(custom(text))
        return self._get_engine().tokenize(text)

    @property
    def model_name(self) -> str:
        """Name of the model, without loading it."""
        return model_name(self.engine or self._engine, self.model)

    def _segments(self, engine: BlendEngine, prompt: str) -> list[Segment]:
        return prompt_segments(
            engine, prompt, separator=self.separator, cache_prefix=self.cache_prefix
        )

    def _options(self, stop: list[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Merge the fields, ``model_kwargs`` and one call's stop and kwargs into options."""
        check_arguments(
            type(self).__name__, kwargs, (*GENERATION_OPTIONS, *_CALL_EXTRAS), "keyword argument"
        )
        override = kwargs.get("model")
        if override is not None and override not in (self.model, self.model_name):
            raise ValueError(
                f"per-call model {override!r} is not supported; build another instance with "
                f"model={override!r}"
            )
        fields = {name: getattr(self, name) for name in GENERATION_OPTIONS}
        if self.max_new_tokens is not None:
            fields.pop("max_tokens")  # the HF name, when set, wins over the default
        call = {name: kwargs[name] for name in GENERATION_OPTIONS if name in kwargs}
        options = decode_options(
            [(fields, "fields"), (self.model_kwargs, "in model_kwargs"), (call, "in one call")]
        )
        options["stop"] = (stop if stop is not None else self.stop) or None
        return options

    def _checked(self, prompt: str, options: dict[str, Any]) -> BlendEngine:
        """Return the engine, once ``prompt`` and the output budget fit ``context_window``."""
        engine = self._get_engine()
        check_context_window(engine, prompt, options["max_new_tokens"], self.context_window)
        return engine

    def _run(self, prompt: str, stop: list[str] | None, kwargs: dict[str, Any]) -> BlendRun:
        """Blended prefill and full decoding of one prompt."""
        options = self._options(stop, kwargs)
        engine = self._checked(prompt, options)
        return run_prompt(engine, self._segments(engine, prompt), self.blend_config, options)

    async def _arun(
        self, render: Callable[[], str], stop: list[str] | None, kwargs: dict[str, Any]
    ) -> BlendRun:
        """`_run` from asyncio, batched with the calls the event loop makes meanwhile."""
        if self.engine is None and self._engine is None:
            await asyncio.to_thread(self._get_engine)  # a first load takes seconds: off the loop
        prompt = render()  # rendering and finding documents take milliseconds
        options = self._options(stop, kwargs)
        engine = self._checked(prompt, options)
        segments = self._segments(engine, prompt)
        return await gather_prompt(engine, segments, self.blend_config, options)

    def _run_many(
        self, prompts: list[str], stop: list[str] | None, kwargs: dict[str, Any]
    ) -> list[BlendRun]:
        """Several prompts: each one's blended prefill, then one batched decode."""
        options = self._options(stop, kwargs)
        engine = self._get_engine()
        for prompt in prompts:
            check_context_window(engine, prompt, options["max_new_tokens"], self.context_window)
        segments = [self._segments(engine, prompt) for prompt in prompts]
        return run_prompts(engine, segments, self.blend_config, options)

    def _run_stream(
        self, prompt: str, stop: list[str] | None, kwargs: dict[str, Any]
    ) -> Iterator[str | BlendRun]:
        """Blended prefill, then text pieces as decoded, then a final `BlendRun` summary."""
        options = self._options(stop, kwargs)
        engine = self._checked(prompt, options)
        yield from stream_prompt(engine, self._segments(engine, prompt), self.blend_config, options)


def langchain_usage(run: BlendRun) -> UsageMetadata:
    """LangChain usage: reused KV tokens are reported as ``cache_read`` input tokens."""
    return UsageMetadata(
        input_tokens=run.stats.prompt_tokens,
        output_tokens=run.output_tokens,
        total_tokens=run.stats.prompt_tokens + run.output_tokens,
        input_token_details=InputTokenDetails(cache_read=run.stats.reused_tokens),
        output_token_details=OutputTokenDetails(),
    )
