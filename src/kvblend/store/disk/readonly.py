"""A disk store's index opened read-only: a folder on a read-only or full disk still serves.

diskcache writes to its index as it opens it (settings, tables), so a folder whose disk is
read-only (or full, or whose files the process may only read) cannot be opened by diskcache at
all. `ReadOnlyIndex` reads the same SQLite index with SQLite's read-only modes and serves the
calls a reader makes (`get`, ``in``, `len`, `volume`) with diskcache's own row layout and the
store's bytes-only serializer; every write raises `sqlite3.OperationalError` ("attempt to
write a readonly database"), which the disk store reports as a failed write like any other.
The folder's record logs open read-only the same way (`DiskRecordLogs`); only when there are
none to read there (or their folder or files are symbolic links, never followed) are they kept
in memory instead (`record_logs`).
"""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path
from typing import Any

from kvblend.store.files import (
    INDEX_NAME,
    SQLITE_SUFFIXES,
    FileModes,
    disk_class,
    refuse_links,
)
from kvblend.store.record_logs import DiskRecordLogs, MemoryRecordLogs

logger = logging.getLogger(__name__)

__all__ = ["RECORDS_NAME", "ReadOnlyIndex", "record_logs"]

#: The record logs' sub-folder in a store folder, and the files SQLite keeps there.
RECORDS_NAME = "records"
RECORDS_FILES = tuple(DiskRecordLogs.FILE_NAME + suffix for suffix in SQLITE_SUFFIXES)
_STORAGE_ERRORS = (OSError, sqlite3.Error)


def _refuse(*args: object, **kwargs: object) -> Any:
    raise sqlite3.OperationalError("attempt to write a readonly database (opened read-only)")


class ReadOnlyIndex:
    """The calls of `diskcache.Cache` a disk store's readers make, over a read-only index.

    Opened with ``mode=ro`` (which needs the ``-shm`` file), else ``immutable=1`` (no locks;
    for a folder where nothing can be created). Raises `sqlite3.Error` if neither can read it.
    """

    directory: str

    def __init__(self, directory: Path, modes: FileModes) -> None:
        self.directory = str(directory)
        path = (Path(directory) / INDEX_NAME).resolve().as_uri()
        last: sqlite3.Error | None = None
        for options in ("mode=ro", "immutable=1"):
            try:
                connection = sqlite3.connect(
                    f"{path}?{options}", uri=True, timeout=60, check_same_thread=False
                )
                connection.execute("SELECT MAX(rowid) FROM Cache").fetchall()
            except sqlite3.Error as error:
                last = error
                continue
            self._connection = connection
            self.disk = disk_class(modes)(self.directory)
            return
        assert last is not None
        raise last

    set = delete = clear = cull = transact = _refuse

    def get(self, key: str, default: object = None, read: bool = False, **_: object) -> object:
        """Return the value of `key` (a file handle with `read`), or `default`."""
        rows = self._connection.execute(
            "SELECT mode, filename, value FROM Cache WHERE key = ? AND raw = 1", (key,)
        ).fetchall()
        if not rows:
            return default
        mode, filename, value = rows[0]
        return self.disk.fetch(mode, filename, value, read)

    def __contains__(self, key: object) -> bool:
        rows = self._connection.execute(
            "SELECT 1 FROM Cache WHERE key = ? AND raw = 1", (key,)
        ).fetchall()
        return bool(rows)

    def __len__(self) -> int:
        return int(self._connection.execute("SELECT COUNT(*) FROM Cache").fetchone()[0])

    def volume(self) -> int:
        """Bytes of the index file plus the entries' sizes, as diskcache counts them."""
        pages = self._connection.execute("PRAGMA page_count").fetchone()[0]
        page_size = self._connection.execute("PRAGMA page_size").fetchone()[0]
        total = self._connection.execute("SELECT COALESCE(SUM(size), 0) FROM Cache").fetchone()
        return int(pages) * int(page_size) + int(total[0])

    def _sql(self, statement: str, parameters: tuple[Any, ...] = ()) -> sqlite3.Cursor:
        if not statement.lstrip().upper().startswith(("SELECT", "PRAGMA QUICK_CHECK")):
            _refuse()
        return self._connection.execute(statement, parameters)

    def close(self) -> None:
        """Close the connection."""
        self._connection.close()


def record_logs(
    directory: Path, modes: FileModes, read_only: bool
) -> DiskRecordLogs | MemoryRecordLogs:
    """Open a store folder's record logs: in its ``records`` sub-folder, else in memory.

    In memory (one warning) when ``records`` or a file SQLite keeps in it is a symbolic link,
    or, for a folder opened read-only, when they cannot be opened; else errors are raised.
    """
    try:
        refuse_links(directory, RECORDS_NAME)
        refuse_links(directory / RECORDS_NAME, *RECORDS_FILES)
    except OSError as error:  # never create tables where a link points
        logger.warning("KV store record logs kept in memory: %s", error)
        return MemoryRecordLogs()
    try:
        return DiskRecordLogs(directory / RECORDS_NAME, modes=modes)
    except _STORAGE_ERRORS as error:
        if not read_only:
            raise
        logger.warning(
            "KV store record logs in %s unreadable, kept in memory: %s", directory, error
        )
        return MemoryRecordLogs()
