"""`DiskKVStore`: entries as safetensors bytes in a `diskcache` folder shared by processes.

`diskcache.Cache` provides the index (SQLite), LRU eviction by size and safe concurrent use by
several processes. Values are always `bytes`, so diskcache keeps small entries as SQLite blobs and
writes large ones to files as they are; the serializer (`files.BytesOnlyDisk`) refuses anything
else, refuses to unpickle what another program may have left in the folder, and only opens or
deletes files inside the folder. Reads open the entry's file and parse only its header; tensors
are read one at a time by the lazy mapping `get()` returns, each checked against its checksum.

The folder is private to its owner unless opened as shared, and no file in it that is a link
(symbolic or hard) is written (`files`). An index found damaged, deleted or empty, on open or
later, is rebuilt from the entry files (`index`, `rebuild`), so the disk tier heals instead of
failing or recomputing everything. A folder that cannot be written is served read-only
(`readonly`); `repair()` then only reports.

Opening an entry does not count as using it: only a verified hit renews its place in the least
recently used order (diskcache's `get` would renew whatever it opens). So an entry signed with
another store key (`OtherStoreKeyError`), read here as a miss and left in place, ages as if
nobody read it: evicted first when the folder fills, and written over by this store once no
process of its own key has read it for `other_key_idle_s` seconds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import diskcache
import platformdirs
import torch

from kvblend.store.base import (
    CorruptEntryError,
    EntrySpec,
    KVStore,
    OtherStoreKeyError,
    StoreError,
    StoreStats,
    validate_entry,
    validate_key,
)
from kvblend.store.disk.readonly import ReadOnlyIndex, record_logs
from kvblend.store.disk.rebuild import (
    adopt_files,
    check_entries,
    delete_unless_replaced,
    survey,
    sweep_if_due,
)
from kvblend.store.entry_format import (
    Payload,
    check_expected,
    encode_entry,
    read_header,
)
from kvblend.store.entry_mac import OtherKeyWarnings, load_store_key
from kvblend.store.files import ForeignValueError, file_modes, looks_read_only, prepare_folder
from kvblend.store.index import (
    ORPHAN_GRACE_S,
    RepairReport,
    drop_broken_rows,
    evict_until_under,
    index_identity,
    index_is_damaged,
    is_damage,
    open_index,
    set_aside_damaged_index,
)
from kvblend.store.lazy import DEFAULT_PREFETCH_AHEAD, LazyTensors, PrefetchPool, lazy_entry
from kvblend.store.record_logs import DiskRecordLogs

logger = logging.getLogger(__name__)

#: Environment variable that overrides the default store folder.
STORE_DIR_ENV = "KVBLEND_STORE_DIR"
#: Default disk budget: 20 GiB, a few hundred thousand tokens of a 1-8B model's fp16 KV.
DEFAULT_DISK_BYTES = 20 << 30

_STORAGE_ERRORS = (OSError, sqlite3.Error, diskcache.Timeout)
#: Seconds between attempts at opening writable a folder opened read-only.
READ_ONLY_RETRY_S = 30.0
#: An entry of another store key nobody of that key has read for this long is written over.
OTHER_KEY_IDLE_S = 24 * 3600.0


@dataclasses.dataclass(frozen=True)
class _Stored:
    """An entry's value as opened, without renewing its place in the eviction order."""

    payload: Payload
    rowid: int
    access_time: float


def default_store_dir() -> Path:
    """Return `$KVBLEND_STORE_DIR`, or the user cache folder + ``kvblend/kv``."""
    override = os.environ.get(STORE_DIR_ENV)
    if override:
        return Path(override).expanduser()
    return Path(platformdirs.user_cache_dir("kvblend")) / "kv"


