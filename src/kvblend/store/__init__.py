"""The KV store: named tensors (one document segment's KV cache) under content-hash keys.

The store knows keys, tensors and string metadata only, nothing of models. `default_store()`
returns a `TieredKVStore` (memory in front of disk); see docs/store.md.
"""

from kvblend.store.base import CorruptEntryError, KVStore, StoreError, StoreStats
from kvblend.store.disk import DiskKVStore, default_store_dir
from kvblend.store.index import RepairReport
from kvblend.store.lazy import LazyTensors
from kvblend.store.memory import MemoryKVStore
from kvblend.store.tiered import TieredKVStore, default_store

__all__ = [
    "CorruptEntryError",
    "DiskKVStore",
    "KVStore",
    "LazyTensors",
    "MemoryKVStore",
    "RepairReport",
    "StoreError",
    "StoreStats",
    "TieredKVStore",
    "default_store",
    "default_store_dir",
]
