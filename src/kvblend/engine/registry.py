"""The registry of known documents: which texts have KV in the store, found in any prompt.

Framework adapters see only a finished prompt string; the registry finds the precomputed
documents inside it by exact match. It is shared through the store: every document precomputed
(or registered) appends a small record to a record log of the store, one log per model, and
every registry over that store reads the records it has not seen yet before each search. So a
second process, or the same one after a restart, finds documents it never precomputed, with no
call to `BlendEngine.register`.

A document is known whatever prompt head (document context) its KV was computed behind: its
record names the context, and the registry answers `contexts(text)` with every context an entry
was stored behind, so an engine with another system prompt reuses that KV as a moved document.
A document record holds hashes, not text: a 32-bit hash of the document's first characters (its
anchor), its length, a 128-bit hash of the whole text and one of its context. A context's text
is recorded once, in context records (split in parts when long). A search hashes the prompt's
substring of anchor length at every position, looks the anchor up, and confirms a candidate by
hashing the prompt's substring of the candidate's length; so its cost grows with the prompt's
length, not with the number of known documents. The registry keeps at most ``capacity``
documents, dropping the least recently matched.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import threading
import zlib
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_CAPACITY", "DocumentRegistry", "Match", "document_metadata", "text_digest"]

#: Documents a registry keeps before dropping the least recently matched.
DEFAULT_CAPACITY = 200_000
#: Characters hashed as a document's anchor (shorter documents use their whole text).
ANCHOR_CHARS = 16
#: Documents shorter than this are not registered: too short to be worth a cache entry.
MIN_CHARS = 8

_DOCUMENT = struct.Struct("<cIQ16s16s")  # b"D", anchor hash, length, text digest, context digest
_CONTEXT = struct.Struct("<c16sHH")  # b"C", context digest, part, parts; then the part's bytes
_CONTEXT_PART_BYTES = 4000  # a record log takes records of at most 4096 bytes


def text_digest(text: str) -> bytes:
    """128-bit content hash of ``text`` (UTF-8, surrogates escaped)."""
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def _anchor(text: str) -> int:
    return zlib.crc32(text[:ANCHOR_CHARS].encode("utf-8", "surrogatepass"))


@dataclass(frozen=True)
class Match:
    """A known document found in a prompt at characters ``[start, end)``."""

    start: int
    end: int


class DocumentRegistry:
    """Known documents of one model, kept in sync through a store's log.

    ``store`` is anything with ``append_records(log, records)`` and
    ``read_records(log, cursor)``; a store without them keeps the registry in this process.
    """

    def __init__(self, store: Any, log: str, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.store = store
        self.log = log
        self.capacity = capacity
        self._lock = threading.Lock()
        self._cursor = 0
        self._shared = callable(getattr(store, "read_records", None))
        # digest -> (anchor hash, length), least recently matched first
        self._documents: OrderedDict[bytes, tuple[int, int]] = OrderedDict()
        # (anchor hash, anchor length) -> {length -> {digest}}
        self._anchors: dict[tuple[int, int], dict[int, set[bytes]]] = {}
        self._anchor_lengths: dict[int, int] = {}  # anchor length -> documents using it
        self._stored_behind: dict[bytes, list[bytes]] = {}  # digest -> context digests, newest last
        self._contexts: dict[bytes, str] = {}  # context digest -> context text
        self._context_parts: dict[bytes, dict[int, bytes]] = {}  # contexts still incomplete

    def __len__(self) -> int:
        self.refresh()
        with self._lock:
            return len(self._documents)

    def __contains__(self, text: object) -> bool:
        if not isinstance(text, str):
            return False
        self.refresh()
        with self._lock:
            return text_digest(text) in self._documents

    def add(self, texts: Iterable[str], context: str = "") -> None:
        """Make ``texts`` known here and, through the store, to every registry sharing it.

        ``context``: the text their KV is stored behind (the document context).
        """
        records = []
        where = text_digest(context)
        with self._lock:
            if where not in self._contexts:
                self._contexts[where] = context
                records.extend(_context_records(where, context))
            for text in texts:
                if len(text) < MIN_CHARS:
                    continue
                digest = text_digest(text)
                if where in self._stored_behind.get(digest, ()):
                    self._documents.move_to_end(digest)
                    continue
                anchor = _anchor(text)
                self._insert(digest, anchor, len(text), where)
                records.append(_DOCUMENT.pack(b"D", anchor, len(text), digest, where))
        if records and self._shared:
            self._share(records)

    def _share(self, records: list[bytes]) -> None:
        try:
            self.store.append_records(self.log, records)
        except Exception as error:  # noqa: BLE001 - known here still; other processes miss it
            logger.warning("could not share %d document record(s): %s", len(records), error)

    def contexts(self, text: str) -> list[str]:
        """Return the document contexts ``text``'s KV is stored behind, most recent last."""
        self.refresh()
        with self._lock:
            behind = self._stored_behind.get(text_digest(text), [])
            return [self._contexts[where] for where in behind if where in self._contexts]

    def refresh(self) -> None:
        """Read the records other registries over the same store appended since the last look."""
        if not self._shared:
            return
        try:
            records, cursor = self.store.read_records(self.log, self._cursor)
        except Exception as error:  # noqa: BLE001 - the local registry still works
            logger.warning("could not read the shared document registry: %s", error)
            return
        with self._lock:
            for record in records:
                self._apply(record)
            self._cursor = cursor

    def _apply(self, record: bytes) -> None:
        """Take in one record read from the log; anything malformed is ignored, not trusted."""
        if record[:1] == b"D" and len(record) == _DOCUMENT.size:
            _, anchor, length, digest, where = _DOCUMENT.unpack(record)
            if MIN_CHARS <= length < 1 << 31 and where not in self._stored_behind.get(digest, ()):
                self._insert(digest, anchor, length, where)
        elif record[:1] == b"C" and len(record) >= _CONTEXT.size:
            _, where, part, parts = _CONTEXT.unpack_from(record)
            if where in self._contexts or not part < parts:
                return
            pieces = self._context_parts.setdefault(where, {})
            pieces[part] = record[_CONTEXT.size :]
            if len(pieces) == parts:
                del self._context_parts[where]
                whole = b"".join(pieces[index] for index in range(parts))
                try:
                    context = whole.decode("utf-8", "surrogatepass")
                except UnicodeDecodeError:
                    return
                if text_digest(context) == where:
                    self._contexts[where] = context

    def find(self, prompt: str) -> list[Match]:
        """Known documents in ``prompt``: longest first, never overlapping, sorted by position."""
        self.refresh()
        found: list[tuple[int, int, bytes]] = []
        with self._lock:
            lengths = list(self._anchor_lengths)
            size = len(prompt)
            for anchor_length in lengths:
                for start in range(size - anchor_length + 1):
                    piece = prompt[start : start + anchor_length]
                    bucket = self._anchors.get(
                        (zlib.crc32(piece.encode("utf-8", "surrogatepass")), anchor_length)
                    )
                    if bucket is None:
                        continue
                    for length, digests in bucket.items():
                        if start + length <= size:
                            digest = text_digest(prompt[start : start + length])
                            if digest in digests:
                                found.append((start, start + length, digest))
            for _, _, digest in found:
                self._documents.move_to_end(digest)
        return _non_overlapping(found)

    def _insert(self, digest: bytes, anchor: int, length: int, context: bytes) -> None:
        behind = self._stored_behind.setdefault(digest, [])
        if context in behind:
            behind.remove(context)
        behind.append(context)
        if digest in self._documents:
            self._documents.move_to_end(digest)
            return
        anchor_length = min(length, ANCHOR_CHARS)
        self._documents[digest] = (anchor, length)
        self._anchors.setdefault((anchor, anchor_length), {}).setdefault(length, set()).add(digest)
        self._anchor_lengths[anchor_length] = self._anchor_lengths.get(anchor_length, 0) + 1
        while len(self._documents) > self.capacity:
            old, (old_anchor, old_length) = self._documents.popitem(last=False)
            self._remove(old, old_anchor, old_length)

    def _remove(self, digest: bytes, anchor: int, length: int) -> None:
        self._stored_behind.pop(digest, None)
        anchor_length = min(length, ANCHOR_CHARS)
        bucket = self._anchors.get((anchor, anchor_length), {})
        digests = bucket.get(length, set())
        digests.discard(digest)
        if not digests:
            bucket.pop(length, None)
        if not bucket:
            self._anchors.pop((anchor, anchor_length), None)
        self._anchor_lengths[anchor_length] -= 1
        if not self._anchor_lengths[anchor_length]:
            del self._anchor_lengths[anchor_length]


