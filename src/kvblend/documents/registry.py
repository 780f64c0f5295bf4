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
A record holds hashes, never a document's text: a hash of its first characters (its anchor), its
length, a hash of the whole text and one of its context (`kvblend.documents.registry_records`). A
search hashes the prompt's substring of anchor length at every position, looks the anchor up,
and confirms a candidate by hashing the prompt's substring of the candidate's length; so its
cost grows with the prompt's length, not with the number of known documents. The registry keeps
at most ``capacity`` documents, dropping the least recently matched.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvblend.documents.anchors import non_overlapping, window_crc32
from kvblend.documents.registry_records import (
    ANCHOR_CHARS,
    CONTEXT,
    DOCUMENT,
    HEAD,
    HEAD_CHARS,
    MIN_CHARS,
    REBUILT,
    anchor_hash,
    context_records,
    head_hash,
    parse_document_metadata,
    parse_head,
    text_digest,
)

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_CAPACITY", "DocumentRegistry", "Match"]

#: Documents a registry keeps before dropping the least recently matched.
DEFAULT_CAPACITY = 200_000
_REBUILD_EVERY_S = 60.0  # while the log is unreadable, the store's entries are read this often


@dataclass(frozen=True)
class Match:
    """A known document found in a prompt at characters ``[start, end)``."""

    start: int
    end: int


