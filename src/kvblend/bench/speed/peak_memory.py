"""Peak memory of a block of code: the device's allocator on CUDA, the process's RSS on a CPU."""

from __future__ import annotations

import resource

import torch


def _peak_rss_reset() -> bool:
    """Reset this process's peak RSS (Linux ``clear_refs``); False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as file:
            file.write("5")
        return True
    except OSError:
        return False


def _rss_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as file:
            for line in file:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class PeakMemory:
    """Peak memory of a block, in MiB above what was in use when it started.

    CUDA: ``torch.cuda.max_memory_allocated``. CPU on Linux: the process's peak RSS (VmHWM), reset
    before the block; elsewhere the growth of ``getrusage`` maxrss (zero unless a new high).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.mib = 0.0

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        elif _peak_rss_reset() and _rss_kib("VmRSS") is not None:
            self._base = _rss_kib("VmRSS") or 0
            self._mode = "hwm"
        else:
            self._base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            self._mode = "maxrss"
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.mib = (torch.cuda.max_memory_allocated(self.device) - self._base) / 2**20
        elif self._mode == "hwm":
            self.mib = ((_rss_kib("VmHWM") or 0) - self._base) / 1024
        else:
            self.mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - self._base) / 1024