def document_metadata(text: str, context: str) -> dict[str, str]:
    """Entry metadata naming the document an entry holds (hashes, not text) and its context.

    Stored with every precomputed entry, so the registry can be rebuilt from the store's own
    entries (`DocumentRegistry.rebuild`) when its log is lost.
    """
    return {
        "document.digest": text_digest(text).hex(),
        "document.anchor": str(_anchor(text)),
        "document.chars": str(len(text)),
        "document.context": context,
    }


def _context_records(where: bytes, context: str) -> list[bytes]:
    """Return records carrying a context's text, in parts small enough for a record log."""
    data = context.encode("utf-8", "surrogatepass")
    parts = max(1, -(-len(data) // _CONTEXT_PART_BYTES))
    return [
        _CONTEXT.pack(b"C", where, index, parts)
        + data[index * _CONTEXT_PART_BYTES : (index + 1) * _CONTEXT_PART_BYTES]
        for index in range(parts)
    ]


def _non_overlapping(found: list[tuple[int, int, bytes]]) -> list[Match]:
    """Longest matches first, earlier first among equals; drop any that overlaps a kept one."""
    kept: list[tuple[int, int]] = []
    for start, end, _ in sorted(found, key=lambda item: (item[0] - item[1], item[0])):
        if all(end <= other_start or start >= other_end for other_start, other_end in kept):
            kept.append((start, end))
    return [Match(start, end) for start, end in sorted(kept)]
