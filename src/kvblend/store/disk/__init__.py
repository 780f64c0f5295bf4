"""The disk back-end: `DiskKVStore`, entries as files in a `diskcache` folder shared by processes.

`store` is the store itself; `rebuild` rebuilds a lost or damaged index from the entry files
and sweeps what a killed writer left; `readonly` serves a folder on a read-only or full disk.
The folder plumbing they stand on (`kvblend.store.files`: file modes, links, the bytes-only
serializer; `kvblend.store.index`: opening and setting aside the SQLite index) lies one level
up, because the record logs every store keeps (`kvblend.store.record_logs`) are built on it too.
Nothing here imports the Redis back-end.
"""

from kvblend.store.disk.store import (
    DEFAULT_DISK_BYTES,
    OTHER_KEY_IDLE_S,
    READ_ONLY_RETRY_S,
    STORE_DIR_ENV,
    DiskKVStore,
    default_store_dir,
)

__all__ = [
    "DEFAULT_DISK_BYTES",
    "OTHER_KEY_IDLE_S",
    "READ_ONLY_RETRY_S",
    "STORE_DIR_ENV",
    "DiskKVStore",
    "default_store_dir",
]
