"""File safety of a disk store folder: private modes, confined file names, race-free writes.

Stored KV reveals the documents it was computed from (the first layer's keys are a function of
each token alone, so the text can be read back from an entry). A store folder is therefore
private to its owner by default: folders ``0700``, files ``0600``, whatever the umask. A shared
deployment opts in (``shared=True`` or ``KVBLEND_STORE_SHARED=1``) to group access, ``0770`` /
``0660``.

The diskcache index names each value file; a row whose name is not one diskcache writes
(``ab/cd/<28 hex>.val``, inside the folder, not through a symbolic link) or that names something
other than a regular file (a FIFO would block the reader) is treated as a foreign value: never
read, never deleted. Nothing is written through a link either: a value sub-folder, the index
or one of SQLite's files next to it that is a symbolic link, or a file with other names (a
hard link), is refused (`refuse_links`): nothing outside the folder is written or chmod-ed.
Writes retry when another process removes an emptied sub-folder between creating it and
opening the file in it, as diskcache's own writer does.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import sqlite3
import stat
from collections.abc import Callable
from dataclasses import dataclass

import diskcache
from diskcache.core import MODE_BINARY, MODE_RAW, UNKNOWN

logger = logging.getLogger(__name__)

#: Environment variable that opts a store folder in to group access (``1``) instead of private.
SHARED_ENV = "KVBLEND_STORE_SHARED"
#: Name of diskcache's index in a store folder.
INDEX_NAME = "cache.db"

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})
_SEP = re.escape(os.sep)
_VALUE_FILE = re.compile(rf"([0-9a-f]{{2}}){_SEP}([0-9a-f]{{2}}){_SEP}([0-9a-f]{{28}}\.val)")
#: Attempts at creating a value file's folders and the file (diskcache's writer makes 10).
WRITE_ATTEMPTS = 10
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


@dataclass(frozen=True)
class FileModes:
    """Permission bits of a store folder's sub-folders and files."""

    folder: int
    file: int
    shared: bool


PRIVATE = FileModes(0o700, 0o600, shared=False)
SHARED = FileModes(0o770, 0o660, shared=True)


def file_modes(shared: bool | None = None) -> FileModes:
    """Return the modes for `shared`; None reads ``$KVBLEND_STORE_SHARED`` (default private)."""
    if shared is None:
        raw = os.environ.get(SHARED_ENV, "").strip().lower()
        if raw not in _TRUE | _FALSE:
            raise ValueError(f"{SHARED_ENV}={raw!r}: use 1 (group access) or 0 (private)")
        shared = raw in _TRUE
    return SHARED if shared else PRIVATE


def set_mode(path: str | os.PathLike[str], mode: int) -> None:
    """Set the permission bits of `path`, keeping a folder's setgid bit (shared groups).

    Raises `OSError` (``EMLINK``) for a file with other names (`refuse_links`): its mode is
    that of a file elsewhere too.
    """
    info = os.stat(path)
    _refuse_hard_link(os.fspath(path), info)
    if stat.S_IMODE(info.st_mode) & ~stat.S_ISGID != mode:
        os.chmod(path, mode | (info.st_mode & stat.S_ISGID))


def _refuse_hard_link(path: str, info: os.stat_result) -> None:
    if stat.S_ISREG(info.st_mode) and info.st_nlink > 1:
        raise OSError(
            errno.EMLINK,
            f"{os.path.basename(path)} in the KV store folder is a hard link ({info.st_nlink} "
            "names, maybe a file outside the folder); kvblend does not write or chmod a file "
            "other names share: remove it",
            path,
        )


def prepare_folder(path: str | os.PathLike[str], modes: FileModes) -> None:
    """Create the store folder `path` with `modes`, or make an existing one private.

    A private store tightens a folder it owns that any user may enter (as older versions left
    them, ``0755``) when the folder is empty or already a store (holds an index). Any other
    existing folder is left as it is, with a warning if users other than the owner can enter
    it: a folder only its group may enter is probably shared on purpose by processes that
    did not all set ``KVBLEND_STORE_SHARED=1``, and locking them out would break them.
    """
    path = os.fspath(path)
    try:
        os.makedirs(path, mode=modes.folder)
    except FileExistsError:
        if not os.path.isdir(path):
            raise NotADirectoryError(f"not a folder: {path}") from None
        info = os.stat(path)
        if modes.shared or not stat.S_IMODE(info.st_mode) & 0o077:
            return
        ours = info.st_uid == getattr(os, "geteuid", lambda: info.st_uid)()
        store = not os.listdir(path) or os.path.exists(os.path.join(path, INDEX_NAME))
        if ours and store and stat.S_IMODE(info.st_mode) & 0o007:
            set_mode(path, modes.folder)
            for name in os.listdir(path):
                full = os.path.join(path, name)
                if name.startswith(INDEX_NAME) and not os.path.islink(full):
                    with contextlib.suppress(OSError):  # a hard link is refused later
                        set_mode(full, modes.file)
        else:
            logger.warning(
                "KV store folder %s is open to other users, and stored KV reveals the "
                "documents: make it private (chmod 700) or set %s=1 if it is shared on purpose",
                path,
                SHARED_ENV,
            )
        return
    set_mode(path, modes.folder)  # makedirs' mode is masked by the umask


