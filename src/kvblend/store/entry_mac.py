"""Optional entry authentication: a keyed MAC over an entry's bytes and metadata.

A checksum finds accidental damage (`entry_format`); it does not stop whoever can write the
store folder or the Redis server from planting KV of their choosing: valid checksums, finite
values, wrong answers. With a per-store secret, ``$KVBLEND_STORE_KEY``, every entry a disk or
Redis store writes carries HMAC-SHA256 tags (the standard library's `hmac`) next to the
checksums, in its safetensors metadata:

- ``kvblend.macs``: JSON list of one tag per tensor, in the tensor listing's order, over the
  tensor's name and its bytes;
- ``kvblend.mac``: one tag over every other metadata item, canonically encoded (as the header
  checksum is): the key the entry was written under, the tensor listing (names, dtypes, shapes,
  checksums), the tensor tags and the caller's metadata.

A store that has the key checks ``kvblend.mac`` when it opens an entry, before any tensor is
read: an entry without one (written by a store without the key) or whose tag does not verify
(forged, or written with another key) is corrupt, so it is dropped, counted and reported as a
miss, and its metadata is never trusted either (the engine's registry is rebuilt from it). Each
tensor is then checked against its own tag as it is read, in place of its checksum (the tag
finds the same accidental damage). A store without a key reads every entry, with tags or not,
by its checksums only.

The key is the variable's value, surrounding white space removed, at least `MIN_KEY_CHARS`
characters; its UTF-8 bytes are the HMAC key. A random one: ``openssl rand -hex 32`` (64 hex
digits, 256 bits). It is never printed: a `StoreKey` shows as ``StoreKey(***)``.
"""

from __future__ import annotations

import hmac
import json
import os
from collections.abc import Mapping

__all__ = [
    "MAC_ITEM",
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
_HEADER_CHECKSUM_ITEM = "kvblend.header_checksum"
_DIGEST = "sha256"


class StoreKey:
    """A store's secret: computes the tags of an entry's tensors and of its metadata."""

    __slots__ = ("_secret",)

    def __init__(self, secret: bytes) -> None:
        self._secret = bytes(secret)

    def __repr__(self) -> str:
        return "StoreKey(***)"

    def tensor_tag(self, name: str, data: bytes | memoryview) -> str:
        """Tag of tensor `name` holding the bytes `data` (hex)."""
        mac = hmac.new(self._secret, b"kvblend-tensor\0" + name.encode() + b"\0", _DIGEST)
        mac.update(data)
        return mac.hexdigest()

    def header_tag(self, metadata: Mapping[str, str]) -> str:
        """Tag of every metadata item but the tag itself and the header checksum (hex)."""
        items = {k: v for k, v in metadata.items() if k not in (MAC_ITEM, _HEADER_CHECKSUM_ITEM)}
        encoded = json.dumps(items, sort_keys=True, ensure_ascii=True).encode()
        return hmac.new(self._secret, b"kvblend-header\0" + encoded, _DIGEST).hexdigest()

    def sign(self, metadata: dict[str, str], tags: list[str]) -> None:
        """Add the tensor tags `tags` (listing order) and the header tag to `metadata`."""
        metadata[TENSOR_MACS_ITEM] = json.dumps(tags, separators=(",", ":"))
        metadata[MAC_ITEM] = self.header_tag(metadata)


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

    Raises `ValueError` saying why when the entry carries no tag, a tag that does not verify,
    or a tensor tag list that does not fit the listing.
    """
    found = metadata.get(MAC_ITEM)
    if found is None:
        raise ValueError(f"no MAC: written without the store key ({STORE_KEY_ENV})")
    if not hmac.compare_digest(found.encode(), key.header_tag(metadata).encode()):
        raise ValueError("MAC mismatch: not written with this store's key (forged?)")
    tags = json.loads(metadata.get(TENSOR_MACS_ITEM, "null"))
    if (
        not isinstance(tags, list)
        or len(tags) != tensors
        or not all(isinstance(tag, str) for tag in tags)
    ):
        raise ValueError("the tensor MACs do not match the tensor listing")
    return tags
