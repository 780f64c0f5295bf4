"""What `BlendLLM` and `ChatBlend` share: settings, LangChain usage, one prompt's run.

The framework-neutral parts (the per-model engine cache, cutting a prompt into segments over the
engine's known documents, running and streaming one prompt, the async glue) live in
`kvblend._adapters` and are shared with the LlamaIndex adapter; this module adds the
LangChain settings and LangChain's usage format.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from langchain_core.messages.ai import InputTokenDetails, OutputTokenDetails, UsageMetadata
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator

from .._adapters import (
    BlendRun,
    adopt_engine,
    iterate_in_thread,
    lazy_engine,
    model_name,
    prompt_segments,
    run_in_thread,
    run_prompt,
    shared_engine,
    stream_prompt,
)
from ..engine import BlendConfig, BlendEngine, Segment

__all__ = [
    "BlendRun",
    "BlendSettings",
    "iterate_in_thread",
    "run_in_thread",
    "langchain_usage",
    "shared_engine",
]

# Per-call keyword arguments accepted by invoke()/stream(), mapped to the adapters' fields.
_CALL_OPTIONS = ("max_tokens", "temperature", "top_p", "seed")


class BlendSettings(BaseModel):
    """Fields and helpers common to the kvblend LangChain models."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    engine: BlendEngine | None = Field(default=None, exclude=True)
    """A ready `BlendEngine` to use (share one between the LLM and `BlendRetriever`).
    When None, one is built on first use from ``model`` and shared per model spec."""

    model: str | None = None
    """Model to load when no ``engine`` is given: a folder, GGUF file or hub id. None means
    ``KVBLEND_MODEL`` or the bundled SmolLM2-135M-Instruct."""

    blend_config: BlendConfig | None = None
    """How the blended prefill recomputes reused tokens (None = `BlendConfig()` defaults)."""

    max_tokens: int = Field(default=256, ge=1)
    """Largest number of tokens to generate."""

    temperature: float = Field(default=0.0, ge=0.0)
    """Sampling temperature; 0 decodes greedily."""

    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass (used when ``temperature > 0``)."""

    seed: int | None = None
    """Random seed for sampling, for reproducible outputs."""

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

    def _get_engine(self) -> BlendEngine:
        return lazy_engine(self)

    @property
    def model_name(self) -> str:
        """Name of the model, without loading it."""
        return model_name(self.engine or self._engine, self.model)

    def _segments(self, engine: BlendEngine, prompt: str) -> list[Segment]:
        return prompt_segments(
            engine, prompt, separator=self.separator, cache_prefix=self.cache_prefix
        )

    def _options(self, stop: list[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Merge the fields with one call's stop and kwargs into decoding options."""
        unknown = set(kwargs) - set(_CALL_OPTIONS) - {"model", "stream"}
        if unknown:
            raise TypeError(f"unexpected keyword arguments: {', '.join(sorted(unknown))}")
        override = kwargs.get("model")
        if override is not None and override not in (self.model, self.model_name):
            raise ValueError(
                f"per-call model {override!r} is not supported; build another instance with "
                f"model={override!r}"
            )
        values = {name: kwargs.get(name, getattr(self, name)) for name in _CALL_OPTIONS}
        return {
            "max_new_tokens": values["max_tokens"],
            "temperature": values["temperature"],
            "top_p": values["top_p"],
            "seed": values["seed"],
            "stop": (stop if stop is not None else self.stop) or None,
        }

    def _run(self, prompt: str, stop: list[str] | None, kwargs: dict[str, Any]) -> BlendRun:
        """Blended prefill and full decoding of one prompt."""
        engine = self._get_engine()
        options = self._options(stop, kwargs)
        return run_prompt(engine, self._segments(engine, prompt), self.blend_config, options)

    def _run_stream(
        self, prompt: str, stop: list[str] | None, kwargs: dict[str, Any]
    ) -> Iterator[str | BlendRun]:
        """Blended prefill, then text pieces as decoded, then a final `BlendRun` summary."""
        engine = self._get_engine()
        options = self._options(stop, kwargs)
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