class DocumentRegistry:
    """Known documents of one model, kept in sync through a store's log.

    ``store`` is anything with ``append_records(log, records)`` and
    ``read_records(log, cursor)``; a store without them keeps the registry in this process.
    ``stored``, when given, yields the metadata of the store's entries (`document_metadata`
    items among them): the registry is rebuilt from it whenever its log is found missing or
    damaged (empty on first look, started again, or unreadable), so losing the log costs one
    rebuild, not the reuse of every document.
    """

    def __init__(
        self,
        store: Any,
        log: str,
        capacity: int = DEFAULT_CAPACITY,
        *,
        stored: Callable[[], Iterable[Mapping[str, str]]] | None = None,
    ) -> None:
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
        self._heads: dict[bytes, int] = {}  # digest -> hash of its first HEAD_CHARS characters
        # Search caches of `find`, both cleared by `_insert` and `_remove`: the known anchor
        # hashes per anchor length as sorted arrays (made once the anchors are unchanged since
        # the last search), and digest -> hash of a found document's last characters.
        self._anchor_arrays: dict[int, np.ndarray] | None = None
        self._anchors_settled = False  # no document inserted or removed since the last search
        self._tail_anchors: dict[bytes, int] = {}
        self._context_parts: dict[bytes, dict[int, bytes]] = {}  # contexts still incomplete
        self._stored = stored
        self._looked = False  # whether the log has been read once
        self._unusable_since: float | None = None  # the log's first failure in a row
        self._rebuilt_at = -float("inf")
        #: How many times the registry was rebuilt from the store's entries.
        self.rebuilds = 0

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
        if not self._looked:
            self.refresh()  # a log found missing is rebuilt (and marked whole) before it grows
        records = []
        where = text_digest(context)
        with self._lock:
            if where not in self._contexts:
                self._contexts[where] = context
                records.extend(context_records(where, context))
            for text in texts:
                if len(text) < MIN_CHARS:
                    continue
                digest = text_digest(text)
                if where in self._stored_behind.get(digest, ()):
                    self._documents.move_to_end(digest)
                    continue
                anchor, self._heads[digest] = anchor_hash(text), head_hash(text)
                self._insert(digest, anchor, len(text), where)
                records.append(DOCUMENT.pack(b"D", anchor, len(text), digest, where))
                records.append(HEAD.pack(b"H", digest, self._heads[digest]))
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
            if not self._looked:
                self._looked = True
                self.rebuild(share=False)
            return
        try:
            records, cursor = self.store.read_records(self.log, self._cursor)
        except Exception as error:  # noqa: BLE001 - the local registry still works
            self._log_unusable(error)
            return
        with self._lock:
            # A log is whole when it holds a rebuild's mark: one that has none at first look,
            # or that started again since (cleared, replaced, flushed), is rebuilt once.
            lost = not self._looked or cursor < self._cursor
            self._looked = True
            self._unusable_since = None
            for record in records:
                lost &= not self._apply(record)
            self._cursor = cursor
        if lost:
            self.rebuild()

    def _log_unusable(self, error: BaseException) -> None:
        """Rebuild from the store's entries (at once, then at most once a minute) instead."""
        now = time.monotonic()
        first = self._unusable_since is None
        if first:
            self._unusable_since = now
            logger.warning(
                "could not read the shared document registry (%s); finding documents from the "
                "store's entries instead",
                error,
            )
        if first or now - self._rebuilt_at >= _REBUILD_EVERY_S:
            self.rebuild(share=False)

    def rebuild(self, *, share: bool = True) -> int:
        """Take in every document the store's entries name, and share them through the log.

        Returns how many documents the entries named. Called by `refresh` when the log is
        missing or damaged; ``share=False`` when the log cannot be written either.
        """
        if self._stored is None:
            return 0
        self._rebuilt_at = time.monotonic()
        try:
            items = list(self._stored())
            described = [parse_document_metadata(item) for item in items]
        except Exception as error:  # noqa: BLE001 - the registry keeps what it knows
            logger.warning("could not rebuild the document registry from the store: %s", error)
            return 0
        records: list[bytes] = []
        found = [item for item in described if item is not None]
        with self._lock:
            for where, context in {where: context for _, _, _, where, context in found}.items():
                self._contexts.setdefault(where, context)
                records.extend(context_records(where, context))
            for digest, anchor, length, where, _ in found:
                self._insert(digest, anchor, length, where)
                records.append(DOCUMENT.pack(b"D", anchor, length, digest, where))
            for item, parsed in zip(items, described, strict=True):
                if parsed is not None and (head := parse_head(item)) is not None:
                    self._heads[parsed[0]] = head
                    records.append(HEAD.pack(b"H", parsed[0], head))
            self.rebuilds += 1
        logger.info("document registry rebuilt from the store: %d document(s)", len(found))
        if share and self._shared:
            self._share([REBUILT.pack(b"R", len(found)), *records])
        return len(found)

    def _apply(self, record: bytes) -> bool:
        """Take in one record read from the log (True: a rebuild's mark).

        Anything malformed is ignored, not trusted.
        """
        if record[:1] == b"R" and len(record) == REBUILT.size:
            return True
        if record[:1] == b"D" and len(record) == DOCUMENT.size:
            _, anchor, length, digest, where = DOCUMENT.unpack(record)
            if MIN_CHARS <= length < 1 << 31 and where not in self._stored_behind.get(digest, ()):
                self._insert(digest, anchor, length, where)
        elif record[:1] == b"H" and len(record) == HEAD.size:
            _, digest, head = HEAD.unpack(record)
            if digest in self._documents:  # written right after its document's record
                self._heads[digest] = head
        elif record[:1] == b"C" and len(record) >= CONTEXT.size:
            self._apply_context(record)
        return False

    def _apply_context(self, record: bytes) -> None:
        """Take in one part of a context's text; the last makes it known if it hashes right."""
        _, where, part, parts = CONTEXT.unpack_from(record)
        if where in self._contexts or not part < parts:
            return
        pieces = self._context_parts.setdefault(where, {})
        pieces[part] = record[CONTEXT.size :]
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
            arrays = self._search_arrays()
            tails = self._tail_anchors
            size = len(prompt)
            for anchor_length in list(self._anchor_lengths):
                hashes = window_crc32(prompt, anchor_length)  # every position at once
                for start in self._anchor_starts(hashes, anchor_length, arrays):
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
            for _, _, digest in found:
                self._documents.move_to_end(digest)  # recency only: the anchors are unchanged
            self._anchors_settled = True
        return [Match(start, end) for start, end in non_overlapping(found)]

    def _search_arrays(self) -> dict[int, np.ndarray] | None:
        """Return the known anchor hashes per anchor length, sorted; None while documents change.

        Made on a search when no document was inserted or removed since the previous one, and
        kept until one is; while documents are being added, each position is looked up in the
        anchor table instead (the cost of either follows the prompt's length). Lock held.
        """
        if self._anchor_arrays is None and self._anchors_settled:
            by_length: dict[int, list[int]] = {}
            for anchor, anchor_length in self._anchors:
                by_length.setdefault(anchor_length, []).append(anchor)
            self._anchor_arrays = {
                n: np.unique(np.array(v, dtype=np.uint32)) for n, v in by_length.items()
            }
        return self._anchor_arrays

    def _anchor_starts(
        self, hashes: np.ndarray, anchor_length: int, arrays: dict[int, np.ndarray] | None
    ) -> list[int]:
        """Positions whose window hash is a known anchor of ``anchor_length``. Lock held."""
        if arrays is not None:
            anchors = arrays[anchor_length]
            slots = np.minimum(np.searchsorted(anchors, hashes), len(anchors) - 1)
            return np.flatnonzero(anchors[slots] == hashes).tolist()
        return [
            start
            for start, value in enumerate(hashes.tolist())
            if (value, anchor_length) in self._anchors
        ]

    def anchor_in(
        self, prompt: str, matched: Sequence[tuple[int, int]] = ()
    ) -> tuple[int, int] | None:
        """Find a known document whose first characters, not whole text, are in ``prompt``.

        Returns the first ``(start, length)``: where a full `ANCHOR_CHARS`-character anchor of a
        known document starts, outside the ``matched`` character spans (sorted, as `find`
        returns them), and the longest known document with that anchor; None when none does.
        A document found in ``matched`` (reused: a question quoting its first words is no
        truncated copy), whose whole text starts there (uncached, not truncated), or whose
        first `HEAD_CHARS` characters do not (a question naming its first words) is no near
        miss; a document known from records written before heads were is checked by its
        anchor alone. Nor is text that starts as a matched document does (its first
        `HEAD_CHARS` characters): a label or title echoing the start of a document the prompt
        reuses, such as ``Document [1](Title: X) X is ...``, is no copy of another document
        that starts alike.
        """
        self.refresh()
        hashes = window_crc32(prompt, ANCHOR_CHARS)
        cursor, size = 0, len(prompt)
        reused = {text_digest(prompt[begin:end]) for begin, end in matched}
        echoes = {
            head_hash(prompt[begin : begin + HEAD_CHARS])
            for begin, end in matched
            if end - begin >= HEAD_CHARS
        }
        with self._lock:
            for match_start, match_end in [*matched, (size, size)]:
                for start in range(cursor, max(cursor, match_start - ANCHOR_CHARS + 1)):
                    bucket = self._anchors.get((int(hashes[start]), ANCHOR_CHARS))
                    if bucket and head_hash(prompt[start : start + HEAD_CHARS]) in echoes:
                        continue
                    missed = [
                        length
                        for length, digests in (bucket or {}).items()
                        if self._heads_at(prompt, start, length, digests - reused)
                        and text_digest(prompt[start : start + length]) not in digests
                    ]
                    if missed:
                        return start, max(missed)
                cursor = match_end
        return None

    def _heads_at(self, prompt: str, start: int, length: int, digests: set[bytes]) -> bool:
        """Whether ``prompt`` holds, at ``start``, the head of one of ``digests`` (unknown: yes)."""
        here = head_hash(prompt[start : start + min(length, HEAD_CHARS)])
        return any(self._heads.get(digest, here) == here for digest in digests)

    def _insert(self, digest: bytes, anchor: int, length: int, context: bytes) -> None:
        behind = self._stored_behind.setdefault(digest, [])
        if context in behind:
            behind.remove(context)
        behind.append(context)
        if digest in self._documents:
            self._documents.move_to_end(digest)
            return
        anchor_length = min(length, ANCHOR_CHARS)
        self._anchor_arrays, self._anchors_settled = None, False
        self._documents[digest] = (anchor, length)
        self._anchors.setdefault((anchor, anchor_length), {}).setdefault(length, set()).add(digest)
        self._anchor_lengths[anchor_length] = self._anchor_lengths.get(anchor_length, 0) + 1
        while len(self._documents) > self.capacity:
            old, (old_anchor, old_length) = self._documents.popitem(last=False)
            self._remove(old, old_anchor, old_length)

    def _remove(self, digest: bytes, anchor: int, length: int) -> None:
        self._stored_behind.pop(digest, None)
        self._tail_anchors.pop(digest, None)
        self._heads.pop(digest, None)
        self._anchor_arrays, self._anchors_settled = None, False
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
