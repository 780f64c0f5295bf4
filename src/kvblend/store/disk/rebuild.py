"""Rebuilding a disk store's index from its entry files, and sweeping what a killed writer left.

Every entry file names its own key in its header (`entry_format`), so an index that is lost
(set aside as damaged, deleted, emptied to 0 bytes) or that misses rows (a writer killed between
writing a file and committing its row) is rebuilt from the files instead of deleting them or
computing every entry again: each value file no row names is read up to its header; a whole
entry whose key has no row is adopted (a row naming it is inserted, access time = the file's
modification time, so least recently used eviction keeps its order), and so is one whose key's
row names another key's file or a missing or damaged one (the row is pointed at it). A file is
deleted only after its own header was read: when it is not a whole entry (partial, damaged) or
is a second copy of an entry its key's row holds, and only once older than the grace period
(another process may be writing it). Then the empty sub-folders a killed writer or an eviction
left behind are deleted.

Rows are inserted into diskcache's ``Cache`` table directly (no public API adopts a file); its
triggers keep the entry count and volume right. Only names diskcache writes (``ab/cd/x.val``),
inside the folder and not through a symbolic link, are ever opened or deleted.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sqlite3
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import diskcache
from diskcache.core import MODE_BINARY

from kvblend.store.base import CorruptEntryError, OtherStoreKeyError
from kvblend.store.entry_format import Payload, entry_key, read_header, verify_tensors
from kvblend.store.entry_mac import StoreKey
from kvblend.store.files import FileModes, ForeignValueError, confined_path, open_no_follow
from kvblend.store.index import ORPHAN_GRACE_S, RepairReport

logger = logging.getLogger(__name__)

#: File whose modification time is the last sweep of a folder.
SWEEP_STAMP = "swept"
#: Seconds between two sweeps of one folder, made when a store opens it.
SWEEP_INTERVAL_S = 600.0


@dataclass(frozen=True)
class Adoption:
    """What a rebuild or sweep did: files adopted into the index, files and folders deleted."""

    adopted: int = 0
    deleted: int = 0
    deleted_bytes: int = 0
    folders: int = 0


def value_files(directory: Path) -> Iterator[tuple[str, Path]]:
    """(index file name, path) of every file laid out the way diskcache writes values."""
    real = os.path.realpath(directory)
    for first in sorted(os.listdir(real)):
        top = os.path.join(real, first)
        if len(first) != 2 or os.path.islink(top) or not os.path.isdir(top):
            continue
        for second in sorted(os.listdir(top)):
            folder = os.path.join(top, second)
            if os.path.islink(folder) or not os.path.isdir(folder):
                continue
            for name in os.listdir(folder):
                filename = os.path.join(first, second, name)
                full = confined_path(real, filename)
                if full is not None:
                    yield filename, Path(full)


def _named(cache: diskcache.Cache) -> set[str]:
    rows = cache._sql("SELECT filename FROM Cache WHERE filename IS NOT NULL")  # noqa: SLF001
    return {row[0] for row in rows.fetchall()}


def _key_of(source: Path | bytes | io.BufferedIOBase) -> str | None:
    """Return the key of the whole, intact-looking entry a file (or an index blob) holds."""
    if isinstance(source, Path):
        try:
            source = open(source, "rb", opener=open_no_follow)  # noqa: SIM115 - Payload closes it
        except OSError:
            return None
    payload = Payload(source)
    try:
        return entry_key(payload)
    finally:
        payload.close()


def _row_holds_its_key(cache: diskcache.Cache, key: str) -> tuple[bool, object]:
    """Whether `key`'s row reads back as an entry of `key` (by the header), and the row."""
    row = cache._sql(  # noqa: SLF001 - the row's file; no public API
        "SELECT mode, filename, value FROM Cache WHERE key = ? AND raw = 1", (key,)
    ).fetchall()
    if not row:
        return False, None
    try:
        value = cache.disk.fetch(*row[0], True)
    except (ForeignValueError, OSError):
        return False, row[0]
    holds = isinstance(value, (bytes, io.BufferedIOBase)) and _key_of(value) == key
    return holds, row[0]


def _adopt(cache: diskcache.Cache, key: str, filename: str, info: os.stat_result) -> str:
    """Give `key` a row naming `filename`, unless `key`'s row already holds an entry of `key`.

    Returns "inserted" (`key` had no row), "repointed" (its row named another key's file, or a
    missing or damaged one: the row names `filename` now, and the file it named is left for its
    own key), "duplicate" (its row holds a whole entry of `key`: `filename` is a second copy)
    or "skipped" (the row changed while it was checked: left for a later sweep).
    """
    holds, row = _row_holds_its_key(cache, key)
    if holds:
        return "duplicate"
    with cache.transact(retry=True):
        sql = cache._sql  # noqa: SLF001 - no public API adopts an existing file
        now = sql("SELECT mode, filename, value FROM Cache WHERE key = ? AND raw = 1", (key,))
        current = now.fetchall()
        if (current[0] if current else None) != row:
            return "skipped"  # written meanwhile
        if current:
            sql(
                "UPDATE Cache SET store_time = ?, access_time = ?, size = ?, mode = ?,"
                " filename = ?, value = NULL WHERE key = ? AND raw = 1",
                (time.time(), info.st_mtime, info.st_size, MODE_BINARY, filename, key),
            )
            logger.warning("KV store index row %r named a wrong file; now %s", key, filename)
            return "repointed"
        sql(
            "INSERT INTO Cache(key, raw, store_time, expire_time, access_time, access_count,"
            " tag, size, mode, filename, value) VALUES (?, 1, ?, NULL, ?, 0, NULL, ?, ?, ?, NULL)",
            (key, time.time(), info.st_mtime, info.st_size, MODE_BINARY, filename),
        )
    return "inserted"


