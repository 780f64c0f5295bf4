"""Record logs: small append-only byte records that every process sharing a store can read.

The engine keeps its registry of known documents (which texts have KV in the store) as records
in a log named after the model and document context, so a process that never precomputed a
document finds it in prompts, and a restart over the same store forgets nothing. The store only
sees opaque bytes; what a record means is the engine's business.

A log is a sequence numbered from 1. `read(log, cursor)` returns the records after `cursor` (the
sequence number of the last record the caller has seen; 0 for the start) and the new cursor, so a
reader fetches only what was appended since it last looked. Logs are bounded: past
``max_records`` the oldest records are dropped, and a reader that falls behind simply resumes
from the oldest record still kept.

- `MemoryRecordLogs`: the process's own logs (memory-only stores);
- `DiskRecordLogs`: logs in a `diskcache` folder, shared by every process that opens it. Keys
  are strings and values are bytes or integers, which diskcache stores as they are: nothing is
  pickled, and a pickled value someone else left in the folder is never unpickled.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

from kvblend.store.files import PRIVATE, FileModes, ForeignValueError, RecordDisk, prepare_folder
from kvblend.store.index import open_index

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
        """Return the records of ``log`` after sequence number ``cursor`` and the last number."""
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
    """Record logs in a diskcache folder, shared by processes (SQLite transactions).

    The folder gets the store's `modes`; a damaged index is set aside and rebuilt on open (see
    `kvblend.store.index`), and a value this class did not write reads as missing.
    """

    _TRIM_EVERY = 1024

    def __init__(
        self,
        directory: str | Path,
        max_records: int = DEFAULT_MAX_RECORDS,
        *,
        modes: FileModes = PRIVATE,
    ) -> None:
        self.max_records = max_records
        prepare_folder(directory, modes)
        self._cache, _ = open_index(
            Path(directory), modes, RecordDisk, eviction_policy="none", size_limit=2**62
        )

    def _get(self, key: str) -> object:
        try:
            return self._cache.get(key)
        except ForeignValueError:
            return None

    @staticmethod
    def _head(log: str) -> str:
        return f"{log}/head"

    @staticmethod
    def _item(log: str, seq: int) -> str:
        return f"{log}/{seq:012d}"

    def append(self, log: str, records: Sequence[bytes]) -> None:
        """Append ``records`` to ``log`` atomically (one transaction)."""
        validate_log_name(log)
        checked = _validate_records(records)
        if not checked:
            return
        with self._cache.transact():
            head = int(self._cache.incr(self._head(log), len(checked), default=0))
            for offset, record in enumerate(checked):
                self._cache.set(self._item(log, head - len(checked) + 1 + offset), record)
        if head > self.max_records and (head // self._TRIM_EVERY) != (
            (head - len(checked)) // self._TRIM_EVERY
        ):
            self._trim(log, head)

    def _trim(self, log: str, head: int) -> None:
        oldest_kept = head - self.max_records + 1
        seq = oldest_kept - 1
        while seq > 0 and self._cache.delete(self._item(log, seq)):
            seq -= 1

    def read(self, log: str, cursor: int = 0) -> tuple[list[bytes], int]:
        """Return the records of ``log`` after sequence number ``cursor`` and the last number."""
        validate_log_name(log)
        stored_head = self._get(self._head(log))
        head = stored_head if type(stored_head) is int else 0
        if head == cursor:
            return [], head
        oldest = max(1, head - self.max_records + 1)
        start = oldest if cursor > head else max(cursor + 1, oldest)  # a cleared log restarts
        found = []
        for seq in range(start, head + 1):
            record = self._get(self._item(log, seq))
            if isinstance(record, bytes):
                found.append(record)
        return found, head

    def clear(self) -> None:
        """Drop every log."""
        self._cache.clear()

    def close(self) -> None:
        """Close the folder's handles (reopened on next use)."""
        self._cache.close()
