"""The adapters' shared layer: framework-neutral glue of the LangChain and LlamaIndex adapters.

Each adapter only translates its framework's calls; what they have in common lives here, once:

- `shared_engine` / `adopt_engine`: engines built from a model spec, loaded once per spec and
  process (an engine given to one adapter serves the adapters of its spec built without one),
  so building many adapter objects stays cheap and never loads a model twice unannounced;
- `prompt_segments`: a finished prompt cut into segments over the engine's known documents;
- `run_prompt` / `stream_prompt`: one prompt's blended prefill and decoding, summarised as a
  `BlendRun`, whose `BlendRun.kvblend_metadata` is the stats dict both adapters report;
  `run_prompts`: several prompts, decoded in one batch; `gather_prompt`: the async form that
  batches the calls an event loop makes concurrently (``abatch``, ``asyncio.gather``);
- `precompute_texts`: precompute document texts, logging those that cannot be cached, and
  `SEGMENT_ID_KEY`, the metadata key documents are tagged with;
- `iterate_in_thread`: a blocking iterator consumed from asyncio without blocking the loop.

This module imports no framework; the adapters depend on it, never the reverse. It is private
(its helpers change with the adapters); `kvblend.integrations` is the public place of the names
in ``__all__``.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import functools
import logging
import threading
import time
import weakref
from collections.abc import AsyncGenerator, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from .engine import BlendConfig, BlendEngine, BlendStats, Segment
from .engine.loading import ModelNotFoundError, display_name, resolve_model
from .engine.threads import use_threads
from .matching import split_prompt

__all__ = [
    "SEGMENT_ID_KEY",
    "adopt_engine",
    "BlendRun",
    "iterate_in_thread",
    "model_name",
    "precompute_texts",
    "prompt_segments",
    "run_prompt",
    "run_prompts",
    "gather_prompt",
    "shared_engine",
    "stream_prompt",
]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

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
    load-aware default, `kvblend.engine.threads`). An engine given to an adapter of the same
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


@dataclass
class BlendRun:
    """The outcome of one prompt: text, counts and what the prefill reused."""

    text: str
    output_tokens: int
    stats: BlendStats
    ttft_s: float
    finish_reason: str
    batch_size: int = 1

    def kvblend_metadata(self) -> dict[str, Any]:
        """Describe what the prefill did (reported as ``kvblend`` metadata by the adapters).

        Every field of the prefill's `BlendStats` but its timings (so a field the engine adds,
        such as why a prompt fell back to a full prefill, reaches the metadata as is); the time
        to the first token ``ttft_s`` (in a batch, the batch's: its first tokens come once every
        prompt is prefilled); ``prefill_s``, this prompt's own prefill; and ``batch_size``, the
        prompts decoded together (1: alone).
        """
        stats = self.stats
        if dataclasses.is_dataclass(stats):
            names = [f.name for f in dataclasses.fields(stats) if f.name != "timings"]
        else:  # a stats object of another kind: the fields every version has
            names = [*_STATS_FIELDS]
        timings = getattr(stats, "timings", None) or {}
        return {
            **{name: getattr(stats, name, None) for name in names},
            "ttft_s": self.ttft_s,
            "prefill_s": timings.get("prefill_s"),
            "batch_size": self.batch_size,
        }


#: The `BlendStats` fields the metadata always holds.
_STATS_FIELDS = (
    "strategy",
    "prompt_tokens",
    "reused_tokens",
    "prefix_tokens",
    "recomputed_tokens",
    "computed_tokens",
    "segments_cached",
    "segments_precomputed",
    "documents_found",
    "documents_reused",
)


def run_prompt(
    engine: BlendEngine,
    segments: list[Segment],
    config: BlendConfig | None,
    options: dict[str, Any],
) -> BlendRun:
    """Blended prefill and full decoding; ``options`` are `BlendEngine.generate` keywords.

    Run by `run_in_thread`, it stops within one layer (or token) once its caller is cancelled.
    """
    result = engine.generate(segments, config, **options, **_cancel_option())
    _note_run_time(engine, result.total_s)
    return BlendRun(
        result.text, len(result.token_ids), result.stats, result.ttft_s, result.finish_reason
    )


def run_prompts(
    engine: BlendEngine,
    prompts: list[list[Segment]],
    config: BlendConfig | None,
    options: dict[str, Any],
) -> list[BlendRun]:
    """`run_prompt` for several prompts: their prefills, then one batched decode.

    Uses `BlendEngine.generate_batch` when the engine has it (else one prompt at a time).
    """
    generate_batch = getattr(engine, "generate_batch", None)
    if len(prompts) < 2 or generate_batch is None:
        return [run_prompt(engine, segments, config, options) for segments in prompts]
    results = generate_batch(prompts, config, **options)
    _note_run_time(engine, max(r.total_s for r in results) / len(results))
    return [
        BlendRun(
            r.text,
            len(r.token_ids),
            r.stats,
            r.ttft_s,
            r.finish_reason,
            getattr(r, "batch_size", 1),
        )  # fmt: skip
        for r in results
    ]


@dataclass
class _Waiting:
    engine: BlendEngine
    segments: list[Segment]
    config: BlendConfig | None
    options: dict[str, Any]
    future: asyncio.Future[BlendRun]
    cancel: threading.Event = dataclasses.field(default_factory=threading.Event)

    def key(self) -> tuple[int, str, str]:
        return (id(self.engine), repr(self.config), repr(sorted(self.options.items())))


_WAITING: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, list[_Waiting]] = (
    weakref.WeakKeyDictionary()
)


async def gather_prompt(
    engine: BlendEngine,
    segments: list[Segment],
    config: BlendConfig | None,
    options: dict[str, Any],
) -> BlendRun:
    """`run_prompt` in a thread, batched with the other calls the event loop makes meanwhile.

    Calls arriving while the loop is busy starting others (``abatch``, ``asyncio.gather``,
    LlamaIndex's async fan-out) and sharing an engine, config and options are run together by
    `run_prompts`: their prefills, then one batched decode.
    """
    loop = asyncio.get_running_loop()
    waiting = _WAITING.setdefault(loop, [])
    entry = _Waiting(engine, segments, config, options, loop.create_future())
    waiting.append(entry)
    if len(waiting) == 1:
        loop.create_task(_flush(loop))
    try:
        return await entry.future
    finally:
        entry.cancel.set()  # a no-op once done; a call run alone stops within one layer


#: Seconds one prompt last took on each engine: how long gathering concurrent calls may wait.
_RUN_SECONDS: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()


def _note_run_time(engine: Any, seconds: float) -> None:
    try:
        _RUN_SECONDS[engine] = float(seconds)
    except TypeError:  # an engine that cannot be weakly referenced: the default wait
        pass


def _quiet_window(engine: Any) -> float:
    """Seconds without a new call after which the waiting calls run: a tenth of a run."""
    try:
        seconds = _RUN_SECONDS.get(engine, 0.03)
    except TypeError:
        seconds = 0.03
    return min(0.05, max(0.003, seconds / 10))


async def _flush(loop: asyncio.AbstractEventLoop) -> None:
    """Wait until no call has arrived for a while, then run the waiting ones.

    Calls of one ``gather`` reach the engine loop turns and thread hops apart (retrievers and
    callback handlers run in executors). The wait is a tenth of the time a prompt last took
    on the engine (3 to 50 ms, and 200 ms at most in all), so it stays small next to a run.
    """
    waiting = _WAITING.get(loop) or []
    window = _quiet_window(waiting[0].engine) if waiting else 0.003
    started = last = loop.time()
    seen = 0
    while loop.time() - last < window and loop.time() - started < max(0.05, 4 * window):
        await asyncio.sleep(0.0005)
        count = len(_WAITING.get(loop, ()))
        if count != seen:
            seen, last = count, loop.time()
    groups: dict[tuple[int, str, str], list[_Waiting]] = {}
    for entry in _WAITING.pop(loop, []):
        groups.setdefault(entry.key(), []).append(entry)
    for group in groups.values():
        try:
            runs = await asyncio.to_thread(_run_group, group)
        except BaseException as error:  # noqa: BLE001 - handed to every waiting call
            runs = [error] * len(group)
        for entry, run in zip(group, runs, strict=True):
            if entry.future.done():
                continue
            if isinstance(run, BaseException):
                entry.future.set_exception(run)
            else:
                entry.future.set_result(run)


def _run_group(group: list[_Waiting]) -> list[BlendRun | BaseException]:
    """Run a group batched; if that fails, one by one, so each call gets its own error."""
    first = group[0]
    if len(group) == 1:  # alone: cancelling its caller stops it within one layer
        _CANCEL.set(first.cancel)
        return [run_prompt(first.engine, first.segments, first.config, first.options)]
    try:
        return list(
            run_prompts(first.engine, [e.segments for e in group], first.config, first.options)
        )
    except Exception:  # noqa: BLE001 - retried alone below
        if len(group) == 1:
            raise
    results: list[BlendRun | BaseException] = []
    for entry in group:
        try:
            results.append(run_prompt(entry.engine, entry.segments, entry.config, entry.options))
        except Exception as error:  # noqa: BLE001 - this call's own error
            results.append(error)
    return results


def stream_prompt(
    engine: BlendEngine,
    segments: list[Segment],
    config: BlendConfig | None,
    options: dict[str, Any],
) -> Iterator[str | BlendRun]:
    """Blended prefill, then text pieces as decoded, then a final `BlendRun` summary.

    ``options`` are `BlendEngine.stream` keywords and must include ``max_new_tokens``.
    """
    started = time.perf_counter()
    prefill = engine.prefill(segments, config, **_cancel_option())
    ttft: float | None = None
    pieces: list[str] = []
    for piece in engine.stream(prefill, **options):  # stops when the consumer leaves
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


def precompute_texts(engine: BlendEngine, texts: Iterable[str]) -> None:
    """Precompute each text's KV; a text the engine cannot cache is logged and left uncached."""
    for text in texts:
        try:
            engine.precompute([text], progress=False)
        except ValueError as error:  # e.g. longer than the model's context window
            logger.warning("not caching a retrieved document: %s", error)


_DONE = object()

#: The cancel event of the request running in this thread (`iterate_in_thread`,
#: `run_in_thread`): `run_prompt` and `stream_prompt` hand it to the engine.
_CANCEL: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar(
    "kvblend_cancel", default=None
)


def _cancel_option() -> dict[str, Any]:
    """``{"cancel": event}`` inside `run_in_thread` / `iterate_in_thread`, else nothing."""
    cancel = _CANCEL.get()
    return {} if cancel is None else {"cancel": cancel}


async def run_in_thread(func: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """Await ``func(*args, **kwargs)`` run in a thread, as ``asyncio.to_thread`` does.

    Cancelling the awaiting task stops the engine work in the thread within one layer (or
    decoded token).
    """
    cancelled = threading.Event()
    context = contextvars.copy_context()
    context.run(_CANCEL.set, cancelled)
    loop = asyncio.get_running_loop()
    call = functools.partial(context.run, func, *args, **kwargs)
    try:
        return await loop.run_in_executor(None, call)
    finally:
        cancelled.set()  # a no-op once the work is done; else it stops at the next layer


async def iterate_in_thread(make_iterator: Callable[[], Iterator[_T]]) -> AsyncGenerator[_T, None]:
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
        _CANCEL.set(cancelled)  # the engine stops within one layer once the consumer leaves
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
