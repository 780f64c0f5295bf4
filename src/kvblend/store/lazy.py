"""A lazy, prefetching mapping of tensor name -> tensor, returned by `KVStore.get()`.

Reading a tensor happens on first access. Accessing one name also schedules the next few names
(in the entry's layer order) on a small background thread pool owned by the store, so that
while the caller computes layer i, layer i+1 is being read from disk (or copied to the GPU).

Every tensor is read exactly once: the first of the caller and the prefetch thread to ask for a
name "claims" it and does the read; the other waits for that result. Access in any order is
therefore correct; out-of-order access only makes prefetching less useful.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType
from typing import Any, cast

import torch

from kvblend.store.base import CorruptEntryError, EntryReplacedError, StoreError
from kvblend.store.entry_format import EntryHeader, read_tensor
from kvblend.store.transfer import HOST_TO_DEVICE, PendingCopy

#: Default number of tensors read ahead of the one accessed (two layers of k and v).
DEFAULT_PREFETCH_AHEAD = 4


class PrefetchPool:
    """A store's background reader threads: one small `ThreadPoolExecutor`, built on first use.

    The pool holds at most `max_workers` threads whatever the number of entries in flight, and
    `close()` joins them. A closed pool starts again on the next `submit()`.
    """

    def __init__(self, max_workers: int = 2, name: str = "kvblend-prefetch") -> None:
        self._max_workers = max_workers
        self._name = name
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None

    def submit(self, function: Callable[[], object]) -> Future[object] | None:
        """Run `function` in the background; return its future, None if it cannot be scheduled."""
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self._max_workers, self._name)
            try:
                return self._executor.submit(function)
            except RuntimeError:  # interpreter shutting down
                return None

    def close(self) -> None:
        """Wait for queued reads to finish and stop the threads."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)


class LazyTensors(Mapping[str, torch.Tensor]):
    """Read-only mapping whose tensors are loaded on first access, with prefetch.

    `load(name)` produces one tensor, or a `PendingCopy` still in flight to a GPU that is
    handed out once the caller's stream is ordered after it (`kvblend.store.transfer`);
    `names` gives the iteration and prefetch order. When a
    load raises `CorruptEntryError`, `on_corrupt` is called once (the store drops the entry and
    counts it) and the error is raised to whoever accesses that name. `on_close` releases the
    underlying source; it runs when every tensor has been loaded, on `close()`, or when the
    mapping is garbage collected. Loaded tensors are kept, so repeated access returns the same
    tensor object.
    """

    def __init__(
        self,
        names: Sequence[str],
        load: Callable[[str], torch.Tensor | PendingCopy],
        *,
        metadata: Mapping[str, str] | None = None,
        pool: PrefetchPool | None = None,
        prefetch_ahead: int = DEFAULT_PREFETCH_AHEAD,
        on_corrupt: Callable[[CorruptEntryError], None] | None = None,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self._names = tuple(names)
        self._position = {name: index for index, name in enumerate(self._names)}
        self._load = load
        self._metadata = dict(metadata or {})
        self._pool = pool
        self._prefetch_ahead = max(0, prefetch_ahead) if pool is not None else 0
        self._on_corrupt = on_corrupt
        self._lock = threading.Lock()
        self._report_lock = threading.Lock()
        self._futures: dict[str, Future[torch.Tensor | PendingCopy]] = {}
        self._scheduled: set[str] = set()
        self._tasks: list[Future[object]] = []
        self._finished = 0
        self._corrupt_reported = False
        self._closed = False
        self._finalizer = weakref.finalize(self, on_close) if on_close is not None else None

    @property
    def metadata(self) -> dict[str, str]:
        """The caller's metadata stored with this entry."""
        return dict(self._metadata)

    @property
    def loaded(self) -> frozenset[str]:
        """Names whose tensors have been read successfully so far (by the caller or prefetch)."""
        with self._lock:
            futures = list(self._futures.items())
        return frozenset(
            name for name, future in futures if future.done() and future.exception() is None
        )

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._position:
            raise KeyError(name)
        self._schedule_after(name)
        future, owner = self._claim(name)
        if future is None:
            raise StoreError(f"tensor {name!r} requested after the entry was closed")
        if owner:
            self._run(name, future)
        result = future.result()
        return result.ready() if isinstance(result, PendingCopy) else result

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._position

    def wait(self, timeout: float | None = None) -> None:
        """Block until every read requested so far (including scheduled prefetches) is done."""
        with self._lock:
            tasks = list(self._tasks)
        for task in tasks:
            task.exception(timeout)
        with self._lock:
            futures = list(self._futures.values())
        for future in futures:
            future.exception(timeout)  # returns (does not raise) a failed read's error

    def close(self) -> None:
        """Release the source now; tensors not loaded yet can no longer be read."""
        with self._lock:
            self._closed = True
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self) -> LazyTensors:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"LazyTensors({len(self._names)} tensors, {len(self.loaded)} loaded)"

    def _claim(self, name: str) -> tuple[Future[torch.Tensor | PendingCopy] | None, bool]:
        """Return (future, True) if the caller must load `name`, (future, False) to wait."""
        with self._lock:
            future = self._futures.get(name)
            if future is not None:
                return future, False
            if self._closed:
                return None, False
            future = Future()
            self._futures[name] = future
            return future, True

    def _run(self, name: str, future: Future[torch.Tensor | PendingCopy]) -> None:
        tensor: torch.Tensor | PendingCopy | None = None
        failure: BaseException | None = None
        try:
            tensor = self._load(name)
        except BaseException as error:
            failure = error
            if isinstance(error, CorruptEntryError):
                self._report_corrupt(error)  # before anyone waiting on the future sees it
        with self._lock:
            self._finished += 1
            all_done = self._finished == len(self._names)
        if all_done and self._finalizer is not None:
            self._finalizer()  # the source is released before the last tensor is handed out
        if failure is not None:
            future.set_exception(failure)
        else:
            future.set_result(cast(torch.Tensor | PendingCopy, tensor))

    def _report_corrupt(self, error: CorruptEntryError) -> None:
        # A second failing read waits here until the first report (the drop) has completed.
        with self._report_lock:
            if self._corrupt_reported:
                return
            self._corrupt_reported = True
            if self._on_corrupt is not None:
                self._on_corrupt(error)

    def _schedule_after(self, name: str) -> None:
        if self._pool is None or self._prefetch_ahead == 0:
            return
        start = self._position[name] + 1
        with self._lock:
            if self._closed or self._corrupt_reported:
                return
            upcoming = [
                ahead
                for ahead in self._names[start : start + self._prefetch_ahead]
                if ahead not in self._futures and ahead not in self._scheduled
            ]
            self._scheduled.update(upcoming)
        for ahead in upcoming:
            task = self._pool.submit(functools.partial(self._prefetch, ahead))
            if task is None:
                break
            with self._lock:
                self._tasks.append(task)

    def _prefetch(self, name: str) -> None:
        future, owner = self._claim(name)
        if owner and future is not None:
            self._run(name, future)


