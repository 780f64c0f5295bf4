"""What the document registry writes: the records of its log and a store entry's document metadata.

A document record holds hashes, not text: a 32-bit hash of the document's first characters (its
anchor, `ANCHOR_CHARS` of them), its length, a 128-bit hash of the whole text and one of its
context; a head record, a 32-bit hash of its first `HEAD_CHARS` characters (for near misses).
A context's text is recorded once, in context records (split in parts when long). A rebuild's
mark says the log was rebuilt from the store's entries, which name their document in their
metadata (`document_metadata`) so that a lost log can be rebuilt from them.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from collections.abc import Mapping

#: Characters hashed as a document's anchor (shorter documents use their whole text).
ANCHOR_CHARS = 16
#: Documents shorter than this are not registered: too short to be worth a cache entry.
MIN_CHARS = 8
#: Characters of a document's head: a prompt holding a known document's anchor is said to hold
#: a truncated copy of it only when it also holds this many of its first characters (so a
#: question that names a document's first words is no near miss).
HEAD_CHARS = 32

DOCUMENT = struct.Struct("<cIQ16s16s")  # b"D", anchor hash, length, text digest, context digest
CONTEXT = struct.Struct("<c16sHH")  # b"C", context digest, part, parts; then the part's bytes
CONTEXT_PART_BYTES = 4000  # a record log takes records of at most 4096 bytes
REBUILT = struct.Struct("<cQ")  # b"R", documents found: the log was rebuilt from the store
HEAD = struct.Struct("<c16sI")  # b"H", text digest, hash of its first HEAD_CHARS characters


def text_digest(text: str) -> bytes:
    """128-bit content hash of ``text`` (UTF-8, surrogates escaped)."""
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def anchor_hash(text: str) -> int:
    """Return the 32-bit hash of ``text``'s anchor: its first `ANCHOR_CHARS` characters."""
    return zlib.crc32(text[:ANCHOR_CHARS].encode("utf-8", "surrogatepass"))


def head_hash(text: str) -> int:
    """Return the 32-bit hash of ``text``'s first `HEAD_CHARS` characters."""
    return zlib.crc32(text[:HEAD_CHARS].encode("utf-8", "surrogatepass"))


def context_records(where: bytes, context: str) -> list[bytes]:
    """Return records carrying a context's text, in parts small enough for a record log."""
    data = context.encode("utf-8", "surrogatepass")
    parts = max(1, -(-len(data) // CONTEXT_PART_BYTES))
    return [
        CONTEXT.pack(b"C", where, index, parts)
        + data[index * CONTEXT_PART_BYTES : (index + 1) * CONTEXT_PART_BYTES]
        for index in range(parts)
    ]


def document_metadata(text: str, context: str) -> dict[str, str]:
    """Entry metadata naming the document an entry holds (hashes, not text) and its context.

    Stored with every entry of a known document (precomputed, computed during a prefill or
    recomputed after a damaged read), so the registry can be rebuilt from the store's own
    entries (`DocumentRegistry.rebuild`) when its log is lost.
    """
    return {
        "document.digest": text_digest(text).hex(),
        "document.anchor": str(anchor_hash(text)),
        "document.chars": str(len(text)),
        "document.context": context,
        "document.head": str(head_hash(text)),
    }


def parse_document_metadata(
    metadata: Mapping[str, str],
) -> tuple[bytes, int, int, bytes, str] | None:
    """Parse what `document_metadata` stored: (digest, anchor, length, context digest, context).

    None for an entry that names no document (a prompt head, a segment passed in a list and
    never registered) or names one in a way `document_metadata` never writes.
    """
    try:
        digest = bytes.fromhex(metadata["document.digest"])
        anchor, length = int(metadata["document.anchor"]), int(metadata["document.chars"])
        context = metadata["document.context"]
    except (KeyError, ValueError, TypeError):
        return None
    if len(digest) != 16 or not 0 <= anchor < 1 << 32 or not MIN_CHARS <= length < 1 << 31:
        return None
    return digest, anchor, length, text_digest(context), context


def parse_head(metadata: Mapping[str, str]) -> int | None:
    """Return the head hash `document_metadata` stored (None: an entry from before heads)."""
    try:
        head = int(metadata["document.head"])
    except (KeyError, ValueError, TypeError):
        return None
    return head if 0 <= head < 1 << 32 else None
