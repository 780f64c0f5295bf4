"""Blends run a slice at a time between vLLM's engine steps, so no other request waits for one.

The connector loads asynchronously: the scheduler side answers ``load_async=True``, the request
waits (``WAITING_FOR_REMOTE_KVS``) and every other request keeps stepping. The worker side must
still compute the blend somewhere, and on the CPU there is nowhere else than the cores vLLM's
forward runs on. So a blend runs in slices: `SliceRunner.run` lets the queued blends run for
about ``budget_s`` seconds at the end of each engine step (``start_load_kv``, which vLLM calls
after the step's forward when no load is synchronous), and a blend stops at its next checkpoint
(one layer of the blend loop, one entry read, one layer of KV written) once the budget is spent,
to resume there in the next step. A step lasts its forward plus at most one slice, however long
the queued blends are.

Each blend is a greenlet: a coroutine with a stack of its own, run in the engine's own thread,
so there is no second OS thread, no lock, and the blend runs with the engine thread's torch
state and the OpenMP threads vLLM bound to the cores. (A thread that runs only while the engine
thread waits for it would do the same: measured at start-up in the worker, a 2K-token blend
took 6.3 s either way on the loaded 2-core machine.) The engine thread runs slices inside
vLLM's ``execute_model`` only (under ``torch.inference_mode``, like the blend itself), so the
thread-local torch state the two share is the same on both sides of a switch; the one that
differs, a GPU blend's side stream, is set and unset at every switch (`Task.on_switch`), and
so is the CPU thread count a slice runs with (`ThreadChoice`).

A task's work gets two things: its ``pause`` (`kvblend.blend.loop.Pause`), which it calls
between its steps and which returns at once while its slice lasts, or in the next step's slice
once it is spent; and its ``cancel`` flag, set when its request is cancelled: the work stops at
its next step (`BlendCancelledError`) and the task is reported done, so that vLLM frees the
request's blocks only once nothing writes them any more.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import greenlet

from kvblend.errors import BlendCancelledError

logger = logging.getLogger(__name__)

__all__ = ["SliceRunner", "Task", "ThreadChoice"]


@dataclass(eq=False)
class Task:
    """One piece of work of the worker side: ``work(pause, cancel)``, run in slices.

    ``work`` calls ``pause()`` between its steps and stops (`BlendCancelledError`) once
    ``cancel`` is set. ``compute_s`` is the time the task ran (its slices, not the pauses).
    ``on_switch(running)`` is called as the task is resumed (True) or paused (False).
    """

    key: str
    work: Callable[[Callable[[], None], threading.Event], Any]
    on_switch: Callable[[bool], None] | None = None
    result: Any = None
    error: BaseException | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False  # it stopped because of ``cancel``
    compute_s: float = 0.0
    done: bool = field(default=False, init=False)
    _coroutine: Any = field(default=None, init=False, repr=False)


class SliceRunner:
    """Runs `Task` objects as coroutines of the calling thread, in slices of time.

    The engine thread calls `submit`, then `run(budget_s)` once per step: it returns when the
    running task reached a checkpoint after ``budget_s`` seconds, or when no task is left; the
    finished tasks are then in `take_done`. ``whole``: every task runs to its end in the first
    `run` (tensor parallelism: every rank must reach the same collectives in the same order,
    which slices of a time budget would not guarantee).
    """

    def __init__(self, *, whole: bool = False) -> None:
        self.whole = whole
        self._tasks: deque[Task] = deque()
        self._done: list[Task] = []
        self._deadline = 0.0

    def submit(self, task: Task) -> None:
        """Queue ``task`` (run in a later `run`)."""
        self._tasks.append(task)

    def cancel(self, key: str) -> None:
        """Cancel the tasks of ``key``: a queued one is dropped, a running one stops soon."""
        for task in self._tasks:
            if task.key == key:
                task.cancel.set()

    @property
    def busy(self) -> bool:
        """Whether a task is queued or under way."""
        return bool(self._tasks)

    @property
    def current(self) -> str | None:
        """The key of the task the next slice runs (None: none)."""
        return self._tasks[0].key if self._tasks else None

    def run(self, budget_s: float) -> float:
        """Let the tasks run for about ``budget_s`` seconds; return how long they ran."""
        began = time.perf_counter()
        self._deadline = float("inf") if self.whole else began + budget_s
        while self._tasks:
            task = self._tasks[0]
            if task.cancel.is_set() and task._coroutine is None:  # never started: nothing to stop
                task.cancelled = True
                self._finish(task)
                continue
            if task._coroutine is None:
                task._coroutine = greenlet.greenlet(self._body)
            resumed = time.perf_counter()
            if task.on_switch is not None:
                task.on_switch(True)
            task._coroutine.switch(task)
            if task.on_switch is not None:
                task.on_switch(False)
            task.compute_s += time.perf_counter() - resumed
            if task._coroutine.dead:
                self._finish(task)
            if time.perf_counter() >= self._deadline:
                break
        return time.perf_counter() - began

    def take_done(self) -> list[Task]:
        """Return the tasks finished (or cancelled) since the last call."""
        done, self._done = self._done, []
        return done

    def _finish(self, task: Task) -> None:
        self._tasks.popleft()
        task.done, task._coroutine = True, None
        self._done.append(task)

    def pause(self) -> None:
        """Pause the running task here once its slice is spent, until the next slice."""
        if time.perf_counter() >= self._deadline:
            parent = greenlet.getcurrent().parent
            assert parent is not None
            parent.switch()

    def _body(self, task: Task) -> None:
        """Run the task's work as its coroutine, keeping what it returned or raised."""
        try:
            task.result = task.work(self.pause, task.cancel)
        except BlendCancelledError:
            task.cancelled = True
        except BaseException as error:  # noqa: BLE001 - reported with the task
            task.error = error
            logger.debug("kvblend task %s failed: %s", task.key, error)


