"""The adapters' async glue: engine work in threads, stopped when the awaiting task is cancelled.

- `gather_prompt`: `run_prompt` in a thread, batched with the calls the event loop makes
  meanwhile (``abatch``, ``asyncio.gather``, LlamaIndex's async fan-out) into one `run_prompts`;
- `run_in_thread`: ``asyncio.to_thread`` whose work stops within one layer (or decoded token)
  once the awaiting task is cancelled;
- `iterate_in_thread`: a blocking iterator consumed from asyncio without blocking the loop.

Each sets `CANCEL_EVENT` (`kvblend.integrations.runs`) in the thread it starts, so the engine
sees its caller leave. Part of the adapters' shared layer (`kvblend.integrations`); imports no
framework.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import functools
import threading
import weakref
from collections.abc import AsyncGenerator, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from kvblend.blend.config import BlendConfig
from kvblend.engine.engine import BlendEngine
from kvblend.integrations.runs import (
    CANCEL_EVENT,
    BlendRun,
    last_run_seconds,
    run_prompt,
    run_prompts,
)
from kvblend.prompt.segments import Segment

__all__ = ["gather_prompt", "iterate_in_thread", "run_in_thread"]

_T = TypeVar("_T")


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


def _quiet_window(engine: Any) -> float:
    """Seconds without a new call after which the waiting calls run: a tenth of a run."""
    return min(0.05, max(0.003, last_run_seconds(engine) / 10))


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
        CANCEL_EVENT.set(first.cancel)
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


_DONE = object()


async def run_in_thread(func: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """Await ``func(*args, **kwargs)`` run in a thread, as ``asyncio.to_thread`` does.

    Cancelling the awaiting task stops the engine work in the thread within one layer (or
    decoded token).
    """
    cancelled = threading.Event()
    context = contextvars.copy_context()
    context.run(CANCEL_EVENT.set, cancelled)
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
        CANCEL_EVENT.set(cancelled)  # the engine stops within one layer once the consumer leaves
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