def adopt_files(cache: diskcache.Cache, directory: Path, older_than: float) -> Adoption:
    """Adopt or delete every value file no row names, last modified before `older_than`.

    Each file is read up to its header first: a whole entry is adopted under the key it names;
    a file is deleted only when it is not one (partial, damaged) or is a second copy of an entry
    its key's row holds, and only once older than `ORPHAN_GRACE_S` (another process may be
    writing it). Then empty value sub-folders last modified before `older_than` are deleted.
    Storage errors (a read-only folder) end the sweep early, logged, never raised.
    """
    adopted = deleted = freed = folders = 0
    delete_before = min(older_than, time.time() - ORPHAN_GRACE_S)
    try:
        for _ in range(2):  # a row pointed at its own file leaves the file it named to adopt
            named, repointed = _named(cache), 0
            for filename, path in value_files(directory):
                info = path.stat()
                if filename in named or info.st_mtime >= older_than:
                    continue  # indexed, or may be an entry another process is writing
                key = _key_of(path)  # the file's own header, read before anything is decided
                done = _adopt(cache, key, filename, info) if key is not None else "unusable"
                adopted += done in ("inserted", "repointed")
                repointed += done == "repointed"
                if done in ("unusable", "duplicate") and info.st_mtime < delete_before:
                    cache.disk.remove(filename)  # and its emptied sub-folders
                    deleted, freed = deleted + 1, freed + info.st_size
            if not repointed:
                break
        folders = _remove_empty_folders(directory, older_than)
    except (OSError, sqlite3.Error, diskcache.Timeout) as error:
        logger.warning("could not finish sweeping the KV store in %s: %s", directory, error)
    if adopted or deleted or folders:
        logger.warning(
            "KV store in %s: %d entry files taken back into the index, %d unusable files "
            "(%d bytes) and %d empty folders deleted",
            directory,
            adopted,
            deleted,
            freed,
            folders,
        )
    return Adoption(adopted, deleted, freed, folders)


@dataclass(frozen=True)
class EntryCheck:
    """What reading every indexed entry whole found: checked, damaged, of another key."""

    checked: int = 0
    damaged: int = 0  # dropped, unless the folder is read-only
    damaged_bytes: int = 0
    other_key: int = 0  # signed with another store key (or none): checked by checksum, kept


def check_entries(cache: Any, store_key: StoreKey | None, *, drop: bool) -> EntryCheck:  # noqa: ANN401
    """Read every entry the index names, whole, as a reader would; drop (`drop`) the damaged.

    Each entry's size, header (checksum, key, listing) and every tensor's checksum, or its MAC
    when `store_key` signed it, are checked (`entry_format.verify_tensors`, in pieces: memory
    stays small whatever the entry's size). An entry of another store key (or none) is checked
    by its checksums and kept. Nothing renews an entry's place in the eviction order. A damaged
    entry is deleted unless another process replaced it meanwhile (`delete_unless_replaced`).
    """
    rows = cache._sql(  # noqa: SLF001 - every row, without diskcache's access-time update
        "SELECT key, mode, filename, value, size FROM Cache WHERE raw = 1"
    ).fetchall()
    checked = damaged = damaged_bytes = other = 0
    problem: CorruptEntryError | OtherStoreKeyError | None
    for key, mode, filename, stored, size in rows:
        if not isinstance(key, str):
            continue
        try:
            value = cache.disk.fetch(mode, filename, stored, True)
        except ForeignValueError as error:
            value, problem = None, CorruptEntryError(key, f"foreign value ({error})")
        except OSError:
            continue  # gone meanwhile, or a row without a file: `drop_broken_rows`' business
        checked += 1
        identity = None
        if value is not None:
            if not isinstance(value, (bytes, io.BufferedIOBase)):
                problem = CorruptEntryError(key, "foreign value")
            else:
                payload = Payload(value)
                identity = payload.identity
                try:
                    problem = _entry_problem(payload, key, store_key)
                finally:
                    payload.close()
                if problem is None:
                    continue
                if isinstance(problem, OtherStoreKeyError):
                    other += 1
                    continue
        logger.warning("KV store in %s: %s", cache.directory, problem)
        damaged, damaged_bytes = damaged + 1, damaged_bytes + int(size or 0)
        if drop:
            delete_unless_replaced(cache, key, identity)
    return EntryCheck(checked, damaged, damaged_bytes, other)


