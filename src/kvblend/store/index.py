"""The diskcache index of a store folder: opened healthy, set aside when damaged, repaired.

A store folder's SQLite index (``cache.db``) can be damaged: truncated by a copy or a full disk,
overwritten by another program. A folder whose index cannot be read would otherwise leave the
disk tier off for good, so opening one sets the damaged index aside as ``cache.db.damaged``
(replacing an older one, kept for inspection) and starts a new index, which the store then
rebuilds from the entry files' own headers (`kvblend.store.disk.rebuild`): no intact entry is lost.
An index deleted or emptied to 0 bytes (any index with no entry at all) is lost the same way and
rebuilt when opened, whenever the last sweep was.

`repair()` does the same on demand and more: it drops index rows whose file is missing or whose
file name lies outside the folder, adopts or deletes value files no row names, and reads every
indexed entry whole (`rebuild.check_entries`), deleting the damaged ones. A value file
is written just before its row is committed, so a file younger than `ORPHAN_GRACE_S` may be an
entry another process is writing and is kept. Only names diskcache writes (``ab/cd/x.val``)
are ever considered: the ``records`` sub-folder and anything else in the folder is left alone.
Two rows naming one file never delete it while one of them still names it (`_row_names`).

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
import weakref
from collections.abc import Callable, Iterator
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
    files_adopted: int = 0  # whole entry files no row named, taken back into the index
    #: The index was lost (set aside, deleted or empty) and rebuilt from the entry files.
    index_rebuilt: bool = False
    #: The folder could not be written: nothing was changed, the counts below say what was found.
    read_only: bool = False
    index_damaged: bool = False  # found damaged and left (read-only); else it was set aside
    rows_broken: int = 0  # read-only: index rows without a valid file, left
    files_unindexed: int = 0  # read-only: value files no row names, left
    #: Indexed entries read whole (size, header, every tensor's checksum or MAC).
    entries_checked: int = 0
    #: Indexed entries found damaged: deleted (read-only: found and left).
    entries_damaged: int = 0
    damaged_bytes: int = 0
    #: Indexed entries signed with another store key (or none): checked by checksum, kept.
    other_key_entries: int = 0


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
) -> tuple[diskcache.Cache, float | None, bool]:
    """Open the folder's index; a damaged one is set aside and replaced by a new index.

    `disk` is the serializer class (default: the store's bytes-only one with `modes`). Returns
    the index, the time it was found lost (None: it has entries) and whether a damaged one was
    set aside. An index with no entry at all (damaged and set aside, deleted, emptied to 0
    bytes, or a new folder) is lost: the caller rebuilds it from the entry files
    (`kvblend.store.disk.rebuild`), so losing it never means computing every entry again. Raises
    `sqlite3.Error` or `OSError` when the folder cannot be used (read-only, locked, not a
    folder, a linked index).
    """
    settings["disk"] = disk if disk is not None else disk_class(modes)
    prepare_index_file(directory, modes)
    set_aside_at = None
    try:
        cache = _open_checked(directory, settings)
    except sqlite3.DatabaseError as error:
        if not is_damage(error):
            raise
        set_aside_at = set_aside_damaged_index(directory, error)
        prepare_index_file(directory, modes)
        cache = _open_checked(directory, settings)
    set_aside = set_aside_at is not None
    if cache._sql("SELECT 1 FROM Cache LIMIT 1").fetchall():  # noqa: SLF001
        return cache, None, set_aside
    return cache, set_aside_at if set_aside_at is not None else time.time(), set_aside


def _open_checked(directory: Path, settings: dict[str, object]) -> diskcache.Cache:
    cache = diskcache.Cache(str(directory), **settings)
    try:
        # diskcache has read its settings; the last rows are what a truncation cuts off, and
        # reaching them costs a few pages whatever the size of the index.
        cache._sql("SELECT MAX(rowid) FROM Cache").fetchall()  # noqa: SLF001
    except BaseException:
        cache.close()
        raise
    if hasattr(cache.disk, "still_named"):
        cache.disk.still_named = _row_names(cache)
        with contextlib.suppress(sqlite3.Error):  # a read-only index does without it
            cache._sql(  # noqa: SLF001 - keeps `still_named` a lookup, not a table scan
                "CREATE INDEX IF NOT EXISTS Cache_filename ON Cache(filename)"
            )
    return cache


def _row_names(cache: diskcache.Cache) -> Callable[[str], bool]:
    """Whether any row of `cache` names a file (held weakly: the index may be closed)."""
    reference = weakref.ref(cache)

    def still_named(filename: str) -> bool:
        index = reference()
        if index is None:
            return False
        rows = index._sql(  # noqa: SLF001 - the index's file names; no public API
            "SELECT 1 FROM Cache WHERE filename = ? LIMIT 1", (filename,)
        ).fetchall()
        return bool(rows)

    return still_named


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
        "KV store index in %s is damaged (%s): set aside as %s; a new one is rebuilt from "
        "the entry files",
        directory,
        error,
        DAMAGED_NAME,
    )
    return moment


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


def evict_until_under(cache: diskcache.Cache, size_limit: int, keep: str) -> int:
    """Delete least recently used entries, one at a time, until the folder fits `size_limit`.

    diskcache's own `cull()` removes entries in batches of 10, which in a store holding few
    large entries would drop nearly everything, the new entry `keep` included. So the LRU key
    is looked up in diskcache's index (its `Cache` table, ordered by `access_time` under the
    least-recently-used policy) and removed with the public `delete()`; if that lookup ever
    fails (a different diskcache version), the batch `cull()` is used instead. Returns how many
    entries were evicted.
    """
    evicted = 0
    while cache.volume() > size_limit:
        try:
            rows = cache._sql(  # noqa: SLF001 - see docstring
                "SELECT key FROM Cache WHERE raw = 1 AND key != ? ORDER BY access_time LIMIT 1",
                (keep,),
            ).fetchall()
        except (AttributeError, sqlite3.Error):
            return evicted + int(cache.cull(retry=True))
        if not rows:
            break
        evicted += int(cache.delete(rows[0][0], retry=True))
    return evicted
