"""`DiskKVStore`: entries as safetensors bytes in a `diskcache` folder shared by processes.

`diskcache.Cache` provides the index (SQLite), LRU eviction by size and safe concurrent use by
several processes. Values are always `bytes`, so diskcache keeps small entries as SQLite blobs and
writes large ones to files as they are; the `_BytesOnlyDisk` serializer refuses anything else
and refuses to unpickle what another program may have left in the folder, so nothing is ever
pickled. Reads open the entry's file and parse only its header; tensors are read one at a time
by the lazy mapping `get()` returns, each checked against its checksum.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import diskcache
import platformdirs
import torch
from diskcache.core import MODE_BINARY, MODE_RAW, UNKNOWN

from kvblend.store.base import (
    CorruptEntryError,
    KVStore,
    StoreError,
    StoreStats,
    validate_entry,
    validate_key,
)
from kvblend.store.entry_format import Payload, encode_entry, read_header, read_tensor
from kvblend.store.lazy import DEFAULT_PREFETCH_AHEAD, LazyTensors, PrefetchPool
from kvblend.store.records import DiskRecordLogs

logger = logging.getLogger(__name__)

#: Environment variable that overrides the default store folder.
STORE_DIR_ENV = "KVBLEND_STORE_DIR"
#: Default disk budget: 20 GiB, a few hundred thousand tokens of a 1-8B model's fp16 KV.
DEFAULT_DISK_BYTES = 20 << 30

_STORAGE_ERRORS = (OSError, sqlite3.Error, diskcache.Timeout)


def default_store_dir() -> Path:
    """Return `$KVBLEND_STORE_DIR`, or the user cache folder + ``kvblend/kv``."""
    override = os.environ.get(STORE_DIR_ENV)
    if override:
        return Path(override).expanduser()
    return Path(platformdirs.user_cache_dir("kvblend")) / "kv"


class _ForeignValueError(Exception):
    """The folder holds a value kvblend did not write (pickled, text, number)."""


def _write_file(path: str, data: bytes) -> None:
    """Write `data` to a new file at `path`; leave no partial file behind on failure."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        with open(path, "xb") as file:
            file.write(data)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(path)
        raise


class _BytesOnlyDisk(diskcache.Disk):
    """diskcache serializer for str keys and bytes values only: never pickles or unpickles."""

    def put(self, key: object) -> tuple[object, bool]:
        if type(key) is not str:
            raise TypeError("the KV store only uses str keys")
        return super().put(key)

    def get(self, key: object, raw: bool) -> object:
        if not raw:
            raise _ForeignValueError("pickled key")
        return super().get(key, raw)

    def store(self, value: object, read: bool, key: object = UNKNOWN) -> tuple:
        if type(value) is not bytes:
            raise TypeError("the KV store only stores bytes")
        if len(value) < self.min_file_size:
            return 0, MODE_RAW, None, sqlite3.Binary(value)
        filename, full_path = self.filename(key, value)
        _write_file(full_path, value)
        return len(value), MODE_BINARY, filename, None

    def fetch(self, mode: int, filename: str | None, value: object, read: bool) -> object:
        if mode not in (MODE_RAW, MODE_BINARY):
            raise _ForeignValueError(f"diskcache mode {mode}")
        return super().fetch(mode, filename, value, read)


