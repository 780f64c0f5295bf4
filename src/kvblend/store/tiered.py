"""`TieredKVStore`: a memory tier in front of a disk tier.

`get()` looks in memory, then on disk; a disk hit is promoted to memory once the caller has read
all of its tensors (which the engine does during prefill), so promotion costs no extra disk read.
`put()` writes both tiers. Storage failures never reach the caller: a disk that is full, read-only
or gone is logged once (`logging.warning`), counted in `stats().put_errors`, and the store keeps
working from memory. A disk folder that cannot be opened at all is tried again every
`disk_retry_s` seconds, so a folder made writable (or repaired) later is used without a restart.
Invalid keys or tensors still raise, since they are programming errors.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import torch

from kvblend.store.base import (
    EntrySpec,
    KVStore,
    OtherStoreKeyError,
    StoreError,
    StoreStats,
    validate_entry,
    validate_key,
)
from kvblend.store.disk import DiskKVStore
from kvblend.store.lazy import LazyTensors, copy_then_keep
from kvblend.store.memory import MemoryKVStore

logger = logging.getLogger(__name__)

#: Seconds between attempts at opening a disk tier that could not be opened.
DEFAULT_DISK_RETRY_S = 30.0


class TieredKVStore(KVStore):
    """Memory tier in front of an optional disk tier (`disk=None`: memory only).

    Summary stats: `hits`/`misses` are lookups through this store; `entries`, `bytes`,
    `evictions` and `capacity_bytes` are the backing tier's (disk, or memory without disk);
    `corrupt_dropped` adds both tiers; `tiers` holds each tier's own stats.

    `open_disk`, when given, builds the disk tier: while `disk` is None (the folder could not be
    opened), it is called again at most every `disk_retry_s` seconds, and the first success
    becomes the disk tier.
    """

    def __init__(
        self,
        memory: MemoryKVStore | None = None,
        disk: DiskKVStore | None = None,
        *,
        open_disk: Callable[[], DiskKVStore] | None = None,
        disk_retry_s: float = DEFAULT_DISK_RETRY_S,
    ) -> None:
        if disk_retry_s < 0:
            raise ValueError(f"disk_retry_s must be >= 0, got {disk_retry_s}")
        self.memory = memory if memory is not None else MemoryKVStore()
        self.disk = disk
        self._open_disk = open_disk
        self._disk_retry_s = float(disk_retry_s)
        self._disk_retry_at = time.monotonic() + self._disk_retry_s
        self._lock = threading.Lock()
        self._hits = self._misses = self._put_errors = 0
        self._warned: set[str] = set()

    def _disk_tier(self) -> DiskKVStore | None:
        """Return the disk tier, trying to open it again once the back-off has passed."""
        if self.disk is not None or self._open_disk is None:
            return self.disk
        with self._lock:
            now = time.monotonic()
            if now < self._disk_retry_at:
                return None
            self._disk_retry_at = now + self._disk_retry_s
        try:
            disk = self._open_disk()
        except StoreError as error:
            logger.debug("KV store disk tier still unavailable: %s", error)
            return None
        with self._lock:
            adopted = self.disk is None
            if adopted:
                self.disk = disk
                self._warned.clear()
        if adopted:
            logger.warning("KV store disk tier in %s is available again", disk.directory)
        else:
            disk.close()
        return self.disk

    def get(
        self,
        key: str,
        device: torch.device | str | None = None,
        *,
        expect: EntrySpec | None = None,
    ) -> LazyTensors | None:
        """Return the tensors of `key` from memory, else from disk (promoted once fully read).

        `expect` is checked by each tier (`KVStore.get`).
        """
        validate_key(key)
        found = self.memory.get(key, device, expect=expect)
        disk = self._disk_tier() if found is None else None
        if disk is not None:
            found = self._get_from_disk(disk, key, device, expect)
        with self._lock:
            if found is None:
                self._misses += 1
            else:
                self._hits += 1
        return found

    def _get_from_disk(
        self,
        disk: DiskKVStore,
        key: str,
        device: torch.device | str | None,
        expect: EntrySpec | None,
    ) -> LazyTensors | None:
        keep_on = self.memory.device if self.memory.device is not None else torch.device("cpu")
        try:
            stored = disk.get(key, device=keep_on, expect=expect)
        except StoreError as error:
            self._warn_once("get", f"KV store disk tier unreadable, using memory only: {error}")
            return None
        if stored is None:
            return None
        target = torch.device(device) if device is not None else keep_on
        metadata = stored.metadata
        finite = True if expect is not None and expect.finite else None  # checked as read
        return copy_then_keep(
            stored,
            target,
            lambda tensors: self._keep_in_memory(key, tensors, metadata, finite),
            metadata,
            stored.close,
        )

    def _keep_in_memory(
        self,
        key: str,
        tensors: dict[str, torch.Tensor],
        metadata: dict[str, str],
        finite: bool | None,
    ) -> None:
        """Promote a disk hit into the memory tier (``finite``: its values were checked)."""
        try:
            self.memory.insert_owned(key, tensors, metadata, finite)
        except Exception as error:  # noqa: BLE001 - e.g. device out of memory; never fatal
            self._count_put_error("memory", error)

    def put(
        self, key: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
    ) -> None:
        """Write `key` to memory and disk; storage failures are logged and counted, not raised."""
        validate_key(key)
        validate_entry(tensors, metadata)
        try:
            self.memory.put(key, tensors, metadata)
        except Exception as error:  # noqa: BLE001 - e.g. device out of memory; never fatal
            self._count_put_error("memory", error)
        disk = self._disk_tier()
        if disk is not None:
            try:
                disk.put(key, tensors, metadata)
            except OtherStoreKeyError:
                pass  # another key's entry, in use: kept in memory only (the disk tier says so)
            except StoreError as error:
                self._count_put_error("disk", error)

    def _count_put_error(self, tier: str, error: BaseException) -> None:
        with self._lock:
            self._put_errors += 1
        self._warn_once(
            f"put-{tier}",
            f"KV store {tier} tier write failed, entry kept in "
            f"the other tier only (further failures are counted): {error}",
        )

    def _warn_once(self, topic: str, message: str) -> None:
        with self._lock:
            first = topic not in self._warned
            self._warned.add(topic)
        if first:
            logger.warning(message)
        else:
            logger.debug(message)

    def contains(self, key: str) -> bool:
        """Return True if either tier holds `key`."""
        if self.memory.contains(key):
            return True
        disk = self._disk_tier()
        try:
            return disk is not None and disk.contains(key)
        except StoreError as error:
            self._warn_once("get", f"KV store disk tier unreadable, using memory only: {error}")
            return False

    def delete(self, key: str) -> bool:
        """Remove `key` from both tiers; return True if either held it."""
        removed = self.memory.delete(key)
        disk = self._disk_tier()
        if disk is not None:
            removed = disk.delete(key) or removed
        return removed

    def keys(self) -> list[str]:
        """Return the keys of both tiers' entries (the memory tier's alone if the disk fails)."""
        found = dict.fromkeys(self.memory.keys())
        disk = self._disk_tier()
        if disk is not None:
            try:
                found.update(dict.fromkeys(disk.keys()))
            except StoreError as error:
                self._warn_once("get", f"KV store disk tier unreadable, using memory only: {error}")
        return list(found)

    def metadata(self, key: str) -> dict[str, str] | None:
        """Return the caller's metadata of `key` from memory, else from disk."""
        found = self.memory.metadata(key)
        disk = self._disk_tier() if found is None else None
        if disk is not None:
            try:
                found = disk.metadata(key)
            except StoreError as error:
                self._warn_once("get", f"KV store disk tier unreadable, using memory only: {error}")
        return found

    def stats(self) -> StoreStats:
        """Return lookups through this store, the backing tier's content, and per-tier stats."""
        tiers = {"memory": self.memory.stats()}
        disk = self._disk_tier()
        if disk is not None:
            try:
                tiers["disk"] = disk.stats()
            except StoreError as error:
                self._warn_once("get", f"KV store disk tier unreadable, using memory only: {error}")
        backing = tiers.get("disk", tiers["memory"])
        with self._lock:
            return StoreStats(
                entries=backing.entries,
                bytes=backing.bytes,
                hits=self._hits,
                misses=self._misses,
                evictions=backing.evictions,
                corrupt_dropped=sum(tier.corrupt_dropped for tier in tiers.values()),
                put_errors=self._put_errors,
                capacity_bytes=backing.capacity_bytes,
                tiers=tiers,
                read_only="disk" in tiers and tiers["disk"].read_only,
                other_key=sum(tier.other_key for tier in tiers.values()),
            )

    def append_records(self, log: str, records: Sequence[bytes]) -> None:
        """Append to ``log`` in the backing tier (disk, else memory); failures are logged."""
        disk = self._disk_tier()
        if disk is not None:
            try:
                disk.append_records(log, records)
                return
            except StoreError as error:
                self._warn_once("records", f"KV store disk tier record log unusable: {error}")
        self.memory.append_records(log, records)

    def read_records(self, log: str, cursor: int = 0) -> tuple[list[bytes], int]:
        """Return the records of ``log`` after ``cursor`` from the backing tier."""
        disk = self._disk_tier()
        if disk is not None:
            try:
                return disk.read_records(log, cursor)
            except StoreError as error:
                self._warn_once("records", f"KV store disk tier record log unusable: {error}")
        return self.memory.read_records(log, cursor)

    def clear(self) -> None:
        """Remove every entry from both tiers."""
        self.memory.clear()
        disk = self._disk_tier()
        if disk is not None:
            disk.clear()

    def close(self) -> None:
        """Release both tiers' threads and handles."""
        self.memory.close()
        if self.disk is not None:
            self.disk.close()