def _fchmod(descriptor: int, mode: int) -> None:
    if hasattr(os, "fchmod"):  # POSIX; elsewhere permission bits mean little
        os.fchmod(descriptor, mode)


#: Files SQLite keeps next to a database: each must not be a link out of the folder either.
SQLITE_SUFFIXES = ("", "-wal", "-shm", "-journal")


def refuse_links(directory: str | os.PathLike[str], *names: str) -> None:
    """Raise `OSError` if one of `names` in `directory` is a symbolic or a hard link.

    Nothing under a store folder is followed through a link: SQLite and the store would
    otherwise create tables, write and change modes wherever the link points. A regular file
    with more than one name (``st_nlink > 1``: ``ln /elsewhere/victim.db STORE/cache.db``) is
    the same file as one elsewhere, so it is refused too (``EMLINK``); a symbolic link raises
    ``ELOOP``.
    """
    for name in names:
        path = os.path.join(directory, name)
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            continue
        _refuse_hard_link(path, info)
        if stat.S_ISLNK(info.st_mode):
            raise OSError(
                errno.ELOOP,
                f"{name} in the KV store folder is a symbolic link (to {os.readlink(path)!r}); "
                "kvblend does not follow links out of the folder: remove it",
                path,
            )


def prepare_index_file(directory: str | os.PathLike[str], modes: FileModes) -> None:
    """Create the folder's SQLite index file with `modes` before SQLite does (with 0644).

    SQLite gives its ``-wal`` and ``-shm`` files the mode of the database file. Raises
    `OSError` if the index or one of SQLite's files next to it is a symbolic or hard link.
    """
    refuse_links(directory, *(INDEX_NAME + suffix for suffix in SQLITE_SUFFIXES))
    path = os.path.join(directory, INDEX_NAME)
    descriptor = os.open(path, os.O_RDONLY | os.O_CREAT | _NOFOLLOW, modes.file)
    try:
        info = os.fstat(descriptor)
        _refuse_hard_link(path, info)  # linked between the check and the open
        if info.st_size == 0 and stat.S_IMODE(info.st_mode) != modes.file:
            _fchmod(descriptor, modes.file)
    finally:
        os.close(descriptor)


def confined_path(directory: str, filename: object) -> str | None:
    """Full path of the value file `filename` if it lies inside `directory`, else None.

    `directory` must be a real path (no symbolic links). Only names diskcache writes are
    accepted, and the file must not be reached through a symbolic link.
    """
    if not isinstance(filename, str):
        return None
    match = _VALUE_FILE.fullmatch(filename)
    if match is None:
        return None
    full = os.path.join(directory, *match.groups())
    if os.path.realpath(full) != full:
        return None
    return full


def _make_value_folders(directory: str, parts: tuple[str, ...], modes: FileModes) -> None:
    current = directory
    for part in parts:
        refuse_links(current, part)
        current = os.path.join(current, part)
        try:
            os.mkdir(current, modes.folder)
        except FileExistsError:
            continue
        set_mode(current, modes.folder)


def write_value_file(directory: str, filename: str, data: bytes, modes: FileModes) -> None:
    """Write `data` to the new value file `filename` (``ab/cd/x.val``) under `directory`.

    Missing sub-folders are created with `modes`. If another process removes an emptied
    sub-folder between its creation and the file's, the write starts again (up to
    `WRITE_ATTEMPTS` times). A failed write leaves no partial file behind.
    """
    parts = tuple(filename.split(os.sep))
    full = os.path.join(directory, *parts)
    for attempt in range(1, WRITE_ATTEMPTS + 1):
        try:
            _make_value_folders(directory, parts[:-1], modes)
            descriptor = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, modes.file)
            break
        except FileNotFoundError:
            if attempt == WRITE_ATTEMPTS:
                raise
    try:
        with open(descriptor, "wb") as file:
            _fchmod(descriptor, modes.file)  # the umask may have masked group bits
            file.write(data)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(full)
        raise


