"""The adapters' shared layer: framework-neutral glue of the LangChain and LlamaIndex adapters.

Each adapter only translates its framework's calls; what they have in common lives here, once:

- `shared_engine` / `adopt_engine`: engines built from a model spec, loaded once per spec and
  process (an engine given to one adapter serves the adapters of its spec built without one),
  so building many adapter objects stays cheap and never loads a model twice unannounced;
- `prompt_segments`: a finished prompt cut into segments over the engine's known documents;
- `precompute_texts`: precompute document texts, logging those that cannot be cached, and
  `SEGMENT_ID_KEY`, the metadata key documents are tagged with;
Beside it, `kvblend.integrations.runs` runs one prompt's blended prefill and decoding
(`run_prompt` / `stream_prompt`, summarised as a `BlendRun`) or several in one batch
(`run_prompts`), and `kvblend.integrations.background` is the async glue (`gather_prompt`,
`iterate_in_thread`, `run_in_thread`).

This module imports no framework; the adapters depend on it, never the reverse.
`kvblend.integrations` is the public place of the names meant for other framework glue.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Iterable
from typing import Any

from kvblend.engine.engine import BlendEngine
from kvblend.engine.torch_threads import use_threads
from kvblend.errors import ModelNotFoundError
from kvblend.matching import split_prompt
from kvblend.models.loading import display_name, resolve_model
from kvblend.prompt.segments import Segment

__all__ = [
    "SEGMENT_ID_KEY",
    "adopt_engine",
    "lazy_engine",
    "model_name",
    "precompute_texts",
    "prompt_segments",
    "shared_engine",
]

logger = logging.getLogger(__name__)

#: Metadata key the adapters tag documents / nodes with: the content id of their KV in the store.
SEGMENT_ID_KEY = "kvblend_segment_id"

_ENGINES: dict[str, BlendEngine] = {}
_GIVEN: weakref.WeakSet[BlendEngine] = weakref.WeakSet()  # engines adapters were given
_ENGINES_LOCK = threading.Lock()


def adopt_engine(engine: BlendEngine | None) -> BlendEngine | None:
    """Note an engine an adapter was given: adapters of its model spec built without one share it.

    So ``ChatBlend(engine=e)`` and a ``BlendRetriever()`` built without ``engine=`` use one model
    and one document registry, never a second copy of the model.
    """
    if engine is not None:
        with _ENGINES_LOCK:
            _GIVEN.add(engine)
            spec = getattr(engine, "model_spec", None)
            if spec is not None:
                _ENGINES.setdefault(spec, engine)
    return engine


def shared_engine(model: str | None = None, threads: int | None = None) -> BlendEngine:
    """Return the engine for model spec ``model`` (None = default), loaded once per process.

    ``threads``: torch CPU threads of the process when the engine is loaded (None: kvblend's
    load-aware default, `kvblend.engine.torch_threads`). An engine given to an adapter of the same
    (resolved) spec is reused. Loading a model while
    adapters use engines of another one logs a warning: that is a second model in memory, and
    documents precomputed by one engine are only found by engines over the same store.
    """
    spec = resolve_model(model)
    with _ENGINES_LOCK:
        engine = _ENGINES.get(spec)
        if engine is None:
            given = sorted({str(e.name) for e in _GIVEN})
            if given:
                logger.warning(
                    "loading %s for an adapter built without engine=, while other adapters use "
                    "an engine of %s: that is another model in memory; pass the same engine= "
                    "to every adapter",
                    display_name(spec),
                    ", ".join(given),
                )
            engine = BlendEngine.from_pretrained(spec, threads=threads)
            _ENGINES[spec] = engine
        return engine


def lazy_engine(owner: Any) -> BlendEngine:
    """Return an adapter's ``engine``, or the shared engine of its ``model`` kept in ``_engine``.

    An adapter's ``threads`` (when set) is torch's thread count from then on, for the process.
    """
    threads = getattr(owner, "threads", None)
    if owner.engine is not None:
        engine = owner.engine
    else:
        if owner._engine is None:
            owner._engine = shared_engine(owner.model, threads)
        engine = owner._engine
    if threads is not None:
        use_threads(threads)  # an engine loaded before, or given: set for the process
    return engine


def model_name(engine: BlendEngine | None, model: str | None) -> str:
    """Name of the model an adapter uses, without loading it when no engine exists yet."""
    if engine is not None:
        return str(engine.name)
    try:
        return display_name(resolve_model(model))
    except ModelNotFoundError:
        return model or "kvblend-default"


def prompt_segments(
    engine: BlendEngine,
    prompt: str,
    *,
    separator: str | None = None,
    cache_prefix: bool = False,
) -> list[Segment]:
    """Cut a finished prompt into segments: the engine's known documents and the text between.

    With ``separator`` the prompt is split on it instead (see `kvblend.matching.split_prompt`);
    ``cache_prefix`` caches the text before the first document as a prefix.
    """
    if separator is None:
        return engine.segments_for(prompt, cache_prefix=cache_prefix)
    return split_prompt(prompt, separator=separator, prefix_role=cache_prefix)


def precompute_texts(engine: BlendEngine, texts: Iterable[str]) -> None:
    """Precompute each text's KV; a text the engine cannot cache is logged and left uncached."""
    for text in texts:
        try:
            engine.precompute([text], progress=False)
        except ValueError as error:  # e.g. longer than the model's context window
            logger.warning("not caching a retrieved document: %s", error)
