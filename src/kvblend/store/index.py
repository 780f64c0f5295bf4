"""The diskcache index of a store folder: opened healthy, set aside when damaged, repaired.

A store folder's SQLite index (``cache.db``) can be damaged: truncated by a copy or a full disk,
overwritten by another program. A folder whose index cannot be read would otherwise leave the
disk tier off for good, so opening one sets the damaged index aside as ``cache.db.damaged``
(replacing an older one, kept for inspection) and starts a new, empty index. The value files
the old index named are then orphans, outside the size accounting: they are deleted.

`repair()` does the same on demand and more: it drops index rows whose file is missing or whose
file name lies outside the folder, and deletes value files no row names. A value file is
written just before its row is committed, so a file younger than `ORPHAN_GRACE_S` may be an
entry another process is writing and is kept. Only names diskcache writes (``ab/cd/x.val``)
are ever considered: the ``records`` sub-folder and anything else in the folder is left alone.

Setting an index aside happens under an exclusive lock on the folder (``flock``), after
checking again that the index still cannot be read, so that two processes finding the same
damage never set aside the index the first one has just rebuilt.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import diskcache

from kvblend.store.files import INDEX_NAME, FileModes, confined_path, disk_class, prepare_index_file

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no cross-process lock
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

#: Name a damaged index is set aside under.
DAMAGED_NAME = "cache.db.damaged"
#: Age below which a value file no index row names may still be an entry being written.
ORPHAN_GRACE_S = 60.0


@dataclass(frozen=True)
class RepairReport:
    """What `DiskKVStore.repair()` found and did."""

    index_set_aside: bool
    rows_dropped: int
    orphans_deleted: int
    orphan_bytes: int
    entries: int
    bytes: int


def is_damage(error: BaseException) -> bool:
    """Return True if `error` says the index file is damaged (not locked, read-only, full)."""
    return isinstance(error, sqlite3.DatabaseError) and not isinstance(
        error, sqlite3.OperationalError
    )


def index_identity(directory: Path) -> tuple[int, int] | None:
    """(device, inode) of the folder's index file now, None if it is missing."""
    try:
        info = os.stat(directory / INDEX_NAME)
    except OSError:
        return None
    return info.st_dev, info.st_ino


def open_index(
    directory: Path, modes: FileModes, disk: type[diskcache.Disk] | None = None, **settings: object
) -> tuple[diskcache.Cache, bool]:
    """Open the folder's index; a damaged one is set aside and replaced by a new index.

    `disk` is the serializer class (default: the store's bytes-only one with `modes`). Returns
    the index and whether a damaged one was set aside. Raises `sqlite3.Error` or `OSError` when
    the folder cannot be used (read-only, locked, not a folder).
    """
    settings["disk"] = disk if disk is not None else disk_class(modes)
    prepare_index_file(directory, modes)
    try:
        return _open_checked(directory, settings), False
    except sqlite3.DatabaseError as error:
        if not is_damage(error):
            raise
        damage = error
    set_aside_at = set_aside_damaged_index(directory, damage)
    prepare_index_file(directory, modes)
    cache = _open_checked(directory, settings)
    if set_aside_at is not None:
        collect_orphans(cache, directory, older_than=set_aside_at)
    return cache, set_aside_at is not None


def _open_checked(directory: Path, settings: dict[str, object]) -> diskcache.Cache:
    cache = diskcache.Cache(str(directory), **settings)
    try:
        # diskcache has read its settings; the last rows are what a truncation cuts off, and
        # reaching them costs a few pages whatever the size of the index.
        cache._sql("SELECT MAX(rowid) FROM Cache").fetchall()  # noqa: SLF001
    except BaseException:
        cache.close()
        raise
    return cache


@contextlib.contextmanager
def _folder_lock(directory: Path) -> Iterator[None]:
    if fcntl is None:
        yield
        return
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)  # releases the lock