class ThreadChoice:
    """How many CPU threads a blend runs with: whichever runs the blend loop's ops faster now.

    The blend loop runs many small torch ops, each a parallel region whose threads all wait for
    the slowest; on cores shared with other jobs one of vLLM's threads is often descheduled, and
    measured on this project's 2-core machine under such load the loop ran 2-2.5 times faster on
    one thread than on two (4.3 s against 9.4 s for a 2K-token blend), while on idle cores two
    threads are the faster. So at most every `REPROBE_S` seconds, as a slice starts (never a
    job's first: a short job is done in one), `choose` times a few ops shaped like a layer of
    the loop's (`layer_ops`: a projection of 128 rows,
    their attention over 2,048 keys, a gather) on each thread count, a few tens of
    milliseconds in all, and the blends run on the faster until the next time.
    ``counts``: the counts tried (vLLM's own first); ``measure`` (tests): the seconds of those
    ops on ``n`` threads.
    """

    REPROBE_S = 30.0

    def __init__(
        self,
        counts: tuple[int, ...],
        measure: Callable[[int], float],
    ) -> None:
        self.counts = counts
        self.measure = measure
        self.best = counts[0]
        self._job: str | None = None
        self._probed = -float("inf")

    def choose(self, job: str | None) -> tuple[int, str | None]:
        """Return the thread count of ``job``'s next slice, and a line when the choice changed."""
        now = time.perf_counter()
        first = job != self._job  # a job's first slice: not held up (a short job is one slice)
        self._job = job
        if len(self.counts) < 2 or job is None or first or now - self._probed < self.REPROBE_S:
            return self.best, None
        self._probed = now
        seconds = {count: self.measure(count) for count in self.counts}
        best = min(seconds, key=lambda count: seconds[count])
        if best == self.best:
            return best, None
        other = max(seconds, key=lambda count: seconds[count])
        self.best = best
        return best, (
            f"kvblend: blends now run on {best} CPU thread(s): the loop's ops took "
            f"{seconds[best] / seconds[other]:.2f} of their time on {other}"
        )


def layer_ops(threads: int, heads: int, kv_heads: int, head_dim: int) -> float:
    """Return the seconds a few ops shaped like a layer of the blend loop take on ``threads``.

    The best of two rounds; run with torch's builtin thread count set, then restored.
    """
    import torch
    import torch.nn.functional as F
    from torch import _C as torch_c

    own = torch.get_num_threads()
    torch_c.set_num_threads(threads)
    try:
        generator = torch.Generator().manual_seed(0)
        hidden = torch.randn(128, heads * head_dim, generator=generator)
        weight = torch.randn(
            (heads + 2 * kv_heads) * head_dim, heads * head_dim, generator=generator
        )
        keys = torch.randn(1, heads, 2048, head_dim, generator=generator)
        rows = torch.arange(0, 2048, 16)
        best = float("inf")
        for _ in range(2):
            began = time.perf_counter()
            for _ in range(3):
                projected = hidden @ weight.T
                query = projected[:, : heads * head_dim].reshape(1, heads, 128, head_dim)
                F.scaled_dot_product_attention(query, keys, keys)
                keys.index_select(2, rows)
            best = min(best, time.perf_counter() - began)
        return best
    finally:
        torch_c.set_num_threads(own)