def _entry_problem(
    payload: Payload, key: str, store_key: StoreKey | None
) -> CorruptEntryError | OtherStoreKeyError | None:
    """Return what is wrong with one entry read whole (None: nothing)."""
    try:
        try:
            header = read_header(payload, key, store_key)
        except OtherStoreKeyError as other:
            verify_tensors(payload, read_header(payload, key))  # damage is damage, any key's
            return other
        verify_tensors(payload, header)
    except CorruptEntryError as error:
        return error
    return None


def survey(cache: Any, directory: Path) -> RepairReport:
    """Report what `repair` would find in a folder it cannot change (read-only): change nothing.

    Checks the whole index (``PRAGMA quick_check``), counts rows whose file is missing or
    outside the folder and value files no row names.
    """
    damaged = cache._sql("PRAGMA quick_check(1)").fetchall() != [("ok",)]  # noqa: SLF001
    real = os.path.realpath(directory)
    named = _named(cache)
    paths = [confined_path(real, name) for name in named]
    broken = sum(1 for full in paths if full is None or not os.path.isfile(full))
    unindexed = sum(1 for filename, _ in value_files(directory) if filename not in named)
    return RepairReport(
        index_set_aside=False,
        rows_dropped=0,
        orphans_deleted=0,
        orphan_bytes=0,
        entries=len(cache),
        bytes=cache.volume(),
        read_only=True,
        index_damaged=damaged,
        rows_broken=broken,
        files_unindexed=unindexed,
    )


def _remove_empty_folders(directory: Path, older_than: float) -> int:
    real = os.path.realpath(directory)
    removed = 0
    for first in sorted(os.listdir(real)):
        top = os.path.join(real, first)
        if len(first) != 2 or os.path.islink(top) or not os.path.isdir(top):
            continue
        for second in os.listdir(top):
            folder = os.path.join(top, second)
            if len(second) != 2 or os.path.islink(folder) or not os.path.isdir(folder):
                continue
            if os.stat(folder).st_mtime < older_than and not os.listdir(folder):
                with contextlib.suppress(OSError):
                    os.rmdir(folder)
                    removed += 1
        with contextlib.suppress(OSError):
            os.rmdir(top)  # only when empty; a writer that needed it makes it again
            removed += 1
    return removed


def sweep_if_due(
    cache: diskcache.Cache, directory: Path, modes: FileModes, lost_at: float | None = None
) -> Adoption | None:
    """Sweep (`adopt_files`) at most every `SWEEP_INTERVAL_S`, when a store opens the folder.

    The time of the last sweep is the modification time of the folder's `SWEEP_STAMP` file.
    Files and folders younger than `ORPHAN_GRACE_S` are left for a later sweep. With
    `lost_at`, the time the index was found lost (set aside, deleted, empty), the sweep is due
    whatever the stamp says and adopts every whole entry file older than that moment.
    """
    now = time.time()
    stamped = _stamp(directory, modes, now, due=lost_at is not None)
    if lost_at is not None:
        return adopt_files(cache, directory, older_than=lost_at)
    return adopt_files(cache, directory, older_than=now - ORPHAN_GRACE_S) if stamped else None


def _stamp(directory: Path, modes: FileModes, now: float, *, due: bool) -> bool:
    """Set the sweep stamp to `now` if a sweep is `due` or the last is old enough: say if so."""
    stamp = os.path.join(os.path.realpath(directory), SWEEP_STAMP)
    try:
        if not due and now - os.stat(stamp, follow_symlinks=False).st_mtime < SWEEP_INTERVAL_S:
            return False
    except FileNotFoundError:
        pass
    except OSError:
        return False
    try:
        descriptor = open_no_follow(stamp, os.O_RDONLY | os.O_CREAT)
    except OSError as error:  # read-only folder: nothing could be cleaned anyway
        logger.debug("not sweeping the KV store in %s: %s", directory, error)
        return False
    try:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink > 1:  # never touch a file elsewhere
            logger.warning("not sweeping the KV store in %s: %s is a link", directory, SWEEP_STAMP)
            return False
        os.utime(descriptor, (now, now))
        with contextlib.suppress(OSError):
            os.fchmod(descriptor, modes.file)
    finally:
        os.close(descriptor)
    return True


def delete_unless_replaced(cache: diskcache.Cache, key: str, identity: str | None) -> None:
    """Delete `key`'s entry, unless the value under it now is not the one read (`identity`).

    A value another process wrote meanwhile is kept; a foreign one (kvblend did not write it)
    is deleted. `identity` None deletes whatever is there.
    """
    with cache.transact(retry=True):
        if identity is not None and _identity_of(cache, key) not in (identity, "foreign"):
            return  # gone, or rewritten by another process since it was read
        cache.delete(key, retry=True)


def _identity_of(cache: diskcache.Cache, key: str) -> str | None:
    """Return the identity of the value stored under `key` now, "foreign", or None."""
    try:
        value = cache.get(key, read=True, retry=True)
    except ForeignValueError:
        return "foreign"
    if value is None:
        return None
    if not isinstance(value, (bytes, io.BufferedIOBase)):
        return "foreign"
    payload = Payload(value)
    payload.close()
    return payload.identity
