"""What `BlendLLM` and `ChatBlend` share: settings, the engine cache, one prompt's run, async glue.

A prompt becomes segments with `kvblend.matching.split_prompt` over the engine's known
documents; the engine runs the blended prefill and decodes. Engines built from a model spec are
cached per spec in this module, so constructing many adapters (the standard test suites build
dozens) loads each model once.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from langchain_core.messages.ai import InputTokenDetails, UsageMetadata
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from ..engine import BlendConfig, BlendEngine, BlendStats, Segment
from ..engine.loading import ModelNotFoundError, display_name, resolve_model
from ..matching import split_prompt

_T = TypeVar("_T")

_ENGINES: dict[str, BlendEngine] = {}
_ENGINES_LOCK = threading.Lock()

# Per-call keyword arguments accepted by invoke()/stream(), mapped to the adapters' fields.
_CALL_OPTIONS = ("max_tokens", "temperature", "top_p", "seed")


def shared_engine(model: str | None = None) -> BlendEngine:
    """Return the engine for model spec ``model`` (None = default), loaded once per process."""
    key = model or ""
    with _ENGINES_LOCK:
        engine = _ENGINES.get(key)
        if engine is None:
            engine = BlendEngine.from_pretrained(model)
            _ENGINES[key] = engine
        return engine


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

    def _get_engine(self) -> BlendEngine:
        if self.engine is not None:
            return self.engine
        if self._engine is None:
            self._engine = shared_engine(self.model)
        return self._engine

    @property
    def model_name(self) -> str:
        """Name of the model, without loading it."""
        engine = self.engine or self._engine
        if engine is not None:
            return str(engine.name)
        try:
            return display_name(resolve_model(self.model))
        except ModelNotFoundError:
            return self.model or "kvblend-default"

    def _segments(self, engine: BlendEngine, prompt: str) -> list[Segment]:
        documents = () if self.separator is not None else engine.known_documents()
        return split_prompt(
            prompt, documents, separator=self.separator, prefix_role=self.cache_prefix
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
        result = engine.generate(self._segments(engine, prompt), self.blend_config, **options)
        return BlendRun(
            result.text, len(result.token_ids), result.stats, result.ttft_s, result.finish_reason
        )

    def _run_stream(
        self, prompt: str, stop: list[str] | None, kwargs: dict[str, Any]
    ) -> Iterator[str | BlendRun]:
        """Blended prefill, then text pieces as decoded, then a final `BlendRun` summary."""
        engine = self._get_engine()
        options = self._options(stop, kwargs)
        started = time.perf_counter()
        prefill = engine.prefill(self._segments(engine, prompt), self.blend_config)
        ttft: float | None = None
        pieces: list[str] = []
        for piece in engine.stream(prefill, **options):
            if ttft is None:
                ttft = time.perf_counter() - started
            pieces.append(piece)
            yield piece
        text = "".join(pieces)
        output_tokens = len(engine.tokenize(text)) if text else 0
        stopped = output_tokens < options["max_new_tokens"]
        yield BlendRun(
            text,
            output_tokens,
            prefill.stats,
            ttft if ttft is not None else time.perf_counter() - started,
            "stop" if stopped else "length",
        )


@dataclass
class BlendRun:
    """The outcome of one prompt: text, counts and what the prefill reused."""

    text: str
    output_tokens: int
    stats: BlendStats
    ttft_s: float
    finish_reason: str

    def usage(self) -> UsageMetadata:
        """LangChain usage: reused KV tokens are reported as ``cache_read`` input tokens."""
        return UsageMetadata(
            input_tokens=self.stats.prompt_tokens,
            output_tokens=self.output_tokens,
            total_tokens=self.stats.prompt_tokens + self.output_tokens,
            input_token_details=InputTokenDetails(cache_read=self.stats.reused_tokens),
        )

    def kvblend_metadata(self) -> dict[str, Any]:
        """Describe what the prefill did, for ``response_metadata`` / ``generation_info``."""
        stats = self.stats
        return {
            "strategy": stats.strategy,
            "prompt_tokens": stats.prompt_tokens,
            "reused_tokens": stats.reused_tokens,
            "prefix_tokens": stats.prefix_tokens,
            "recomputed_tokens": stats.recomputed_tokens,
            "computed_tokens": stats.computed_tokens,
            "segments_cached": stats.segments_cached,
            "segments_precomputed": stats.segments_precomputed,
            "ttft_s": self.ttft_s,
        }


_DONE = object()


async def iterate_in_thread(make_iterator: Callable[[], Iterator[_T]]) -> AsyncIterator[_T]:
    """Run a blocking iterator in a thread and yield its items without blocking the loop.

    The thread runs in a copy of the caller's context (tracing callbacks keep working) and
    feeds an asyncio queue; when the consumer stops early the thread stops at the next item.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[Any, BaseException | None]] = asyncio.Queue()
    cancelled = threading.Event()

    def put(item: Any, error: BaseException | None = None) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, (item, error))
        except RuntimeError:  # the loop closed: nobody is listening any more
            cancelled.set()

    def produce() -> None:
        iterator = make_iterator()
        try:
            for item in iterator:
                if cancelled.is_set():
                    break
                put(item)
        except BaseException as error:  # noqa: BLE001 - handed to the consumer
            put(_DONE, error)
        else:
            put(_DONE)
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()

    context = contextvars.copy_context()
    threading.Thread(
        target=context.run, args=(produce,), name="kvblend-astream", daemon=True
    ).start()
    try:
        while True:
            item, error = await queue.get()
            if item is _DONE:
                if error is not None:
                    raise error
                return
            yield item
    finally:
        cancelled.set()
