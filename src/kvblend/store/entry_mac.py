"""Optional entry authentication: a keyed MAC over an entry's bytes and metadata.

A checksum finds accidental damage (`entry_format`); it does not stop whoever can write the
store folder or the Redis server from planting KV of their choosing: valid checksums, finite
values, wrong answers. With a per-store secret, ``$KVBLEND_STORE_KEY``, every entry a disk or
Redis store writes carries HMAC-SHA256 tags (the standard library's `hmac`) next to the
checksums, in its safetensors metadata:

- ``kvblend.macs``: JSON list of one tag per tensor, in the tensor listing's order, over the
  tensor's name and its bytes;
- ``kvblend.key_id``: the key's fingerprint (`StoreKey.key_id`: 16 hex digits of an HMAC of a
  fixed text under the key, which tells keys apart without revealing them);
- ``kvblend.mac``: one tag over every other metadata item, canonically encoded (as the header
  checksum is): the key the entry was written under, the key id, the tensor listing (names,
  dtypes, shapes, checksums), the tensor tags and the caller's metadata.

A store that has the key checks the header when it opens an entry, before any tensor is read
(`verify_header`), and tells three cases apart:

- **another key's entry**: it names another key id. Not damage: a miss for this store,
  left in place for the processes of its key (`OtherKeyEntry`, raised as
  `kvblend.store.base.OtherStoreKeyError`);
- **an entry this store may replace**: it carries no tag (written without a key), or carries
  one that does not verify and names no key id (written before entries named their key: of
  another key, or forged, which nothing can tell apart): also a miss, left in place, and
  written over when this store stores the entry again;
- **a forged or damaged entry under this key**: it names this key's id and its tag does not
  verify. Corrupt: dropped and counted, and its metadata is never trusted (the engine's
  registry is rebuilt from it).

The key id is in the header the checksum covers, so damage to it is found as damage; someone
who can write the store can claim any id, but an entry is only ever used when its tag verifies
under the reader's key. Each tensor is then checked against its own tag as it is read, in place
of its checksum (the tag finds the same accidental damage). A store without a key reads every
entry, with tags or not, by its checksums only.

The key is the variable's value, surrounding white space removed, at least `MIN_KEY_CHARS`
characters; its UTF-8 bytes are the HMAC key. A random one: ``openssl rand -hex 32`` (64 hex
digits, 256 bits). It is never printed: a `StoreKey` shows as ``StoreKey(***)``.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

__all__ = [
    "MAC_ITEM",
    "OtherKeyEntry",
    "OtherKeyWarnings",
    "KEY_ID_ITEM",
    "MIN_KEY_CHARS",
    "STORE_KEY_ENV",
    "TENSOR_MACS_ITEM",
    "StoreKey",
    "load_store_key",
    "verify_header",
]

#: Environment variable holding the store's secret (unset or empty: entries carry no MAC).
STORE_KEY_ENV = "KVBLEND_STORE_KEY"
#: Shortest secret accepted: 32 characters (128 bits as hex digits).
MIN_KEY_CHARS = 32
#: Metadata item holding the tag over every other item.
MAC_ITEM = "kvblend.mac"
#: Metadata item holding the tensors' tags (a JSON list, in listing order).
TENSOR_MACS_ITEM = "kvblend.macs"
#: Metadata item holding the fingerprint of the key an entry was signed with.
KEY_ID_ITEM = "kvblend.key_id"
_HEADER_CHECKSUM_ITEM = "kvblend.header_checksum"
_DIGEST = "sha256"


class OtherKeyEntry(ValueError):
    """The entry was not signed with the reader's key: not damage (see the module's doc).

    `replaceable`: the entry names no key id (unsigned, or of an earlier version), so the
    reader may write over it; an entry naming another key's id is left to that key.
    """

    def __init__(self, reason: str, *, replaceable: bool) -> None:
        super().__init__(reason)
        self.replaceable = replaceable


class StoreKey:
    """A store's secret: computes the tags of an entry's tensors and of its metadata."""

    __slots__ = ("_secret", "key_id")

    def __init__(self, secret: bytes) -> None:
        self._secret = bytes(secret)
        #: The key's fingerprint, written into every entry it signs: 16 hex digits of an HMAC
        #: of a fixed text under the key (tells keys apart, reveals nothing of the key).
        self.key_id = hmac.new(self._secret, b"kvblend-key-id", _DIGEST).hexdigest()[:16]

    def __repr__(self) -> str:
        return "StoreKey(***)"

    def tensor_tag(self, name: str, data: bytes | memoryview) -> str:
        """Tag of tensor `name` holding the bytes `data` (hex)."""
        mac = self.tensor_mac(name)
        mac.update(data)
        return mac.hexdigest()

    def tensor_mac(self, name: str) -> hmac.HMAC:
        """Return an HMAC of tensor `name` to feed its bytes in pieces (`tensor_tag`: at once)."""
        return hmac.new(self._secret, b"kvblend-tensor\0" + name.encode() + b"\0", _DIGEST)

    def header_tag(self, metadata: Mapping[str, str]) -> str:
        """Tag of every metadata item but the tag itself and the header checksum (hex)."""
        items = {k: v for k, v in metadata.items() if k not in (MAC_ITEM, _HEADER_CHECKSUM_ITEM)}
        encoded = json.dumps(items, sort_keys=True, ensure_ascii=True).encode()
        return hmac.new(self._secret, b"kvblend-header\0" + encoded, _DIGEST).hexdigest()

    def sign(self, metadata: dict[str, str], tags: list[str]) -> None:
        """Add the tensor tags `tags` (listing order), the key id and the header tag."""
        metadata[TENSOR_MACS_ITEM] = json.dumps(tags, separators=(",", ":"))
        metadata[KEY_ID_ITEM] = self.key_id
        metadata[MAC_ITEM] = self.header_tag(metadata)


logger = logging.getLogger(__name__)


class OtherKeyWarnings:
    """Counts the entries of another store key a store met; says so once, in one line each.

    One warning for entries of another key, one for entries written without a key (or by an
    earlier version), per store object; the rest are counted (`count`, the store's
    `stats().other_key`) and logged at debug level.
    """

    def __init__(self, where: str) -> None:
        self.where = where
        self.count = 0
        self._said: set[bool] = set()
        self._lock = threading.Lock()

    def found(self, error: Any) -> None:  # noqa: ANN401 - a kvblend.store.base.OtherStoreKeyError
        """Count `error`'s entry and warn about the first of its kind."""
        with self._lock:
            self.count += 1
            first = error.replaceable not in self._said
            self._said.add(error.replaceable)
        if error.replaceable:
            advice = (
                "it is a miss here, and written over when this process stores that entry "
                "(signed with its key)"
            )
        else:
            advice = (
                "the store holds entries of another key: they are misses here and left in "
                "place for the processes of that key. Give this process the key the store "
                f"was written with (${STORE_KEY_ENV}), or remove them with `kvblend store "
                "clear --other-keys`"
            )
        message = f"{self.where}: {error}: {advice} (further ones are counted in other_key)"
        (logger.warning if first else logger.debug)(message)