class DiskKVStore(KVStore):
    """Store in a folder, bounded by `size_limit` bytes, least recently used entries evicted.

    Several processes may open the same folder at once. `directory` defaults to
    `default_store_dir()`. Raises `StoreError` if the folder cannot be created or opened for
    writing; `put()` raises `StoreError` when the disk is full or read-only.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        size_limit: int = DEFAULT_DISK_BYTES,
        *,
        prefetch_ahead: int = DEFAULT_PREFETCH_AHEAD,
        timeout: float = 60.0,
    ) -> None:
        if size_limit <= 0:
            raise ValueError(f"size_limit must be > 0, got {size_limit}")
        self.directory = Path(directory) if directory is not None else default_store_dir()
        self.size_limit = int(size_limit)
        self._prefetch_ahead = prefetch_ahead
        self._pool = PrefetchPool()
        self._lock = threading.Lock()
        self._hits = self._misses = self._evictions = self._corrupt = 0
        with self._storage_errors("open the KV store"):
            self.directory.mkdir(parents=True, exist_ok=True)
            # cull_limit=0: set() never evicts by itself; put() evicts (and counts) itself.
            self._cache = diskcache.Cache(
                str(self.directory),
                timeout=timeout,
                disk=_BytesOnlyDisk,
                eviction_policy="least-recently-used",
                size_limit=self.size_limit,
                cull_limit=0,
            )
            self._records = DiskRecordLogs(self.directory / "records.db")

    @contextlib.contextmanager
    def _storage_errors(self, action: str) -> Iterator[None]:
        try:
            yield
        except _STORAGE_ERRORS as error:
            raise StoreError(f"cannot {action} in folder {self.directory}: {error}") from error

    def get(self, key: str, device: torch.device | str | None = None) -> LazyTensors | None:
        """Open the entry under `key`; tensors are read (and verified) on access.

        Returns None on a miss or when the entry is found corrupt on opening (it is then
        dropped and counted). Raises `StoreError` if the folder cannot be read.
        """
        validate_key(key)
        target = torch.device(device) if device is not None else None
        payload = self._open(key)
        header = None
        if payload is not None:
            try:
                header = read_header(payload, key)
            except CorruptEntryError as error:
                payload.close()
                self._drop_corrupt(key, payload.identity, error)
        with self._lock:
            if header is None:
                self._misses += 1
            else:
                self._hits += 1
        if payload is None or header is None:
            return None
        infos = {info.name: info for info in header.tensors}
        identity = payload.identity
        return LazyTensors(
            [info.name for info in header.tensors],
            lambda name: read_tensor(payload, infos[name], key, target),
            metadata=header.metadata,
            pool=self._pool,
            prefetch_ahead=self._prefetch_ahead,
            on_corrupt=lambda error: self._drop_corrupt(key, identity, error),
            on_close=payload.close,
        )

    def put(
        self, key: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
    ) -> None:
        """Write the entry (synchronously), then evict least recently used entries if needed."""
        validate_key(key)
        checked, user_metadata = validate_entry(tensors, metadata)
        data = encode_entry(key, checked, user_metadata)
        if len(data) > self.size_limit:
            raise StoreError(
                f"entry {key!r} is {len(data)} bytes, more than the size limit "
                f"{self.size_limit} of the KV store in {self.directory}"
            )
        with self._storage_errors(f"write entry {key!r} ({len(data)} bytes)"):
            self._cache.set(key, data, retry=True)
            evicted = self._evict_until_under_limit(keep=key)
        with self._lock:
            self._evictions += evicted

    def _evict_until_under_limit(self, keep: str) -> int:
        """Delete least recently used entries, one at a time, until the folder fits the limit.

        diskcache's own `cull()` removes entries in batches of 10, which in a store holding
        few large entries would drop nearly everything, the new entry included. So the LRU key
        is looked up in diskcache's index (its `Cache` table, ordered by `access_time` under
        the least-recently-used policy) and removed with the public `delete()`; if that lookup
        ever fails (a different diskcache version), the batch `cull()` is used instead.
        """
        evicted = 0
        while self._cache.volume() > self.size_limit:
            try:
                rows = self._cache._sql(  # noqa: SLF001 - see docstring
                    "SELECT key FROM Cache WHERE raw = 1 AND key != ? ORDER BY access_time LIMIT 1",
                    (keep,),
                ).fetchall()
            except (AttributeError, sqlite3.Error):
                return evicted + self._cache.cull(retry=True)
            if not rows:
                break
            evicted += int(self._cache.delete(rows[0][0], retry=True))
        return evicted

    def contains(self, key: str) -> bool:
        """Return True if the folder has an entry under `key` (not verified)."""
        validate_key(key)
        with self._storage_errors(f"look up {key!r}"):
            return key in self._cache

    def delete(self, key: str) -> bool:
        """Remove the entry under `key`; return True if there was one."""
        validate_key(key)
        with self._storage_errors(f"delete {key!r}"):
            return bool(self._cache.delete(key, retry=True))

    def metadata(self, key: str) -> dict[str, str] | None:
        """Return the caller's metadata of `key`, reading only the entry's header."""
        validate_key(key)
        payload = self._open(key)
        if payload is None:
            return None
        try:
            return read_header(payload, key).metadata
        except CorruptEntryError as error:
            self._drop_corrupt(key, payload.identity, error)
            return None
        finally:
            payload.close()

    def stats(self) -> StoreStats:
        """Return counters; `entries` and `bytes` cover every process's writes."""
        with self._storage_errors("read statistics"):
            entries, volume = len(self._cache), self._cache.volume()
        with self._lock:
            return StoreStats(
                entries=entries,
                bytes=volume,
                hits=self._hits,
                misses=self._misses,
                evictions=self._evictions,
                corrupt_dropped=self._corrupt,
                capacity_bytes=self.size_limit,
            )

    def clear(self) -> None:
        """Remove every entry (and every record log) from the folder."""
        with self._storage_errors("clear"):
            self._cache.clear(retry=True)
            self._records.clear()

    def append_records(self, log: str, records: Sequence[bytes]) -> None:
        """Append ``records`` to ``log`` in the folder, visible to every process."""
        with self._storage_errors("append to a record log"):
            self._records.append(log, records)

    def read_records(self, log: str, cursor: int = 0) -> tuple[list[bytes], int]:
        """Return the records of ``log`` after ``cursor`` and the new cursor."""
        with self._storage_errors("read a record log"):
            return self._records.read(log, cursor)

    def close(self) -> None:
        """Stop prefetch threads and close this process's database connections."""
        self._pool.close()
        self._cache.close()
        self._records.close()

    def _open(self, key: str) -> Payload | None:
        """Fetch the stored value of `key` as a `Payload`, or None (miss or foreign value)."""
        try:
            with self._storage_errors(f"read entry {key!r}"):
                value = self._cache.get(key, read=True, retry=True)
        except _ForeignValueError as error:
            self._drop_corrupt(key, None, CorruptEntryError(key, f"foreign value ({error})"))
            return None
        if value is None:
            return None
        if isinstance(value, (bytes, io.BufferedIOBase)):
            return Payload(value)
        self._drop_corrupt(key, None, CorruptEntryError(key, "foreign value"))
        return None

    def _drop_corrupt(self, key: str, identity: str | None, error: CorruptEntryError) -> None:
        """Count a corrupt entry and delete it, unless another process replaced it meanwhile."""
        with self._lock:
            self._corrupt += 1
        logger.warning("dropping a corrupt entry of the KV store in %s: %s", self.directory, error)
        try:
            with self._cache.transact(retry=True):
                current = self._identity_of(key) if identity is not None else None
                if identity is not None and current not in (identity, "foreign"):
                    return  # gone, or rewritten by another process since we read it
                self._cache.delete(key, retry=True)
        except _STORAGE_ERRORS as failure:
            logger.warning("could not drop corrupt entry %r: %s", key, failure)

    def _identity_of(self, key: str) -> str | None:
        """Return the identity of the value stored under `key` now, "foreign", or None."""
        try:
            value = self._cache.get(key, read=True, retry=True)
        except _ForeignValueError:
            return "foreign"
        if value is None:
            return None
        if not isinstance(value, (bytes, io.BufferedIOBase)):
            return "foreign"
        payload = Payload(value)
        payload.close()
        return payload.identity
