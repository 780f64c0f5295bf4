"""Record logs: small append-only byte records that every process sharing a store can read.

The engine keeps its registry of known documents (which texts have KV in the store) as records
in a log named after the model and document context, so a process that never precomputed a
document finds it in prompts, and a restart over the same store forgets nothing. The store only
sees opaque bytes; what a record means is the engine's business.

Records carry increasing sequence numbers. `read(log, cursor)` returns the records after
`cursor` (the sequence number of the last record the caller has seen; 0 for the start) and the
new cursor, so a reader fetches only what was appended since it last looked. Logs are bounded: past
``max_records`` the oldest records are dropped, and a reader that falls behind simply resumes
from the oldest record still kept.

- `MemoryRecordLogs`: the process's own logs (memory-only stores);
- `DiskRecordLogs`: logs in an SQLite file in the store folder (WAL mode, as diskcache uses),
  shared by every process that opens it; a read is one indexed range query, so a new process
  loads a 100,000-document registry in a fraction of a second. Records are stored as blobs:
  nothing is pickled. A folder that cannot be written (a read-only or full disk, files the
  process may only read) is opened read-only: its records are read, appends fail. The folder
  and SQLite's files in it are never followed through a symbolic link.
"""

from __future__ import annotations

import logging
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from kvblend.store.files import (
    PRIVATE,
    SQLITE_SUFFIXES,
    FileModes,
    looks_read_only,
    prepare_folder,
    refuse_links,
    set_mode,
)
from kvblend.store.index import is_damage

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

__all__ = ["DEFAULT_MAX_RECORDS", "DiskRecordLogs", "MemoryRecordLogs", "validate_log_name"]

#: Records kept per log before the oldest are dropped.
DEFAULT_MAX_RECORDS = 1_000_000
_MAX_RECORD_BYTES = 4096
#: While a record log is read-only, opening it writable is tried again this often (seconds).
WRITABLE_RETRY_S = 60.0
_LOG_NAME_CHARS = frozenset("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_.-")


def validate_log_name(log: object) -> str:
    """Return ``log`` if it is a valid log name (1-100 characters of [0-9A-Za-z_.-])."""
    if not isinstance(log, str) or not 0 < len(log) <= 100 or not set(log) <= _LOG_NAME_CHARS:
        raise ValueError(f"invalid record log name {log!r}: use 1-100 characters of [0-9A-Za-z_.-]")
    return log


def _validate_records(records: Sequence[bytes]) -> list[bytes]:
    checked = []
    for record in records:
        if not isinstance(record, bytes) or not 0 < len(record) <= _MAX_RECORD_BYTES:
            raise ValueError(f"a record must be 1 to {_MAX_RECORD_BYTES} bytes")
        checked.append(record)
    return checked


class MemoryRecordLogs:
    """Record logs kept in this process's memory."""

    def __init__(self, max_records: int = DEFAULT_MAX_RECORDS) -> None:
        self.max_records = max_records
        self._logs: dict[str, tuple[int, list[bytes]]] = {}  # name -> (first seq, records)
        self._lock = threading.Lock()

    def append(self, log: str, records: Sequence[bytes]) -> None:
        """Append ``records`` to ``log``."""
        validate_log_name(log)
        checked = _validate_records(records)
        with self._lock:
            first, kept = self._logs.get(log, (1, []))
            kept.extend(checked)
            excess = len(kept) - self.max_records
            if excess > 0:
                del kept[:excess]
                first += excess
            self._logs[log] = (first, kept)

    def read(self, log: str, cursor: int = 0) -> tuple[list[bytes], int]:
        """Return the records of ``log`` after sequence number ``cursor``, and the last one's."""
        validate_log_name(log)
        with self._lock:
            first, kept = self._logs.get(log, (1, []))
            last = first + len(kept) - 1
            start = first if cursor > last else max(cursor + 1, first)  # a cleared log restarts
            return kept[start - first :], last

    def clear(self) -> None:
        """Drop every log."""
        with self._lock:
            self._logs.clear()


