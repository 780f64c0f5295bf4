"""`TieredKVStore`: a memory tier in front of a disk tier, and `default_store()`.

`get()` looks in memory, then on disk; a disk hit is promoted to memory once the caller has read
all of its tensors (which the engine does during prefill), so promotion costs no extra disk read.
`put()` writes both tiers. Storage failures never reach the caller: a disk that is full, read-only
or gone is logged once (`logging.warning`), counted in `stats().put_errors`, and the store keeps
working from memory. Invalid keys or tensors still raise, since they are programming errors.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence

import torch

from kvblend.store.base import KVStore, StoreError, StoreStats, validate_entry, validate_key
from kvblend.store.disk import DEFAULT_DISK_BYTES, DiskKVStore
from kvblend.store.lazy import LazyTensors
from kvblend.store.memory import DEFAULT_MEMORY_BYTES, MemoryKVStore

logger = logging.getLogger(__name__)


class TieredKVStore(KVStore):
    """Memory tier in front of an optional disk tier (`disk=None`: memory only).

    Summary stats: `hits`/`misses` are lookups through this store; `entries`, `bytes`,
    `evictions` and `capacity_bytes` are the backing tier's (disk, or memory without disk);
    `corrupt_dropped` adds both tiers; `tiers` holds each tier's own stats.
    """

    def __init__(
        self, memory: MemoryKVStore | None = None, disk: DiskKVStore | None = None
    ) -> None:
        self.memory = memory if memory is not None else MemoryKVStore()
        self.disk = disk
        self._lock = threading.Lock()
        self._hits = self._misses = self._put_errors = 0
        self._warned: set[str] = set()

    def get(self, key: str, device: torch.device | str | None = None) -> LazyTensors | None:
        """Return the tensors of `key` from memory, else from disk (promoted once fully read)."""
        validate_key(key)
        found = self.memory.get(key, device)
        if found is None and self.disk is not None:
            found = self._get_from_disk(key, device)
        with self._lock:
            if found is None:
                self._misses += 1
            else:
                self._hits += 1
        return found

    def _get_from_disk(self, key: str, device: torch.device | str | None) -> LazyTensors | None:
        assert self.disk is not None
        keep_on = self.memory.device if self.memory.device is not None else torch.device("cpu")
        try:
            stored = self.disk.get(key, device=keep_on)
        except StoreError as error:
            self._warn_once("get", f"KV store disk tier unreadable, using memory only: {error}")
            return None
        if stored is None:
            return None
        target = torch.device(device) if device is not None else keep_on
        names = list(stored)
        collected: dict[str, torch.Tensor] = {}
        collected_lock = threading.Lock()

        def load(name: str) -> torch.Tensor:
            pristine = stored[name]
            with collected_lock:
                collected[name] = pristine
                complete = len(collected) == len(names)
            if complete:
                self._promote(key, dict(collected), stored.metadata)
            return pristine.to(target, copy=True)

        return LazyTensors(names, load, metadata=stored.metadata, on_close=stored.close)

    def _promote(
        self, key: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str]
    ) -> None:
        try:
            self.memory.insert_owned(key, tensors, metadata)
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
        if self.disk is not None:
            try:
                self.disk.put(key, tensors, metadata)
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
        try:
            return self.disk is not None and self.disk.contains(key)
        except StoreError as error:
            self._warn_once("get", f"KV store disk tier unreadable, using memory only: {error}")
            return False

    def delete(self, key: str) -> bool:
        """Remove `key` from both tiers; return True if either held it."""
        removed = self.memory.delete(key)
        if self.disk is not None:
            removed = self.disk.delete(key) or removed
        return removed

    def metadata(self, key: str) -> dict[str, str] | None:
        """Return the caller's metadata of `key` from memory, else from disk."""
        found = self.memory.metadata(key)
        if found is None and self.disk is not None:
            try:
                found = self.disk.metadata(key)
            except StoreError as error:
                self._warn_once("get", f"KV store disk tier unreadable, using memory only: {error}")
        return found

    def stats(self) -> StoreStats:
        """Return lookups through this store, the backing tier's content, and per-tier stats."""
        tiers = {"memory": self.memory.stats()}
        if self.disk is not None:
            try:
                tiers["disk"] = self.disk.stats()
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
            )

    def append_records(self, log: str, records: Sequence[bytes]) -> None:
        """Append to ``log`` in the backing tier (disk, else memory); failures are logged."""
        if self.disk is not None:
            try:
                self.disk.append_records(log, records)
                return
            except StoreError as error:
                self._warn_once("records", f"KV store disk tier record log unusable: {error}")
        self.memory.append_records(log, records)

    def read_records(self, log: str, cursor: int = 0) -> tuple[list[bytes], int]:
        """Return the records of ``log`` after ``cursor`` from the backing tier."""
        if self.disk is not None:
            try:
                return self.disk.read_records(log, cursor)
            except StoreError as error:
                self._warn_once("records", f"KV store disk tier record log unusable: {error}")
        return self.memory.read_records(log, cursor)

    def clear(self) -> None:
        """Remove every entry from both tiers."""
        self.memory.clear()
        if self.disk is not None:
            self.disk.clear()

    def close(self) -> None:
        """Release both tiers' threads and handles."""
        self.memory.close()
        if self.disk is not None:
            self.disk.close()


def default_store(
    directory: str | os.PathLike[str] | None = None,
    *,
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
    disk_bytes: int = DEFAULT_DISK_BYTES,
    device: torch.device | str | None = None,
    redis_url: str | None = None,
    redis_ttl_s: float | None = None,
) -> TieredKVStore:
    """Build the default store: 2 GiB in memory in front of 20 GiB on disk, then Redis if set.

    The disk folder is `directory`, else `$KVBLEND_STORE_DIR`, else the user cache folder (see
    `default_store_dir`). `device` places the memory tier (e.g. "cuda"). If the folder cannot be
    opened (read-only, not a folder), a warning is logged and the store is memory only.
    With `redis_url`, else `$KVBLEND_REDIS_URL`, a `RedisKVStore` (entries expiring after
    `redis_ttl_s`, if given) becomes a third, shared tier (`RemoteTieredKVStore`).
    """
    memory = MemoryKVStore(memory_bytes, device=device)
    try:
        disk: DiskKVStore | None = DiskKVStore(directory, size_limit=disk_bytes)
    except StoreError as error:
        logger.warning("KV store disk tier unavailable, using memory only: %s", error)
        disk = None
    redis_url = redis_url or os.environ.get("KVBLEND_REDIS_URL")
    if redis_url:
        from kvblend.store.redis import RedisKVStore
        from kvblend.store.remote_tier import RemoteTieredKVStore

        remote = RedisKVStore(redis_url, ttl_s=redis_ttl_s)
        return RemoteTieredKVStore(memory, disk, remote=remote)
    return TieredKVStore(memory, disk)
