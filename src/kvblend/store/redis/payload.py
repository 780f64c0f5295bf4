"""One Redis entry read by byte ranges, for `RedisKVStore`: the head at once, each tensor on use.

`RedisKVStore.get()` fetches an entry's length and its first 64 KiB (which hold the header) in
one round trip; `RangePayload` serves reads inside that head from memory and any other range
with one ``GETRANGE``, so each tensor crosses the network only when (and if) it is read. The
entry is not locked on the server: another process may replace it (``force=True``) or the
server may evict it while it is read. A range cut short says so at once; a tensor whose bytes
fail their checksum is checked against the server (`replaced`: is the header there still the
one read?). Either way the read raises `EntryReplacedError` and the lookup counts as a miss,
never as damage.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from kvblend.store.base import EntryReplacedError, StoreError
from kvblend.store.entry_format import Payload, checksum

__all__ = ["RangePayload"]

#: Runs one server operation for the store (mapping its errors): ``call(action, operation)``.
Call = Callable[[str, Callable[[], Any]], Any]


class RangePayload(Payload):
    """The entry under `redis_key` of `size` bytes, whose first bytes `head` are fetched.

    `call` runs a server operation through the store, `client` is its redis-py client, and
    `on_replaced` is called once if the entry turns out replaced while it was read.
    """

    def __init__(
        self,
        call: Call,
        client: Any,  # noqa: ANN401 - a redis.Redis; redis is imported by the store
        redis_key: str,
        size: int,
        head: bytes,
        on_replaced: Callable[[], None],
    ) -> None:
        self._call = call
        self._client = client
        self._redis_key = redis_key
        self._head = head
        self._on_replaced = on_replaced
        self._lock = threading.Lock()
        self._closed = self._replaced = False
        self.size = size
        self.identity = "redis:" + checksum(head)
        self.header = b""  # the entry's header bytes, set once they are parsed

    def replaced(self) -> bool:
        """Whether the server holds another value (or none) under the key than the one read."""
        end = len(self.header) - 1
        current = self._call(
            f"check entry {self._redis_key!r}",
            lambda: bytes(self._client.getrange(self._redis_key, 0, end)),
        )
        if current == self.header:
            return False
        self._mark_replaced()
        return True

    def _mark_replaced(self) -> None:
        with self._lock:
            first, self._replaced = not self._replaced, True
        if first:
            self._on_replaced()

    def read_into(self, offset: int, buffer: memoryview) -> int:
        """Fill `buffer` from `offset` (from the fetched head, else one GETRANGE)."""
        with self._lock:
            if self._closed:
                raise StoreError("read from a closed KV store entry")
        end = min(offset + len(buffer), self.size)
        if end <= offset:
            return 0
        if end <= len(self._head):
            chunk = self._head[offset:end]
        else:
            chunk = self._call(
                f"read entry {self._redis_key!r}",
                lambda: bytes(self._client.getrange(self._redis_key, offset, end - 1)),
            )
            if len(chunk) < end - offset:
                self._mark_replaced()
                raise EntryReplacedError(self._redis_key, "evicted or replaced while read")
        buffer[: len(chunk)] = chunk
        return len(chunk)

    def close(self) -> None:
        """Forget the fetched head; later reads raise `StoreError`."""
        with self._lock:
            self._closed = True
            self._head = b""
