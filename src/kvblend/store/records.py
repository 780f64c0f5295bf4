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
  nothing is pickled.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path

from kvblend.store.files import PRIVATE, FileModes, prepare_folder, set_mode
from kvblend.store.index import is_damage

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_MAX_RECORDS", "DiskRecordLogs", "MemoryRecordLogs", "validate_log_name"]

#: Records kept per log before the oldest are dropped.
DEFAULT_MAX_RECORDS = 1_000_000
_MAX_RECORD_BYTES = 4096
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
    database file's mode); a damaged file is set aside as ``records.db.damaged`` and a new, empty
    one is started: records only help find documents, so losing them costs reuse, never answers.
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
        prepare_folder(self.directory, modes)
        try:
            self._create()
        except sqlite3.DatabaseError as error:
            if not is_damage(error):
                raise
            logger.warning(
                "record log %s is damaged (%s): set aside, starting anew", self.path, error
            )
            self.close()
            for suffix in ("", "-wal", "-shm"):
                damaged = Path(f"{self.path}{suffix}")
                if damaged.exists():
                    os.replace(damaged, f"{self.path}.damaged{suffix}")
            self._create()

    def _create(self) -> None:
        descriptor = os.open(self.path, os.O_RDONLY | os.O_CREAT, self.modes.file)
        os.close(descriptor)
        set_mode(self.path, self.modes.file)
        db = self._connection()
        with db:
            db.execute(
                "CREATE TABLE IF NOT EXISTS records (seq INTEGER PRIMARY KEY AUTOINCREMENT, "
                "log TEXT NOT NULL, data BLOB NOT NULL)"
            )
            db.execute("CREATE INDEX IF NOT EXISTS records_log ON records (log, seq)")
        db.execute("SELECT seq FROM records ORDER BY seq DESC LIMIT 1").fetchall()

    def _connection(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(str(self.path), timeout=60, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            self._local.db = db
        return db

    def append(self, log: str, records: Sequence[bytes]) -> None:
        """Append ``records`` to ``log`` atomically (one transaction)."""
        validate_log_name(log)
        checked = _validate_records(records)
        if not checked:
            return
        db = self._connection()
        with db:
            db.execute("BEGIN IMMEDIATE")
            db.executemany(
                "INSERT INTO records (log, data) VALUES (?, ?)", [(log, r) for r in checked]
            )
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
        rows = (
            self._connection()
            .execute(
                "SELECT seq, data FROM records WHERE log = ? AND seq > ? ORDER BY seq",
                (log, cursor),
            )
            .fetchall()
        )
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
