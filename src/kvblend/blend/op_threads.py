"""CPU threads of the blend loop's ops: an op gets every thread only where that pays, now.

On the CPU torch splits every op above about 32K elements between all of its intra-op threads,
which meet at a barrier when the op ends. On idle cores a barrier costs little; when other
processes keep the cores busy it costs what the scheduler makes the slowest thread wait, which
can be many times a small op's own time (the measurements are in benchmarks/cpu.md, "CPU
threads on a busy machine"). A blend computes a fifth of the rows or fewer, so its ops are
small (RoPE, the stale-KV correction, gathers and writes of a few hundred rows, a probe's few
dozen rows): it is the first to lose.

So each layer of a pass runs on one thread (`small_ops`), and an op (or a group of ops) gets the
caller's thread count back (`big`) only when it pays:

- the cores other processes keep busy are measured as the loop runs (`Cores`: the machine's
  busy time from ``/proc/stat`` less this process's own CPU time, over the last layers, a
  moving average over about `AVERAGE_S` seconds). With fewer idle cores than threads, a
  barrier waits for a descheduled thread: ops run on as many threads as there are idle cores
  (a core busy less than a tenth of the time counted idle; one thread on a 2-core machine with
  a core held by another process: no op waits for it);
- with the cores idle, an op runs on every thread when its work, at `RATE` multiply-adds a
  second of one thread, lasts at least `MIN_WIDE_S` plus `GAIN` times the wait that the other
  processes' share of a core makes likely (`WAIT_S` a busy core); a copied or element-wise
  element counts `ELEMENT_WORK` multiply-adds. On idle cores that is nearly every op of a 4K
  prompt; with half a core busy elsewhere, the ops of 4 ms or more.

The caller's count is ``torch.get_num_threads()`` when a layer starts (an engine's
``threads``, vLLM's choice); nothing changes with one thread, on CUDA or inside a compiled
step, and the count is restored before the loop checks its cancel flag (where the vLLM
connector pauses a blend and runs vLLM's own forward on the same thread). Without
``/proc/stat`` (not Linux) the cores are taken as idle. torch's thread count is set with its
builtin (``torch._C.set_num_threads``, which vLLM's CPU worker keeps while it replaces
``torch.set_num_threads``); with OpenMP it is the calling thread's, so other threads of the
process keep theirs.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import _C as torch_c

__all__ = ["ELEMENT_WORK", "Cores", "big", "small_ops"]

#: Multiply-adds a second of one thread (an fp32 matmul on this project's CPU: ~100 GFLOP/s),
#: what turns an op's work into its time.
RATE = 5e10

#: What one element of a copy or an element-wise op costs, in multiply-adds of a matmul (memory
#: bound: well under a nanosecond an element).
ELEMENT_WORK = 32

#: Seconds under which an op never runs on every thread (its barrier costs more than it saves).
MIN_WIDE_S = 1e-4

#: Seconds a barrier waits when another process holds a core its threads need (a few
#: scheduler time slices), and how many of those an op must last to run on every thread.
WAIT_S = 2e-3
GAIN = 4.0

#: Seconds over which the other processes' busy cores are averaged.
AVERAGE_S = 0.5

#: Seconds between two readings of ``/proc/stat`` (its clock ticks are 10 ms).
SAMPLE_S = 0.05

_LOCAL = threading.local()


class Cores:
    """How many cores other processes keep busy: a moving average, read as the loop runs."""

    def __init__(
        self,
        stat: str = "/proc/stat",
        clock: Callable[[], float] = time.perf_counter,
        own_cpu: Callable[[], float] = time.process_time,
    ) -> None:
        self.stat = stat
        self.clock = clock
        self.own_cpu = own_cpu
        self.tick = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01
        self.count = 0
        self.others = 0.0  # cores busy with other processes, averaged
        self.last: tuple[float, float, float, float] | None = None
        self._lock = threading.Lock()
        self._read()

    def _read(self) -> tuple[float, float, float, float] | None:
        """Return (now, machine busy seconds, machine total seconds, own CPU seconds)."""
        try:
            with open(self.stat, "rb") as file:
                lines = file.read().split(b"\n")
        except OSError:
            return None
        fields = [int(x) for x in lines[0].split()[1:9]]  # user ... steal
        idle = fields[3] + fields[4]  # idle, iowait
        self.count = sum(1 for line in lines if line[:3] == b"cpu" and line[3:4].isdigit())
        total = sum(fields) * self.tick
        return self.clock(), total - idle * self.tick, total, self.own_cpu()

    def busy_elsewhere(self) -> float:
        """Return the cores other processes kept busy lately (0 where it cannot be read)."""
        with self._lock:
            now = self.clock()
            if self.last is not None and now - self.last[0] < SAMPLE_S:
                return self.others
            sample = self._read()
            if sample is None:
                return 0.0
            if self.last is not None:
                wall = sample[0] - self.last[0]
                others = (sample[1] - self.last[1] - (sample[3] - self.last[3])) / wall
                others = min(max(others, 0.0), float(self.count))
                weight = min(1.0, wall / AVERAGE_S)
                self.others += weight * (others - self.others)
            self.last = sample
            return self.others

    def threads(self, wanted: int) -> tuple[int, float]:
        """Return the threads big ops get out of ``wanted``, and the work they need for them.

        As many threads as there are idle cores; the work (multiply-adds) of an op that lasts
        long enough to pay for a barrier at the other processes' share of the cores.
        """
        others = self.busy_elsewhere()
        idle = (self.count or wanted) - others
        threads = max(1, min(wanted, int(idle + 0.9)))
        least = RATE * (MIN_WIDE_S + GAIN * WAIT_S * min(others, 1.0))
        return threads, least


_CORES: Cores | None = None


def cores() -> Cores:
    """Return the process's `Cores` (made on first use)."""
    global _CORES
    if _CORES is None:
        _CORES = Cores()
    return _CORES


def _wide() -> tuple[int, float] | None:
    """Return this region's thread count for big ops and the work they need (None: none)."""
    state: tuple[int, float] | None = getattr(_LOCAL, "wide", None)
    return state


@contextlib.contextmanager
def small_ops(device: torch.device) -> Iterator[None]:
    """Run what follows on one CPU thread; `big` gives an op more where that pays.

    A no-op on CUDA, with one thread, or inside another `small_ops` region.
    """
    wanted = torch.get_num_threads()
    if device.type != "cpu" or wanted <= 1 or _wide() is not None:
        yield
        return
    _LOCAL.wide = cores().threads(wanted)
    torch_c.set_num_threads(1)
    try:
        yield
    finally:
        torch_c.set_num_threads(wanted)
        _LOCAL.wide = None


class _Wide:
    """A region where torch runs on ``threads`` threads, then on one again."""

    def __init__(self, threads: int) -> None:
        self.threads = threads

    def __enter__(self) -> None:
        torch_c.set_num_threads(self.threads)

    def __exit__(self, *exc: object) -> None:
        torch_c.set_num_threads(1)


def big(work: float) -> Any:
    """Return a context running its ops on more threads when ``work`` multiply-adds pay for it.

    Inside a `small_ops` region and outside a compiled step only; elsewhere a null context.
    """
    if torch.compiler.is_compiling():
        return contextlib.nullcontext()
    state = _wide()
    if state is None or state[0] <= 1 or work < state[1]:
        return contextlib.nullcontext()
    return _Wide(state[0])