class DiskRecordLogs:
    """Record logs in an SQLite file inside the store folder, shared by processes.

    One table holds every log's records under a global, increasing sequence number, so a
    reader's cursor is the last number it has seen and a read is one indexed range query. The
    sub-folder and file get the store's `modes` (SQLite gives its ``-wal``/``-shm`` files the
    database file's mode); a damaged file (found when opening it or later) is set aside as
    ``records.db.damaged`` and a new, empty one is started: records only help find documents,
    and their reader rebuilds them from the store's entries (`kvblend.documents.registry`). A reader
    whose cursor is past every sequence number the file ever gave (the file was replaced) reads
    the log from its start again, and learns so from the cursor going back; a new file numbers
    its records from a random point, so an old cursor never lands inside its sequence.

    When the folder cannot be written (`kvblend.store.files.looks_read_only`), an existing file
    is opened read-only (`read_only`: SQLite's ``mode=ro``, else ``immutable=1``): reads serve
    its records, appends raise `sqlite3.OperationalError`, and opening it writable is tried
    again on an append, at most every `WRITABLE_RETRY_S` seconds. The sub-folder, or one of
    SQLite's files in it, being a symbolic link raises `OSError` (``ELOOP``): never followed.
    """

    _TRIM_EVERY = 1024
    FILE_NAME = "records.db"

    def __init__(
        self,
        directory: str | Path,
        max_records: int = DEFAULT_MAX_RECORDS,
        *,
        modes: FileModes = PRIVATE,
    ) -> None:
        self.directory = Path(directory)
        self.path = self.directory / self.FILE_NAME
        self.max_records = max_records
        self.modes = modes
        self._local = threading.local()
        self._appended = 0
        self._inode = -1
        #: Whether the file is open read-only (the folder could not be written).
        self.read_only = False
        self._writable_retry_at = 0.0
        try:
            prepare_folder(self.directory, modes)
            self._create()
        except (OSError, sqlite3.Error) as error:
            if isinstance(error, sqlite3.DatabaseError) and is_damage(error):
                self._start_anew(error)
            elif looks_read_only(error) and self.path.is_file():
                self._open_read_only(error)
            else:
                raise

    def _refuse_links(self) -> None:
        """Raise `OSError` if the folder or a file SQLite keeps in it is a symbolic link."""
        refuse_links(self.directory.parent, self.directory.name)
        refuse_links(self.directory, *(self.FILE_NAME + suffix for suffix in SQLITE_SUFFIXES))

    def _open_read_only(self, error: BaseException) -> None:
        """Serve the existing file read-only, after ``error`` said the folder cannot be written."""
        self.close()
        self.read_only = True
        self._writable_retry_at = time.monotonic() + WRITABLE_RETRY_S
        self._open()
        logger.warning(
            "record log %s opened read-only (%s): its records are read, appends fail",
            self.path,
            error,
        )

    def _try_writable(self) -> bool:
        """Open a read-only file writable again if the folder allows it now (at most so often)."""
        if time.monotonic() < self._writable_retry_at:
            return False
        self._writable_retry_at = time.monotonic() + WRITABLE_RETRY_S
        self.read_only = False
        try:
            self._create()
        except (OSError, sqlite3.Error) as error:
            logger.debug("record log %s still read-only: %s", self.path, error)
            self.read_only = True
            self.close()
            return False
        logger.warning("record log %s is writable again", self.path)
        return True

    def _start_anew(self, error: BaseException) -> None:
        """Set the damaged file aside and start an empty one.

        When another process has already replaced the file this one found damaged, the new file
        is opened instead: it is not set aside a second time.
        """
        opened = getattr(self._local, "inode", self._inode)
        self.close()
        replaced = self._file_inode() != opened
        if replaced:
            self._create()
            return
        logger.warning("record log %s is damaged (%s): set aside, starting anew", self.path, error)
        for suffix in ("", "-wal", "-shm"):
            damaged = Path(f"{self.path}{suffix}")
            if damaged.exists():
                os.replace(damaged, f"{self.path}.damaged{suffix}")
        self._create()

    def _healing(self, operation: Callable[[], _T]) -> _T:
        """Run ``operation``; if it finds the file damaged, start anew and run it once more.

        A read-only file found damaged is left as it is (the error is raised).
        """
        try:
            return operation()
        except sqlite3.DatabaseError as error:
            if self.read_only or not is_damage(error):
                raise
            self._start_anew(error)
            return operation()

    def _create(self) -> None:
        self.close()
        self._refuse_links()
        prepare_folder(self.directory, self.modes)  # it may have been deleted
        self._refuse_links()  # nothing SQLite opens is reached through a link
        descriptor = os.open(self.path, os.O_RDONLY | os.O_CREAT, self.modes.file)
        self._inode = os.fstat(descriptor).st_ino
        os.close(descriptor)
        set_mode(self.path, self.modes.file)
        db = self._open()
        with db:
            db.execute(
                "CREATE TABLE IF NOT EXISTS records (seq INTEGER PRIMARY KEY AUTOINCREMENT, "
                "log TEXT NOT NULL, data BLOB NOT NULL)"
            )
            db.execute("CREATE INDEX IF NOT EXISTS records_log ON records (log, seq)")
            # A new file's numbers start at a random point, so a reader's cursor from a file this
            # one replaced never lands inside its sequence (see `_read`).
            db.execute(
                "INSERT INTO sqlite_sequence (name, seq) SELECT 'records', ? WHERE NOT EXISTS "
                "(SELECT 1 FROM sqlite_sequence WHERE name = 'records')",
                (secrets.randbelow(1 << 60),),
            )
        db.execute("SELECT seq FROM records ORDER BY seq DESC LIMIT 1").fetchall()

    def _file_inode(self) -> int | None:
        try:
            return os.stat(self.path).st_ino
        except OSError:
            return None

    def _connection(self) -> sqlite3.Connection:
        """Return the thread's connection to the file now at `path` (reopened if replaced)."""
        db = getattr(self._local, "db", None)
        if db is None or getattr(self._local, "read_only", None) != self.read_only:
            self.close()
            return self._open()
        if self._file_inode() != getattr(self._local, "inode", None):
            if self.read_only:  # replaced by a process that can write: read the new file
                self.close()
                return self._open()
            self._create()  # replaced or deleted by another process: use (or make) the new one
            return self._local.db
        return db

    def _open(self) -> sqlite3.Connection:
        inode = self._file_inode()
        if self.read_only:
            db = self._open_file_read_only()
        else:
            db = sqlite3.connect(str(self.path), timeout=60, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
        self._local.db, self._local.inode, self._local.read_only = db, inode, self.read_only
        return db

    def _open_file_read_only(self) -> sqlite3.Connection:
        """Connect with ``mode=ro`` (which needs the ``-shm`` file), else ``immutable=1``."""
        self._refuse_links()
        uri = self.path.resolve().as_uri()
        last: sqlite3.Error | None = None
        for options in ("mode=ro", "immutable=1"):
            db = sqlite3.connect(f"{uri}?{options}", uri=True, timeout=60, isolation_level=None)
            try:
                db.execute("SELECT seq FROM records ORDER BY seq DESC LIMIT 1").fetchall()
            except sqlite3.Error as error:
                db.close()
                last = error
                continue
            return db
        assert last is not None
        raise last

    def append(self, log: str, records: Sequence[bytes]) -> None:
        """Append ``records`` to ``log`` atomically (one transaction)."""
        validate_log_name(log)
        checked = _validate_records(records)
        if not checked:
            return
        if self.read_only and not self._try_writable():
            raise sqlite3.OperationalError(
                f"attempt to write a readonly database (record log {self.path} opened read-only)"
            )

        def insert() -> None:
            db = self._connection()
            with db:
                db.execute("BEGIN IMMEDIATE")
                db.executemany(
                    "INSERT INTO records (log, data) VALUES (?, ?)", [(log, r) for r in checked]
                )

        self._healing(insert)
        before, self._appended = self._appended, self._appended + len(checked)
        if before // self._TRIM_EVERY != self._appended // self._TRIM_EVERY:
            self._trim(log)

    def _trim(self, log: str) -> None:
        db = self._connection()
        with db:
            db.execute(
                "DELETE FROM records WHERE log = ? AND seq <= (SELECT seq FROM records "
                "WHERE log = ? ORDER BY seq DESC LIMIT 1 OFFSET ?)",
                (log, log, self.max_records),
            )

    def read(self, log: str, cursor: int = 0) -> tuple[list[bytes], int]:
        """Return the records of ``log`` after sequence number ``cursor``, and the last one's."""
        validate_log_name(log)
        return self._healing(lambda: self._read(log, int(cursor)))

    def _read(self, log: str, cursor: int) -> tuple[list[bytes], int]:
        db = self._connection()
        if cursor > 0:
            top = db.execute("SELECT seq FROM sqlite_sequence WHERE name = 'records'").fetchone()
            if top is None or cursor > int(top[0]):
                cursor = 0  # the file was replaced: its sequence started again
        rows = db.execute(
            "SELECT seq, data FROM records WHERE log = ? AND seq > ? ORDER BY seq", (log, cursor)
        ).fetchall()
        if not rows:
            return [], cursor
        return [bytes(data) for _, data in rows], int(rows[-1][0])

    def clear(self) -> None:
        """Drop every log (sequence numbers keep increasing, so cursors stay valid)."""
        db = self._connection()
        with db:
            db.execute("DELETE FROM records")

    def close(self) -> None:
        """Close this thread's connection (reopened on next use)."""
        db = getattr(self._local, "db", None)
        if db is not None:
            db.close()
            self._local.db = None
