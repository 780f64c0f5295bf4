"""How many CPU threads torch uses for an engine: a load-aware default, or the caller's count.

On the CPU every prefill step runs on torch's intra-op thread pool. torch starts with one thread
per physical core whatever else runs on the machine; on a busy machine threads beyond the idle
cores wait on each other, and a blend (many small steps) suffers more than a full prefill: on a
busy 2-core machine a blend that takes 0.56 of full prefill's time with one thread took 1.20 of
it with torch's two (docs/benchmarks.md). `default_threads` is the cores the last minute's load
leaves idle; `use_threads` applies it (or a given count) when an engine is built, unless the
process already chose torch's thread count itself.

torch's thread count belongs to the process: every engine and every other torch user in it
shares it. So an engine built with ``threads=None`` keeps a count the process chose first
(``torch.set_num_threads`` before kvblend set any, ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS``, or
an earlier engine's), and an explicit ``threads=N`` sets it for the whole process.
"""

from __future__ import annotations

import numbers
import os
from functools import lru_cache
from pathlib import Path

import torch

__all__ = ["default_threads", "physical_cores", "use_threads"]

#: Environment variables through which a process chooses torch's thread count before it starts.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")

#: torch's thread count when kvblend's engine was first imported (torch's own default unless
#: the process changed it before): a different count later means the process chose one.
_TORCH_AT_IMPORT = torch.get_num_threads()
#: The count kvblend last set (None: it never set one).
_SET_BY_KVBLEND: int | None = None


@lru_cache(maxsize=1)
def physical_cores() -> int:
    """Physical CPU cores this process may use (hyper-threads counted once; Linux, else all)."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    usable = usable or os.cpu_count() or 1
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return usable
    cores = {
        (block.get("physical id"), block.get("core id"))
        for block in (
            dict(
                (key.strip(), value.strip())
                for key, _, value in (line.partition(":") for line in chunk.splitlines())
            )
            for chunk in cpuinfo.split("\n\n")
        )
        if "core id" in block
    }
    return max(1, min(usable, len(cores) or usable))


def default_threads() -> int:
    """Torch CPU threads for a new engine: the physical cores, fewer on a busy machine.

    The cores the last minute's load average leaves idle, at least 1: threads beyond the idle
    cores wait on each other and make every prefill slower, and a blend (many small steps)
    more than a full prefill.
    """
    cores = physical_cores()
    try:
        busy = os.getloadavg()[0]
    except (AttributeError, OSError):
        return cores
    return max(1, min(cores, round((os.cpu_count() or cores) - busy)))


def check_threads(threads: object) -> int | None:
    """Return ``threads`` if it is None or an int of at least 1, else raise one clear error."""
    if threads is None:
        return None
    if isinstance(threads, bool) or not isinstance(threads, numbers.Integral):
        raise TypeError(f"threads must be an int or None, got {type(threads).__name__}")
    if threads < 1:
        raise ValueError(f"threads must be at least 1 (None: kvblend's default), got {threads}")
    return int(threads)


def _chosen_by_process() -> bool:
    """Whether the process chose torch's thread count (kvblend must then leave it alone)."""
    if _SET_BY_KVBLEND is not None:  # an earlier engine's count (or one set since) stands
        return True
    if any(os.environ.get(name, "").strip() for name in THREAD_VARIABLES):
        return True
    return torch.get_num_threads() != _TORCH_AT_IMPORT


def use_threads(threads: int | None = None) -> int:
    """Set torch's CPU threads for an engine; return the count in use.

    ``threads``: that many (for the whole process, as ``torch.set_num_threads``). None: the
    count the process already chose, if it chose one (see the module's docstring), else
    `default_threads`.
    """
    global _SET_BY_KVBLEND
    threads = check_threads(threads)
    if threads is None:
        if _chosen_by_process():
            return torch.get_num_threads()
        threads = default_threads()
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    _SET_BY_KVBLEND = threads
    return threads
