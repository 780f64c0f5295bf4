"""The registry of known documents: which texts have KV in the store, found in any prompt.

Framework adapters see only a finished prompt string; the registry finds the precomputed
documents inside it by exact match. It is shared through the store: every document precomputed
(or registered) appends a small record to a record log of the store, named after the model and
document context, and every registry over that store reads the records it has not seen yet
before each search. So a second process, or the same one after a restart, finds documents it
never precomputed, with no call to `BlendEngine.register`.

A record holds hashes, not text: a 32-bit hash of the document's first characters (its anchor),
its length, and a 128-bit hash of the whole text. A search hashes the prompt's substring of
anchor length at every position, looks the anchor up, and confirms a candidate by hashing the
prompt's substring of the candidate's length; so its cost grows with the prompt's length, not
with the number of known documents. The registry keeps at most ``capacity`` documents, dropping
the least recently matched.
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

import numpy as np

from .anchors import window_crc32

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_CAPACITY", "DocumentRegistry", "Match", "text_digest"]

#: Documents a registry keeps before dropping the least recently matched.
DEFAULT_CAPACITY = 200_000
#: Characters hashed as a document's anchor (shorter documents use their whole text).
ANCHOR_CHARS = 16
#: Documents shorter than this are not registered: too short to be worth a cache entry.
MIN_CHARS = 8

_RECORD = struct.Struct("<IQ16s")  # anchor hash, text length, text digest


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
    """Known documents of one model and document context, kept in sync through a store's log.

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

    def add(self, texts: Iterable[str]) -> None:
        """Make ``texts`` known here and, through the store, to every registry sharing it."""
        records = []
        with self._lock:
            for text in texts:
                if len(text) < MIN_CHARS:
                    continue
                digest = text_digest(text)
                if digest in self._documents:
                    self._documents.move_to_end(digest)
                    continue
                anchor = _anchor(text)
                self._insert(digest, anchor, len(text))
                records.append(_RECORD.pack(anchor, len(text), digest))
        if records and self._shared:
            try:
                self.store.append_records(self.log, records)
            except Exception as error:  # noqa: BLE001 - known here still; other processes miss it
                logger.warning("could not share %d document record(s): %s", len(records), error)

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
                if len(record) != _RECORD.size:
                    continue  # not ours: ignored rather than trusted
                anchor, length, digest = _RECORD.unpack(record)
                if digest not in self._documents and MIN_CHARS <= length < 1 << 31:
                    self._insert(digest, anchor, length)
            self._cursor = cursor

    def find(self, prompt: str) -> list[Match]:
        """Known documents in ``prompt``: longest first, never overlapping, sorted by position."""
        self.refresh()
        found: list[tuple[int, int, bytes]] = []
        with self._lock:
            # The anchor hashes known, per anchor length, as sorted arrays, made when the
            # registry is unchanged since the last search (an added document is the most
            # recent: the last key); while documents are being added, each position is looked
            # up in the anchor table instead (the cost of either follows the prompt's length).
            signature = (len(self._documents), next(reversed(self._documents), None))
            cached = getattr(self, "_known_anchors", None)
            arrays: dict[int, np.ndarray] | None = None
            if cached is not None and cached[0] == signature:
                arrays = cached[1]
                if arrays is None:
                    by_length: dict[int, list[int]] = {}
                    for anchor, anchor_length in self._anchors:
                        by_length.setdefault(anchor_length, []).append(anchor)
                    arrays = {
                        n: np.unique(np.array(v, dtype=np.uint32)) for n, v in by_length.items()
                    }
            # digest -> anchor hash of a found document's last characters: a candidate whose
            # last characters hash otherwise is not hashed whole
            tails: dict[bytes, int] = getattr(self, "_tail_anchors", {})
            size = len(prompt)
            for anchor_length in list(self._anchor_lengths):
                hashes = window_crc32(prompt, anchor_length)  # every position at once
                if arrays is not None:
                    anchors = arrays[anchor_length]
                    slots = np.minimum(np.searchsorted(anchors, hashes), len(anchors) - 1)
                    starts = np.flatnonzero(anchors[slots] == hashes).tolist()
                else:
                    starts = [
                        start
                        for start, value in enumerate(hashes.tolist())
                        if (value, anchor_length) in self._anchors
                    ]
                for start in starts:
                    bucket = self._anchors.get((int(hashes[start]), anchor_length), {})
                    for length, digests in bucket.items():
                        if start + length > size:
                            continue
                        tail = int(hashes[start + length - anchor_length])
                        if all(tails.get(other, tail) != tail for other in digests):
                            continue
                        digest = text_digest(prompt[start : start + length])
                        if digest in digests:
                            found.append((start, start + length, digest))
                            tails[digest] = tail
            if len(tails) > 2 * len(self._documents):
                tails = {d: tail for d, tail in tails.items() if d in self._documents}
            self._tail_anchors = tails
            for _, _, digest in found:
                self._documents.move_to_end(digest)
            # moving matched documents changed the last key, not the anchors
            last = next(reversed(self._documents), None)
            self._known_anchors = ((len(self._documents), last), arrays)
        return _non_overlapping(found)

    def _insert(self, digest: bytes, anchor: int, length: int) -> None:
        anchor_length = min(length, ANCHOR_CHARS)
        self._documents[digest] = (anchor, length)
        self._anchors.setdefault((anchor, anchor_length), {}).setdefault(length, set()).add(digest)
        self._anchor_lengths[anchor_length] = self._anchor_lengths.get(anchor_length, 0) + 1
        while len(self._documents) > self.capacity:
            old, (old_anchor, old_length) = self._documents.popitem(last=False)
            self._remove(old, old_anchor, old_length)

    def _remove(self, digest: bytes, anchor: int, length: int) -> None:
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


def _non_overlapping(found: list[tuple[int, int, bytes]]) -> list[Match]:
    """Longest matches first, earlier first among equals; drop any that overlaps a kept one."""
    kept: list[tuple[int, int]] = []
    for start, end, _ in sorted(found, key=lambda item: (item[0] - item[1], item[0])):
        if all(end <= other_start or start >= other_end for other_start, other_end in kept):
            kept.append((start, end))
    return [Match(start, end) for start, end in sorted(kept)]