def index_is_damaged(directory: Path) -> bool:
    """Check the whole index file (``PRAGMA quick_check``) on a connection of its own."""
    connection = sqlite3.connect(directory / INDEX_NAME, timeout=60)
    try:
        connection.execute("SELECT COUNT(*), SUM(size) FROM Cache").fetchall()
        return connection.execute("PRAGMA quick_check(1)").fetchall() != [("ok",)]
    except sqlite3.DatabaseError as error:
        return is_damage(error) or "no such table" not in str(error)
    finally:
        connection.close()


def set_aside_damaged_index(directory: Path, error: BaseException | str) -> float | None:
    """Rename a damaged index (with its WAL files) to ``cache.db.damaged``.

    Returns the time it was set aside, or None if, under the folder lock, the index turned out
    readable (another process rebuilt it meanwhile).
    """
    with _folder_lock(directory):
        if not index_is_damaged(directory):
            return None
        moment = time.time()
        for suffix in ("", "-wal", "-shm", "-journal"):
            source = directory / (INDEX_NAME + suffix)
            target = directory / (DAMAGED_NAME + suffix)
            with contextlib.suppress(FileNotFoundError):
                target.unlink()
            with contextlib.suppress(FileNotFoundError):
                source.rename(target)
    logger.warning(
        "KV store index in %s is damaged (%s): set aside as %s and rebuilt; its entries "
        "will be computed again",
        directory,
        error,
        DAMAGED_NAME,
    )
    return moment


def _value_files(directory: Path) -> Iterator[tuple[str, Path]]:
    """(index file name, path) of every file laid out the way diskcache writes values."""
    real = os.path.realpath(directory)
    for first in sorted(os.listdir(real)):
        if len(first) != 2 or not os.path.isdir(os.path.join(real, first)):
            continue
        for second in sorted(os.listdir(os.path.join(real, first))):
            folder = os.path.join(real, first, second)
            if not os.path.isdir(folder) or os.path.islink(folder):
                continue
            for name in os.listdir(folder):
                filename = os.path.join(first, second, name)
                full = confined_path(real, filename)
                if full is not None:
                    yield filename, Path(full)


def collect_orphans(cache: diskcache.Cache, directory: Path, older_than: float) -> tuple[int, int]:
    """Delete value files no index row names, last modified before `older_than`.

    Returns (files deleted, bytes freed).
    """
    named = {
        row[0]
        for row in cache._sql(  # noqa: SLF001 - the index's file names; no public API
            "SELECT filename FROM Cache WHERE filename IS NOT NULL"
        ).fetchall()
    }
    deleted = freed = 0
    for filename, path in _value_files(directory):
        if filename in named:
            continue
        try:
            info = path.stat()
            if info.st_mtime >= older_than:
                continue
            cache.disk.remove(filename)  # removes emptied sub-folders too
        except OSError:
            continue
        deleted += 1
        freed += info.st_size
    if deleted:
        logger.warning("deleted %d orphan files (%d bytes) from %s", deleted, freed, directory)
    return deleted, freed


def drop_broken_rows(cache: diskcache.Cache, directory: Path) -> int:
    """Delete index rows whose value file is missing or lies outside the folder."""
    real = os.path.realpath(directory)
    rows = cache._sql(  # noqa: SLF001 - the index's file names; no public API
        "SELECT rowid, filename FROM Cache WHERE filename IS NOT NULL"
    ).fetchall()
    dropped = 0
    for rowid, filename in rows:
        full = confined_path(real, filename)
        if full is not None and os.path.isfile(full):
            continue
        with cache.transact(retry=True):
            current = cache._sql(  # noqa: SLF001
                "SELECT filename FROM Cache WHERE rowid = ?", (rowid,)
            ).fetchall()
            if current and current[0][0] == filename:
                # diskcache's triggers keep its count and volume right
                cache._sql("DELETE FROM Cache WHERE rowid = ?", (rowid,))  # noqa: SLF001
                dropped += 1
    if dropped:
        logger.warning("dropped %d index rows without a valid file in %s", dropped, directory)
    return dropped