def remove_value_file(directory: str, filename: object) -> None:
    """Delete a value file and its emptied sub-folders; refuse names outside `directory`."""
    full = confined_path(directory, filename)
    if full is None:
        logger.warning("not deleting %r: not a value file inside the KV store folder", filename)
        return
    with contextlib.suppress(OSError):
        os.remove(full)
    folder = os.path.dirname(full)
    for _ in range(2):  # ab/cd, then ab; never the store folder itself
        try:
            os.rmdir(folder)
        except OSError:
            return
        folder = os.path.dirname(folder)


def open_no_follow(path: str, flags: int) -> int:
    """Open without following a final symbolic link or blocking on a FIFO someone put there."""
    return os.open(path, flags | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))


class ForeignValueError(Exception):
    """The folder holds a value kvblend did not write (pickled, text, or a file elsewhere)."""


class BytesOnlyDisk(diskcache.Disk):
    """diskcache serializer for str keys and bytes values only: never pickles or unpickles.

    Value files get the store's modes (`modes`, set by `disk_class`) and only file names inside
    the folder are ever opened or deleted.
    """

    modes: FileModes = PRIVATE

    def __init__(self, directory: str, **kwargs: object) -> None:
        super().__init__(directory, **kwargs)
        self._real_directory = os.path.realpath(directory)
        #: Set by the index once open: whether a row still names a file (then it is kept).
        self.still_named: Callable[[str], bool] | None = None

    def put(self, key: object) -> tuple[object, bool]:  # noqa: D102 - diskcache.Disk API
        if type(key) is not str:
            raise TypeError("the KV store only uses str keys")
        return super().put(key)

    def get(self, key: object, raw: bool) -> object:  # noqa: D102
        if not raw:
            raise ForeignValueError("pickled key")
        return super().get(key, raw)

    def store(self, value: object, read: bool, key: object = UNKNOWN) -> tuple:  # noqa: D102
        if type(value) is not bytes:
            raise TypeError("the KV store only stores bytes")
        if len(value) < self.min_file_size:
            return 0, MODE_RAW, None, sqlite3.Binary(value)
        filename, _ = self.filename(key, value)
        write_value_file(self._real_directory, filename, value, self.modes)
        return len(value), MODE_BINARY, filename, None

    def fetch(  # noqa: D102
        self, mode: int, filename: str | None, value: object, read: bool
    ) -> object:
        if mode not in (MODE_RAW, MODE_BINARY):
            raise ForeignValueError(f"diskcache mode {mode}")
        if mode == MODE_RAW:
            return super().fetch(mode, filename, value, read)
        full = confined_path(self._real_directory, filename)
        if full is None:
            raise ForeignValueError(f"file name {filename!r} outside the store folder")
        handle = open(full, "rb", opener=open_no_follow)  # noqa: SIM115 - the caller closes it
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            handle.close()
            raise ForeignValueError(f"{filename!r} is not a regular file")
        if read:
            return handle
        with handle:
            return handle.read()

    def remove(self, file_path: str) -> None:  # noqa: D102
        # Two rows of a damaged or rebuilt index may name one file: deleting one row (its key
        # does not match the file's header) must not delete the entry the other row owns.
        if self.still_named is not None and self.still_named(file_path):
            logger.debug("keeping %s: another index row names it", file_path)
            return
        remove_value_file(self._real_directory, file_path)


def disk_class(modes: FileModes) -> type[BytesOnlyDisk]:
    """Return the serializer class that writes files with `modes` (diskcache takes a class)."""
    return _SharedDisk if modes.shared else BytesOnlyDisk


class _SharedDisk(BytesOnlyDisk):
    modes = SHARED


#: errno values and SQLite messages that say a folder can be read but not written.
_READ_ONLY_ERRNOS = frozenset({errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC})
_READ_ONLY_MESSAGES = ("readonly", "read-only", "unable to open", "disk is full", "disk i/o error")


def looks_read_only(error: BaseException) -> bool:
    """Whether `error`, raised opening a folder's index, says the disk cannot be written."""
    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, OSError) and cause.errno in _READ_ONLY_ERRNOS:
            return True
        if isinstance(cause, sqlite3.OperationalError) and any(
            text in str(cause).lower() for text in _READ_ONLY_MESSAGES
        ):
            return True
        cause = cause.__cause__
    return False