def load_store_key(value: str | None = None) -> StoreKey | None:
    """Return the store key `value`, else ``$KVBLEND_STORE_KEY``; None when neither is set.

    Raises `ValueError` (without the key in the message) for a key shorter than
    `MIN_KEY_CHARS` characters.
    """
    raw = (value if value is not None else os.environ.get(STORE_KEY_ENV, "")).strip()
    if not raw:
        return None
    if len(raw) < MIN_KEY_CHARS:
        raise ValueError(
            f"the KV store key ({STORE_KEY_ENV}) has {len(raw)} characters; use at least "
            f"{MIN_KEY_CHARS}, e.g. 64 hex digits from `openssl rand -hex 32`"
        )
    return StoreKey(raw.encode("utf-8"))


def verify_header(key: StoreKey, metadata: Mapping[str, str], tensors: int) -> list[str]:
    """Check the header tag of `metadata`; return the tags of its `tensors` tensors.

    Raises `OtherKeyEntry` for an entry of another key (or none, or of an earlier version
    whose tag does not verify), and `ValueError` saying why for an entry under this key whose
    tag does not verify (forged or damaged) or whose tensor tag list does not fit the listing.
    """
    found = metadata.get(MAC_ITEM)
    if found is None:
        raise OtherKeyEntry(f"was written without a store key ({STORE_KEY_ENV})", replaceable=True)
    entry_id = metadata.get(KEY_ID_ITEM)
    if entry_id is not None and entry_id != key.key_id:
        raise OtherKeyEntry(
            f"is signed with another store key (key id {entry_id[:16]!r}, this store's "
            f"{key.key_id!r})",
            replaceable=False,
        )
    if not hmac.compare_digest(found.encode(), key.header_tag(metadata).encode()):
        if entry_id is None:
            raise OtherKeyEntry(
                "is signed with another store key, or forged (written by an earlier version, "
                "which did not name its key)",
                replaceable=True,
            )
        raise ValueError("MAC mismatch under this store's key: forged or damaged")
    tags = json.loads(metadata.get(TENSOR_MACS_ITEM, "null"))
    if (
        not isinstance(tags, list)
        or len(tags) != tensors
        or not all(isinstance(tag, str) for tag in tags)
    ):
        raise ValueError("the tensor MACs do not match the tensor listing")
    return tags
