"""`RemoteTieredKVStore`: the local tiers (memory -> disk) in front of a shared remote tier.

A remote tier (`RedisKVStore`) is what lets every serving process and machine reuse what any of
them precomputed. It is also the tier most likely to fail: the server may be down, slow,
restarted empty or full. So this store treats it as an accelerator, never as a dependency:

- `get()` looks in memory, then on disk, then remotely. A remote hit is handed out tensor by
  tensor as it arrives; once the caller has read every tensor, a background thread writes the
  entry into the local tiers, so the next lookup in this process does not cross the network.
- `put()` writes every tier. The remote write is synchronous: when it returns, other processes
  find the entry.
- Record logs (the engine's registry of known documents) live on the remote tier only, so that
  every process reads one sequence; while it is unreachable, reads return nothing new.
- Every remote failure is a miss, a skipped write or an empty read, logged as a warning at most
  once a minute per kind of failure; `RedisKVStore` backs off after connection failures, so a
  dead server does not cost a timeout per request.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from kvblend.store.base import (
    EntrySpec,
    KVStore,
    OtherStoreKeyError,
    RemoteUnavailableError,
    StoreError,
    StoreStats,
    validate_key,
)
from kvblend.store.disk import DiskKVStore
from kvblend.store.lazy import LazyTensors, PrefetchPool, copy_then_keep
from kvblend.store.memory import MemoryKVStore
from kvblend.store.tiered import TieredKVStore

logger = logging.getLogger(__name__)


#: Seconds between two warnings about the same kind of remote failure.
WARNING_INTERVAL_S = 60.0


class RemoteTieredKVStore(TieredKVStore):
    """`TieredKVStore` (memory -> disk) in front of a `remote` store shared by processes.

    `memory`, `disk` and `options` are `TieredKVStore`'s. `tiers` in `stats()` gains the remote
    tier under its ``tier_name`` ("redis"); the summary's `entries`, `bytes`, `evictions` and
    `capacity_bytes` are the remote tier's while it answers, and `hits`/`misses` count lookups
    through this store.
    """

    def __init__(
        self,
        memory: MemoryKVStore | None = None,
        disk: DiskKVStore | None = None,
        *,
        remote: KVStore,
        **options: Any,
    ) -> None:
        super().__init__(memory, disk, **options)
        self.remote = remote
        self.remote_name = str(getattr(remote, "tier_name", "remote"))
        self._remote_lock = threading.Lock()
        self._lookups = [0, 0]  # hits, misses through this store
        self._remote_put_errors = 0
        self._warned_at: dict[str, float] = {}
        self._promotions = PrefetchPool(max_workers=1, name="kvblend-promote")

    def _warn(self, topic: str, message: str, error: StoreError | None = None) -> None:
        if isinstance(error, RemoteUnavailableError):
            logger.debug(message)  # the remote store has logged the outage itself
            return
        now = time.monotonic()
        with self._remote_lock:
            due = now - self._warned_at.get(topic, -WARNING_INTERVAL_S) >= WARNING_INTERVAL_S
            if due:
                self._warned_at[topic] = now
        (logger.warning if due else logger.debug)(message)

    def get(
        self,
        key: str,
        device: torch.device | str | None = None,
        *,
        expect: EntrySpec | None = None,
    ) -> LazyTensors | None:
        """Return `key` from memory, disk, else the remote tier (then copied to the local ones).

        `expect` is checked by each tier (`KVStore.get`).
        """
        validate_key(key)
        found = super().get(key, device, expect=expect)
        if found is None:
            found = self._get_remote(key, device, expect)
        with self._remote_lock:
            self._lookups[0 if found is not None else 1] += 1
        return found

    def _get_remote(
        self, key: str, device: torch.device | str | None, expect: EntrySpec | None
    ) -> LazyTensors | None:
        try:
            stored = self.remote.get(key, expect=expect)
        except StoreError as error:
            self._warn(
                "get", f"KV store {self.remote_name} tier unreadable, a miss: {error}", error
            )
            return None
        if stored is None:
            return None
        target = torch.device(device) if device is not None else torch.device("cpu")
        metadata = dict(getattr(stored, "metadata", {}))

        def keep(tensors: dict[str, torch.Tensor]) -> None:
            self._promotions.submit(lambda: self._promote(key, tensors, metadata))

        def replaced() -> None:  # counted as a hit by `get`: a miss after all
            with self._remote_lock:
                self._lookups[0] -= 1
                self._lookups[1] += 1

        return copy_then_keep(
            stored, target, keep, metadata, getattr(stored, "close", None), replaced
        )

    def _promote(
        self, key: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str]
    ) -> None:
        try:
            super().put(key, tensors, metadata)
        except Exception as error:  # noqa: BLE001 - a background copy must never fail loudly
            self._warn("promote", f"KV store could not keep a remote hit locally: {error}")

    def wait_for_promotions(self) -> None:
        """Block until remote hits read so far have been written into the local tiers."""
        self._promotions.close()

    def put(
        self, key: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
    ) -> None:
        """Write `key` to every tier; failures are logged and counted, not raised."""
        super().put(key, tensors, metadata)
        try:
            self.remote.put(key, tensors, metadata)
        except OtherStoreKeyError:
            pass  # another key's entry, in use: kept locally (the remote tier says so)
        except StoreError as error:
            with self._remote_lock:
                self._remote_put_errors += 1
            self._warn(
                "put",
                f"KV store {self.remote_name} tier write failed, entry kept locally only "
                f"(further failures within a minute are counted): {error}",
                error,
            )

    def contains(self, key: str) -> bool:
        """Return True if any tier holds `key`."""
        if super().contains(key):
            return True
        try:
            return self.remote.contains(key)
        except StoreError as error:
            self._warn(
                "get", f"KV store {self.remote_name} tier unreadable, a miss: {error}", error
            )
            return False

    def delete(self, key: str) -> bool:
        """Remove `key` from every tier; return True if any held it."""
        removed = super().delete(key)
        return self.remote.delete(key) or removed

    def keys(self) -> list[str]:
        """Return the keys of every tier's entries (the local tiers' alone if the remote fails)."""
        found = dict.fromkeys(super().keys())
        try:
            found.update(dict.fromkeys(self.remote.keys()))
        except StoreError as error:
            self._warn(
                "get", f"KV store {self.remote_name} tier unreadable, a miss: {error}", error
            )
        return list(found)

    def metadata(self, key: str) -> dict[str, str] | None:
        """Return the caller's metadata of `key` from the first tier that has it."""
        found = super().metadata(key)
        if found is None:
            try:
                found = self.remote.metadata(key)
            except StoreError as error:
                self._warn(
                    "get", f"KV store {self.remote_name} tier unreadable, a miss: {error}", error
                )
        return found

    def stats(self) -> StoreStats:
        """Return the local summary with the remote tier's stats and content added."""
        local = super().stats()
        tiers = dict(local.tiers)
        try:
            tiers[self.remote_name] = self.remote.stats()
        except StoreError as error:
            self._warn("stats", f"KV store {self.remote_name} tier unreadable: {error}", error)
        backing = tiers.get(self.remote_name, local)
        with self._remote_lock:
            hits, misses = self._lookups
            put_errors = local.put_errors + self._remote_put_errors
        return dataclasses.replace(
            local,
            entries=backing.entries,
            bytes=backing.bytes,
            hits=hits,
            misses=misses,
            evictions=backing.evictions,
            corrupt_dropped=sum(tier.corrupt_dropped for tier in tiers.values()),
            other_key=sum(tier.other_key for tier in tiers.values()),
            put_errors=put_errors,
            capacity_bytes=backing.capacity_bytes,
            tiers=tiers,
        )

    def append_records(self, log: str, records: Sequence[bytes]) -> None:
        """Append to ``log`` on the remote tier; a failure is logged and the records dropped."""
        try:
            self.remote.append_records(log, records)
        except StoreError as error:
            self._warn(
                "records", f"KV store {self.remote_name} record log unusable: {error}", error
            )

    def read_records(self, log: str, cursor: int = 0) -> tuple[list[bytes], int]:
        """Return the records of ``log`` after ``cursor`` from the remote tier.

        While the remote tier is unreachable, nothing new: ``([], cursor)``.
        """
        try:
            return self.remote.read_records(log, cursor)
        except StoreError as error:
            self._warn(
                "records", f"KV store {self.remote_name} record log unusable: {error}", error
            )
            return [], cursor

    def clear(self) -> None:
        """Remove every entry from every tier (the remote one: this store's prefix only)."""
        super().clear()
        self.remote.clear()

    def close(self) -> None:
        """Finish background promotions and release every tier's threads and handles."""
        self._promotions.close()
        super().close()
        self.remote.close()