def lazy_entry(
    payload: Any,
    header: EntryHeader,
    key: str,
    target: torch.device | None,
    *,
    pool: PrefetchPool,
    prefetch_ahead: int,
    on_corrupt: Callable[[CorruptEntryError], None],
    finite: bool = False,
    replaced: Callable[[], bool] | None = None,
) -> LazyTensors:
    """Return the lazy mapping over an entry's `payload` whose `header` is read and checked.

    Each tensor is read from the payload and verified on first access (on `target`), the next
    ones prefetched on `pool`; a damaged tensor (or with `finite`, a floating one holding NaN or
    infinity) is reported to `on_corrupt`, unless `replaced()` says the stored value changed
    since its header was read: that raises `EntryReplacedError` (not damage). Shared by every
    store that keeps entries in the disk tier's format.
    """
    infos = {info.name: info for info in header.tensors}

    def load(name: str) -> torch.Tensor | PendingCopy:
        try:
            return read_tensor(payload, infos[name], key, target, finite=finite)
        except CorruptEntryError as error:
            if replaced is not None and replaced():
                raise EntryReplacedError(key, "replaced while it was read") from error
            raise

    return LazyTensors(
        [info.name for info in header.tensors],
        load,
        metadata=header.metadata,
        pool=pool,
        prefetch_ahead=prefetch_ahead,
        on_corrupt=on_corrupt,
        on_close=payload.close,
    )


def copy_then_keep(
    stored: Mapping[str, torch.Tensor],
    target: torch.device,
    keep: Callable[[dict[str, torch.Tensor]], None],
    metadata: dict[str, str],
    on_close: Callable[[], None] | None,
    on_replaced: Callable[[], None] | None = None,
) -> LazyTensors:
    """Return a lazy view of a slower tier's entry that hands out its tensors on `target`.

    Once every tensor has been read (as a prefill does), ``keep(tensors)`` receives the pristine
    tensors, to keep them in a faster tier without a second read. A tensor already on `target`
    is handed out as it is (read, never written: `KVStore.get`), so it may be the very tensor the
    faster tier keeps. ``on_replaced()`` is called, once, when the entry turns out to have been
    replaced or evicted while it was read (`EntryReplacedError`, raised on as it is).
    """
    names = list(stored)
    collected: dict[str, torch.Tensor] = {}
    collected_lock = threading.Lock()
    replaced = [on_replaced]

    def load(name: str) -> torch.Tensor | PendingCopy:
        try:
            pristine = stored[name]
        except EntryReplacedError:
            with collected_lock:
                callback, replaced[0] = replaced[0], None
            if callback is not None:
                callback()
            raise
        with collected_lock:
            collected[name] = pristine
            complete = len(collected) == len(names)
        if complete:
            keep(dict(collected))
        return HOST_TO_DEVICE.copy(pristine, target, copy=False)  # read in place

    return LazyTensors(names, load, metadata=metadata, on_close=on_close)
