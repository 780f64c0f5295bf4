"""Rebuilding a disk store's index from its entry files, and sweeping what a killed writer left.

Every entry file names its own key in its header (`entry_format`), so an index that is lost
(set aside as damaged) or that misses rows (a writer killed between writing a file and
committing its row) is rebuilt from the files instead of deleting them: each value file no row
names, once older than the grace period (it may be an entry another process is writing), is
read up to its header; a whole entry whose key has no row is adopted (a row naming it is
inserted, access time = the file's modification time, so least recently used eviction keeps its
order); anything else (a partial file, a damaged header, a second copy of a key already held)
is deleted, and so are the empty sub-folders a killed writer or an eviction left behind.

Rows are inserted into diskcache's ``Cache`` table directly (no public API adopts a file); its
triggers keep the entry count and volume right. Only names diskcache writes (``ab/cd/x.val``),
inside the folder and not through a symbolic link, are ever opened or deleted.
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
from diskcache.core import MODE_BINARY

from kvblend.store.entry_format import Payload, entry_key
from kvblend.store.files import FileModes, confined_path, open_no_follow
from kvblend.store.index import ORPHAN_GRACE_S

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


def _key_of(path: Path) -> str | None:
    try:
        handle = open(path, "rb", opener=open_no_follow)  # noqa: SIM115 - Payload closes it
    except OSError:
        return None
    payload = Payload(handle)
    try:
        return entry_key(payload)
    finally:
        payload.close()


def _adopt(cache: diskcache.Cache, key: str, filename: str, info: os.stat_result) -> bool:
    """Insert a row naming `filename` under `key`, unless `key` already has one."""
    with cache.transact(retry=True):
        sql = cache._sql  # noqa: SLF001 - no public API adopts an existing file
        if sql("SELECT 1 FROM Cache WHERE key = ? AND raw = 1", (key,)).fetchall():
            return False
        sql(
            "INSERT INTO Cache(key, raw, store_time, expire_time, access_time, access_count,"
            " tag, size, mode, filename, value) VALUES (?, 1, ?, NULL, ?, 0, NULL, ?, ?, ?, NULL)",
            (key, time.time(), info.st_mtime, info.st_size, MODE_BINARY, filename),
        )
    return True


def adopt_files(cache: diskcache.Cache, directory: Path, older_than: float) -> Adoption:
    """Adopt or delete every value file no row names, last modified before `older_than`.

    Then delete empty value sub-folders last modified before `older_than`. Storage errors (a
    read-only folder) end the sweep early, logged, never raised.
    """
    adopted = deleted = freed = folders = 0
    try:
        named = _named(cache)
        for filename, path in value_files(directory):
            if filename in named:
                continue
            info = path.stat()
            if info.st_mtime >= older_than:
                continue  # may be an entry another process is writing
            key = _key_of(path)
            if key is not None and _adopt(cache, key, filename, info):
                adopted += 1
                continue
            cache.disk.remove(filename)  # and its emptied sub-folders
            deleted += 1
            freed += info.st_size
        folders = _remove_empty_folders(directory, older_than)
    except (OSError, sqlite3.Error, diskcache.Timeout) as error:
        logger.warning("could not finish sweeping the KV store in %s: %s", directory, error)
    if adopted or deleted or folders:
        logger.warning(
            "KV store in %s: %d entry files taken back into the index, %d unusable files "
            "(%d bytes) and %d empty folders deleted",
            directory, adopted, deleted, freed, folders,
        )  # fmt: skip
    return Adoption(adopted, deleted, freed, folders)


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


def sweep_if_due(cache: diskcache.Cache, directory: Path, modes: FileModes) -> Adoption | None:
    """Sweep (`adopt_files`) at most every `SWEEP_INTERVAL_S`, when a store opens the folder.

    The time of the last sweep is the modification time of the folder's `SWEEP_STAMP` file.
    Files and folders younger than `ORPHAN_GRACE_S` are left for a later sweep.
    """
    stamp = os.path.join(os.path.realpath(directory), SWEEP_STAMP)
    now = time.time()
    try:
        if now - os.stat(stamp, follow_symlinks=False).st_mtime < SWEEP_INTERVAL_S:
            return None
    except FileNotFoundError:
        pass
    except OSError:
        return None
    try:
        descriptor = open_no_follow(stamp, os.O_WRONLY | os.O_CREAT)
    except OSError as error:  # read-only folder: nothing could be cleaned anyway
        logger.debug("not sweeping the KV store in %s: %s", directory, error)
        return None
    try:
        os.utime(descriptor, (now, now))
        with contextlib.suppress(OSError):
            os.fchmod(descriptor, modes.file)
    finally:
        os.close(descriptor)
    return adopt_files(cache, directory, older_than=now - ORPHAN_GRACE_S)
