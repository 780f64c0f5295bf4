"""The KV store: named tensors (one document segment's KV cache) under content-hash keys.

The store knows keys, tensors and string metadata only, nothing of models. `default_store()`
returns a `TieredKVStore` (memory in front of disk, then Redis when `$KVBLEND_REDIS_URL` is set);
see docs/store.md. `RedisKVStore` and `RemoteTieredKVStore` are imported on first use, so the
``redis`` package is only needed by those who use them.
"""

from typing import Any

from kvblend.store.base import (
    CorruptEntryError,
    EntryReplacedError,
    KVStore,
    OtherStoreKeyError,
    StoreError,
    StoreStats,
)
from kvblend.store.defaults import default_store
from kvblend.store.disk import DiskKVStore, default_store_dir
from kvblend.store.index import RepairReport
from kvblend.store.lazy import LazyTensors
from kvblend.store.memory import MemoryKVStore
from kvblend.store.tiered import TieredKVStore

__all__ = [
    "CorruptEntryError",
    "DiskKVStore",
    "EntryReplacedError",
    "KVStore",
    "LazyTensors",
    "MemoryKVStore",
    "OtherStoreKeyError",
    "RepairReport",
    "RedisKVStore",
    "RemoteTieredKVStore",
    "StoreError",
    "StoreStats",
    "TieredKVStore",
    "default_store",
    "default_store_dir",
]


def __getattr__(name: str) -> Any:
    if name == "RedisKVStore":
        from kvblend.store.redis import RedisKVStore

        return RedisKVStore
    if name == "RemoteTieredKVStore":
        from kvblend.store.remote_tier import RemoteTieredKVStore

        return RemoteTieredKVStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
