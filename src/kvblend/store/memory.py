"""`MemoryKVStore`: an in-process LRU store bounded by the bytes of the tensors it holds.

Entries are kept as tensors, optionally on a compute device (a GPU tier), in an `OrderedDict`
used as an LRU list. `put()` stores private copies; host tensors are kept in pinned (page-locked)
memory when CUDA is available, pinned once as they are stored, so every copy to the GPU is an
asynchronous DMA with no staging. `get()` reads in place: it hands out the stored tensors
themselves when they are on the device asked for (a GPU tier read on its own device, a host tier
read on the host), and only a copy to another device otherwise. What `get()` returns is read,
never written (`KVStore.get`).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kvblend.store.base import (
    EntrySpec,
    KVStore,
    StoreStats,
    layer_order,
    non_finite,
    validate_entry,
    validate_key,
)
from kvblend.store.lazy import DEFAULT_PREFETCH_AHEAD, LazyTensors, PrefetchPool
from kvblend.store.transfer import HOST_TO_DEVICE, PendingCopy

logger = logging.getLogger(__name__)

#: Default memory budget: 2 GiB holds e.g. ~16k tokens of an 8B GQA model's fp16 KV.
DEFAULT_MEMORY_BYTES = 2 << 30


@dataclass
class _Entry:
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str]
    nbytes: int
    finite: bool  # every value finite: checked as the entry was written, never as it is read

    def mismatch(self, expect: EntrySpec) -> str | None:
        """Say how this entry differs from `expect`: names, dtypes, shapes, finite values."""
        found = {name: (t.dtype, tuple(t.shape)) for name, t in self.tensors.items()}
        reason = expect.mismatch(found)
        if reason is None and expect.finite and not self.finite:
            reason = "a tensor holds NaN or infinity"
        return reason


def _finite(tensors: Mapping[str, torch.Tensor]) -> bool:
    """Whether every value of ``tensors`` is finite (a sum per tensor: a host sync on a GPU)."""
    return not any(non_finite(t) for t in tensors.values())


class MemoryKVStore(KVStore):
    """LRU store in process memory, bounded by the total `nbytes` of the stored tensors.

    `device` (e.g. "cuda") keeps stored tensors on that device; None keeps each tensor on the
    device it was put from. An entry larger than `max_bytes` is not stored. Thread safe.
    """

    def __init__(
        self,
        max_bytes: int = DEFAULT_MEMORY_BYTES,
        device: torch.device | str | None = None,
        *,
        prefetch_ahead: int = DEFAULT_PREFETCH_AHEAD,
    ) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self.device = torch.device(device) if device is not None else None
        self._prefetch_ahead = prefetch_ahead
        self._pool = PrefetchPool()
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._bytes = 0
        self._hits = 0
        self._misses = 0
        self._evictions = 0
        self._corrupt = 0

    def get(
        self,
        key: str,
        device: torch.device | str | None = None,
        *,
        expect: EntrySpec | None = None,
    ) -> LazyTensors | None:
        """Return a lazy mapping of the tensors under `key` (on `device`), or None.

        Tensors already on `device` (or every tensor, when `device` is None) are the stored
        ones, handed out in place: read them, never write them. Others are copies.

        An entry whose names, dtypes or shapes are not those `expect` gives, or (with
        `expect.finite`) that holds NaN or infinity, is dropped, counted and reported as a
        miss. Values were checked as the entry was written (`put`, `insert_owned`): a read
        never waits on a device.
        """
        validate_key(key)
        target = torch.device(device) if device is not None else None
        with self._lock:
            entry = self._entries.get(key)
            reason = entry.mismatch(expect) if entry is not None and expect is not None else None
            if reason is not None:
                logger.warning("dropping KV entry %s from memory: it does not fit: %s", key, reason)
                self._pop(key)
                self._corrupt += 1
                entry = None
            if entry is None:
                self._misses += 1
                return None
            self._entries.move_to_end(key)
            self._hits += 1
        stored = entry.tensors

        def load(name: str) -> torch.Tensor | PendingCopy:
            return HOST_TO_DEVICE.copy(stored[name], target, copy=False)  # read in place

        return LazyTensors(
            sorted(stored, key=layer_order),
            load,
            metadata=entry.metadata,
            pool=self._pool,
            prefetch_ahead=self._prefetch_ahead,
        )

    def put(
        self, key: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
    ) -> None:
        """Store private copies of `tensors` under `key`, on the store's device.

        Host copies are made straight into pinned memory when CUDA is available.
        """
        validate_key(key)
        checked, user_metadata = validate_entry(tensors, metadata)
        if sum(t.nbytes for t in checked.values()) > self.max_bytes:
            logger.debug("entry %s is larger than the memory store (%d bytes)", key, self.max_bytes)
            self.delete(key)
            return
        copies = {name: self._private_copy(tensor.detach()) for name, tensor in checked.items()}
        self.insert_owned(key, copies, user_metadata, finite=_finite(copies))

    def _private_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """Return a copy of `tensor` on the store's device, in pinned memory if kept pinned."""
        device = self.device if self.device is not None else tensor.device
        if not _pins(device):
            return tensor.to(device, copy=True)
        pinned = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        return pinned.copy_(tensor)

    def insert_owned(
        self,
        key: str,
        tensors: dict[str, torch.Tensor],
        metadata: Mapping[str, str],
        finite: bool | None = None,
    ) -> None:
        """Store tensors the store may keep as they are (no copy), evicting LRU entries.

        For use inside the store package (the tiered store promotes disk hits this way); the
        tensors are only read afterwards, by anyone. Host tensors not pinned yet are pinned
        here when CUDA is available (once: they are kept pinned). ``finite``: whether every
        value is known finite (checked as they were read from bytes); None: checked here.
        """
        if finite is None:
            finite = _finite(tensors)
        tensors = {
            name: t.pin_memory() if _pins(t.device) and not t.is_pinned() else t
            for name, t in tensors.items()
        }
        nbytes = sum(t.nbytes for t in tensors.values())
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            if nbytes > self.max_bytes:
                return
            self._entries[key] = _Entry(dict(tensors), dict(metadata), nbytes, finite)
            self._bytes += nbytes
            while self._bytes > self.max_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= evicted.nbytes
                self._evictions += 1

    def contains(self, key: str) -> bool:
        """Return True if `key` is held (does not count as a use for LRU)."""
        validate_key(key)
        with self._lock:
            return key in self._entries

    def delete(self, key: str) -> bool:
        """Remove `key`; return True if it was held."""
        validate_key(key)
        with self._lock:
            return self._pop(key)

    def _pop(self, key: str) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self._bytes -= entry.nbytes
        return True

    def keys(self) -> list[str]:
        """Return the keys of every entry held."""
        with self._lock:
            return list(self._entries)

    def metadata(self, key: str) -> dict[str, str] | None:
        """Return the caller's metadata of `key`, or None."""
        validate_key(key)
        with self._lock:
            entry = self._entries.get(key)
            return dict(entry.metadata) if entry is not None else None

    def stats(self) -> StoreStats:
        """Return counters; `bytes` is the sum of the held tensors' `nbytes`."""
        with self._lock:
            return StoreStats(
                entries=len(self._entries),
                bytes=self._bytes,
                hits=self._hits,
                misses=self._misses,
                evictions=self._evictions,
                corrupt_dropped=self._corrupt,
                capacity_bytes=self.max_bytes,
            )

    def clear(self) -> None:
        """Drop every entry."""
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def close(self) -> None:
        """Stop the prefetch threads (the entries are kept)."""
        self._pool.close()


def _pins(device: torch.device) -> bool:
    """Whether tensors kept on `device` are kept pinned: host memory when CUDA is available."""
    return device.type == "cpu" and torch.cuda.is_available()