class DiskKVStore(KVStore):
    """Store in a folder, bounded by `size_limit` bytes, least recently used entries evicted.

    Several processes may open the same folder at once. `directory` defaults to
    `default_store_dir()`. The folder is private (``0700``, files ``0600``) unless `shared` is
    True (group access, ``0770``/``0660``); `shared=None` reads ``$KVBLEND_STORE_SHARED``.
    `store_key` (default ``$KVBLEND_STORE_KEY``) makes entries carry a keyed MAC and refuses
    those without a valid one (`kvblend.store.entry_mac`); an entry of another key is a miss
    left in place (`OtherStoreKeyError`), and `put()` writes over it only once nobody of its
    key has read it for `other_key_idle_s` seconds (default one day). Raises `StoreError` if
    the folder cannot be created or opened (a folder that can only be read opens `read_only`);
    `put()` raises `StoreError` when the disk is full or read-only.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        size_limit: int = DEFAULT_DISK_BYTES,
        *,
        prefetch_ahead: int = DEFAULT_PREFETCH_AHEAD,
        timeout: float = 60.0,
        shared: bool | None = None,
        store_key: str | None = None,
        other_key_idle_s: float = OTHER_KEY_IDLE_S,
    ) -> None:
        if size_limit <= 0:
            raise ValueError(f"size_limit must be > 0, got {size_limit}")
        self._store_key = load_store_key(store_key)
        self.other_key_idle_s = float(other_key_idle_s)
        self.directory = Path(directory) if directory is not None else default_store_dir()
        self._other_key = OtherKeyWarnings(f"the KV store in {self.directory}")
        self.size_limit = int(size_limit)
        self.modes = file_modes(shared)
        self._prefetch_ahead = prefetch_ahead
        self._timeout = timeout
        self._pool = PrefetchPool()
        self._lock = threading.Lock()
        self._reopen_lock = threading.Lock()
        self._damaged = False
        self._set_aside = self._rebuilt_files = 0
        self._hits = self._misses = self._evictions = self._corrupt = 0
        self.read_only = False
        self._writable_retry_at = 0.0
        with self._storage_errors("open the KV store"):
            prepare_folder(self.directory, self.modes)
            try:
                self._cache, self._identity = self._open_index()
            except _STORAGE_ERRORS as error:
                self._cache, self._identity = self._open_read_only(error)
            self._records = record_logs(self.directory, self.modes, self.read_only)

    def _open_read_only(self, error: BaseException) -> tuple[ReadOnlyIndex, tuple[int, int] | None]:
        """Open the index read-only after `error` said the disk cannot be written (else raise)."""
        if not looks_read_only(error) or index_identity(self.directory) is None:
            raise error
        cache = ReadOnlyIndex(self.directory, self.modes)
        logger.warning(
            "KV store in %s opened read-only (%s): its entries are read, writes fail, and "
            "opening it writable is tried again every %g s",
            self.directory,
            error,
            READ_ONLY_RETRY_S,
        )
        self.read_only = True
        self._writable_retry_at = time.monotonic() + READ_ONLY_RETRY_S
        return cache, index_identity(self.directory)

    def _open_index(self) -> tuple[diskcache.Cache, tuple[int, int] | None]:
        # cull_limit=0: set() never evicts by itself; put() evicts (and counts) itself.
        cache, lost_at, set_aside = open_index(
            self.directory,
            self.modes,
            timeout=self._timeout,
            eviction_policy="least-recently-used",
            size_limit=self.size_limit,
            cull_limit=0,
        )
        self._set_aside += set_aside
        # what a killed writer left; a lost index (damaged, deleted, empty): rebuilt, not wiped
        swept = sweep_if_due(cache, self.directory, self.modes, lost_at)
        if lost_at is not None and swept is not None:
            self._rebuilt_files += swept.adopted
        return cache, index_identity(self.directory)

    def _index(self) -> diskcache.Cache:
        """Return the open index, reopened first if found damaged or replaced by another process."""
        if self.read_only and time.monotonic() >= self._writable_retry_at:
            self._try_writable()
        if not self._damaged and index_identity(self.directory) == self._identity:
            return self._cache
        with self._reopen_lock:
            if self._damaged or index_identity(self.directory) != self._identity:
                old = self._cache
                prepare_folder(self.directory, self.modes)  # it may have been deleted
                self._cache, self._identity = self._open_index()
                self._damaged = False
                with contextlib.suppress(*_STORAGE_ERRORS):
                    old.close()
        return self._cache

    def _try_writable(self) -> None:
        """Open a read-only folder writable again, if its disk allows it now."""
        with self._reopen_lock:
            if not self.read_only or time.monotonic() < self._writable_retry_at:
                return
            self._writable_retry_at = time.monotonic() + READ_ONLY_RETRY_S
            try:
                cache, identity = self._open_index()
            except _STORAGE_ERRORS as error:
                logger.debug("KV store in %s still read-only: %s", self.directory, error)
                return
            old, self._cache, self._identity, self.read_only = self._cache, cache, identity, False
            old.close()
        logger.warning("KV store in %s is writable again", self.directory)

    @contextlib.contextmanager
    def _storage_errors(self, action: str) -> Iterator[None]:
        try:
            yield
        except _STORAGE_ERRORS as error:
            if is_damage(error):
                self._damaged = True  # the next call sets the index aside and rebuilds it
            raise StoreError(f"cannot {action} in folder {self.directory}: {error}") from error

    def get(
        self,
        key: str,
        device: torch.device | str | None = None,
        *,
        expect: EntrySpec | None = None,
    ) -> LazyTensors | None:
        """Open the entry under `key`; tensors are read (and verified) on access.

        Returns None on a miss or when the entry is found corrupt on opening, or not as
        `expect` describes it (it is then dropped and counted). Raises `StoreError` if the
        folder cannot be read.
        """
        validate_key(key)
        target = torch.device(device) if device is not None else None
        stored = self._open(key)
        header = None
        if stored is not None:
            payload = stored.payload
            try:
                header = read_header(payload, key, self._store_key)
                check_expected(header, expect)
            except CorruptEntryError as error:
                header = None  # a miss, counted as one: never a mapping over a closed file
                payload.close()
                self._drop_corrupt(key, payload.identity, error)
            except OtherStoreKeyError as error:
                header = None  # another key's: a miss, left in place and not renewed
                payload.close()
                self._other_key.found(error)
        with self._lock:
            if header is None:
                self._misses += 1
            else:
                self._hits += 1
        if stored is None or header is None:
            return None
        self._touch(stored.rowid)
        payload = stored.payload
        identity = payload.identity
        return lazy_entry(
            payload,
            header,
            key,
            target,
            pool=self._pool,
            prefetch_ahead=self._prefetch_ahead,
            on_corrupt=lambda error: self._drop_corrupt(key, identity, error),
            finite=expect is not None and expect.finite,
        )

    def put(
        self, key: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
    ) -> None:
        """Write the entry (synchronously), then evict least recently used entries if needed."""
        validate_key(key)
        checked, user_metadata = validate_entry(tensors, metadata)
        data = encode_entry(key, checked, user_metadata, self._store_key)
        if self._store_key is not None:
            self._refuse_other_key(key)
        if len(data) > self.size_limit:
            raise StoreError(
                f"entry {key!r} is {len(data)} bytes, more than the size limit "
                f"{self.size_limit} of the KV store in {self.directory}"
            )
        with self._storage_errors(f"write entry {key!r} ({len(data)} bytes)"):
            cache = self._index()
            cache.set(key, data, retry=True)
            evicted = evict_until_under(cache, self.size_limit, keep=key)
        with self._lock:
            self._evictions += evicted

    def _refuse_other_key(self, key: str) -> None:
        """Raise `OtherStoreKeyError` if `key` holds another key's entry still in use.

        In use: read by a process of its key (or one without a key) within `other_key_idle_s`
        seconds; an idle one is written over (logged).
        """
        stored = self._open(key)
        if stored is None:
            return
        try:
            read_header(stored.payload, key, self._store_key)
        except OtherStoreKeyError as error:
            if error.replaceable:
                return
            idle = time.time() - stored.access_time
            if idle >= self.other_key_idle_s:
                logger.info("writing over %s: unread for %.0f s by its key", error, idle)
                return
            self._other_key.found(error)
            raise OtherStoreKeyError(
                key, f"not written: {error.reason} and read by it {idle:.0f} s ago"
            ) from None
        except CorruptEntryError:
            return  # written over
        finally:
            stored.payload.close()

    def contains(self, key: str) -> bool:
        """Return True if the folder has an entry under `key` (not verified)."""
        validate_key(key)
        with self._storage_errors(f"look up {key!r}"):
            return key in self._index()

    def delete(self, key: str) -> bool:
        """Remove the entry under `key`; return True if there was one."""
        validate_key(key)
        with self._storage_errors(f"delete {key!r}"):
            return bool(self._index().delete(key, retry=True))

    def keys(self) -> list[str]:
        """Return the keys of every entry in the folder's index (every process's writes)."""
        with self._storage_errors("list the entries"):
            rows = self._index()._sql("SELECT key FROM Cache WHERE raw = 1").fetchall()  # noqa: SLF001
        return [key for (key,) in rows if isinstance(key, str)]

    def metadata(self, key: str) -> dict[str, str] | None:
        """Return the caller's metadata of `key`, reading only the entry's header."""
        validate_key(key)
        stored = self._open(key)
        if stored is None:
            return None
        payload = stored.payload
        try:
            return read_header(payload, key, self._store_key).metadata
        except CorruptEntryError as error:
            self._drop_corrupt(key, payload.identity, error)
            return None
        except OtherStoreKeyError as error:
            self._other_key.found(error)
            return None
        finally:
            payload.close()

    def stats(self) -> StoreStats:
        """Return counters; `entries` and `bytes` cover every process's writes."""
        with self._storage_errors("read statistics"):
            cache = self._index()
            entries, volume = len(cache), cache.volume()
        with self._lock:
            return StoreStats(
                entries=entries,
                bytes=volume,
                hits=self._hits,
                misses=self._misses,
                evictions=self._evictions,
                corrupt_dropped=self._corrupt,
                capacity_bytes=self.size_limit,
                read_only=self.read_only,
                other_key=self._other_key.count,
            )

    def clear(self) -> None:
        """Remove every entry (and every record log) from the folder."""
        with self._storage_errors("clear"):
            self._index().clear(retry=True)
            self._records.clear()

    def clear_other_keys(self) -> int:
        """Delete every entry this store cannot verify: of another store key, or of none.

        Needs the store key (``$KVBLEND_STORE_KEY``; `ValueError` without one): the entries it
        signed, and damaged ones (left to `repair`), are kept. Returns how many were deleted.
        What a store whose key changed for good does at once; otherwise such entries age out
        by themselves (docs/store.md, "Entry authentication").
        """
        if self._store_key is None:
            raise ValueError(
                "no store key: set $KVBLEND_STORE_KEY to the key whose entries to keep"
            )
        deleted = 0
        for key in self.keys():
            stored = self._open(key)
            if stored is None:
                continue
            try:
                read_header(stored.payload, key, self._store_key)
            except OtherStoreKeyError:
                with self._storage_errors(f"delete {key!r}"):
                    delete_unless_replaced(self._index(), key, stored.payload.identity)
                deleted += 1
            except CorruptEntryError:
                pass  # damage: `repair` reports and deletes it
            finally:
                stored.payload.close()
        return deleted

    def repair(self) -> RepairReport:
        """Check the folder and fix what can be fixed; safe while other processes use it.

        Sets a damaged index aside (a new one is started and rebuilt from the entry files; see
        `kvblend.store.disk.rebuild`), drops index rows whose file is missing or lies outside the
        folder, takes whole entry files no row names back into the index and deletes the other
        value files no row names (unless younger than `ORPHAN_GRACE_S`: they may be entries
        being written). Then every indexed entry is read whole, as a reader would (size,
        header, every tensor's checksum, or MAC under this store's key), and a damaged one is
        deleted (`rebuild.check_entries`); entries of another store key are checked by their
        checksums and kept. On a `read_only` store nothing is changed: the report says what
        was found (`RepairReport.read_only`). Raises `StoreError` if the folder cannot be used.
        """
        if self.read_only:
            with self._storage_errors("check the KV store"):
                found = survey(self._cache, self.directory)
                checked = check_entries(self._cache, self._store_key, drop=False)
            return dataclasses.replace(
                found,
                entries_checked=checked.checked,
                entries_damaged=checked.damaged,
                damaged_bytes=checked.damaged_bytes,
                other_key_entries=checked.other_key,
            )
        with self._storage_errors("repair the KV store"):
            moment = None
            with self._reopen_lock:
                if index_is_damaged(self.directory):
                    moment = set_aside_damaged_index(self.directory, "found by repair")
                    self._damaged = True
            cache = self._index()
            dropped = drop_broken_rows(cache, self.directory)
            older_than = moment if moment is not None else time.time() - ORPHAN_GRACE_S
            swept = adopt_files(cache, self.directory, older_than)
            checked = check_entries(cache, self._store_key, drop=True)
            entries, volume = len(cache), cache.volume()
        return RepairReport(
            index_set_aside=self._set_aside > 0 or moment is not None,
            rows_dropped=dropped,
            orphans_deleted=swept.deleted,
            orphan_bytes=swept.deleted_bytes,
            entries=entries,
            bytes=volume,
            files_adopted=swept.adopted + self._rebuilt_files,
            index_rebuilt=self._rebuilt_files > 0,
            entries_checked=checked.checked,
            entries_damaged=checked.damaged,
            damaged_bytes=checked.damaged_bytes,
            other_key_entries=checked.other_key,
        )

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
        if isinstance(self._records, DiskRecordLogs):
            self._records.close()

    def _open(self, key: str) -> _Stored | None:
        """Open the stored value of `key`, or None (a miss, a foreign value, gone meanwhile).

        Reads the index row and opens its value as diskcache's `get` does, but changes
        nothing: a verified hit renews the entry's place in the eviction order (`_touch`).
        """
        try:
            with self._storage_errors(f"read entry {key!r}"):
                cache = self._index()
                rows = cache._sql(  # noqa: SLF001 - a read that leaves the access time alone
                    "SELECT rowid, access_time, mode, filename, value FROM Cache WHERE key = ? "
                    "AND raw = 1 AND (expire_time IS NULL OR expire_time > ?)",
                    (key, time.time()),
                ).fetchall()
                if not rows:
                    return None
                rowid, access_time, mode, filename, stored = rows[0]
                try:
                    value = cache.disk.fetch(mode, filename, stored, True)
                except OSError:  # deleted meanwhile (as diskcache's own get reads it: a miss)
                    return None
        except ForeignValueError as error:
            self._drop_corrupt(key, None, CorruptEntryError(key, f"foreign value ({error})"))
            return None
        if isinstance(value, (bytes, io.BufferedIOBase)):
            return _Stored(Payload(value), int(rowid), float(access_time or 0.0))
        self._drop_corrupt(key, None, CorruptEntryError(key, "foreign value"))
        return None

    def _touch(self, rowid: int) -> None:
        """Renew a verified hit's place in the least recently used order (never fails a read)."""
        try:
            self._index()._sql(  # noqa: SLF001 - what diskcache's get does on a hit
                "UPDATE Cache SET access_time = ? WHERE rowid = ?", (time.time(), rowid)
            )
        except (*_STORAGE_ERRORS, StoreError) as error:  # read-only, locked: the read stands
            logger.debug("could not renew entry %d in %s: %s", rowid, self.directory, error)

    def _drop_corrupt(self, key: str, identity: str | None, error: CorruptEntryError) -> None:
        """Count a corrupt entry and delete it, unless another process replaced it meanwhile."""
        with self._lock:
            self._corrupt += 1
        logger.warning("dropping a corrupt entry of the KV store in %s: %s", self.directory, error)
        try:
            delete_unless_replaced(self._index(), key, identity)
        except _STORAGE_ERRORS as failure:
            logger.warning("could not drop corrupt entry %r: %s", key, failure)
