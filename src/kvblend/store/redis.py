"""`RedisKVStore`: entries on a Redis server, shared by every process and machine that uses it.

Each entry is one Redis string holding exactly the bytes the disk tier writes (safetensors with
per-tensor CRC-32, see `entry_format`), under ``<prefix>kv:v<format>:<key>``: nothing is
pickled, and a damaged or foreign value is detected and dropped like on disk. `get()` costs one
round trip (the entry's length and its first 64 KiB, which hold the header) and returns a
`LazyTensors`; each tensor is then fetched with its own ``GETRANGE`` on the store's prefetch
threads, so the blend loop starts on layer 0 while later layers are still on the wire.

Redis bounds the size itself: ``maxmemory`` with ``maxmemory-policy allkeys-lru`` (or
``volatile-lru`` with `ttl_s`) evicts old entries; with ``noeviction`` a full server refuses
writes, which `put()` reports as `StoreError`. `ttl_s` sets an expiry on every entry, renewed
on each hit.

Record logs (`append_records` / `read_records`) live on the server too, as a counter and a list
per log changed by Lua scripts (`kvblend.store.redis_records`), so every process sees one
sequence.

Failures: every server error is raised as `StoreError` (`RemoteUnavailableError` when the server
cannot be reached, which the store logs itself, at most once a minute). After a connection error
or timeout the store stops asking the server for `retry_after_s` (doubling up to
`max_retry_after_s`) and fails fast meanwhile, so a dead server costs one timeout per back-off
period, not one per request; redis-py opens a new connection on the next attempt.
`RemoteTieredKVStore` turns these errors into misses and warnings.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar, cast

import torch

from kvblend.store.base import (
    CorruptEntryError,
    EntrySpec,
    KVStore,
    RemoteUnavailableError,
    StoreError,
    StoreStats,
    validate_entry,
    validate_key,
)
from kvblend.store.entry_format import (
    FORMAT_VERSION,
    EntryHeader,
    Payload,
    check_expected,
    checksum,
    encode_entry,
    read_header,
)
from kvblend.store.lazy import LazyTensors, PrefetchPool, lazy_entry
from kvblend.store.records import DEFAULT_MAX_RECORDS
from kvblend.store.redis_access import redacted, warn_if_open
from kvblend.store.redis_records import RedisRecordLogs

try:
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry
except ImportError as _missing:  # pragma: no cover - depends on the installed extras
    raise ImportError(
        "the Redis tier needs the redis package: pip install 'kvblend[redis]'"
    ) from _missing

logger = logging.getLogger(__name__)

#: Environment variable naming the Redis server of the default store (``redis://...``).
REDIS_URL_ENV = "KVBLEND_REDIS_URL"
DEFAULT_PREFIX = "kvblend:"
#: Bytes fetched with the entry length on `get()`; headers of engine entries are a few KiB.
_HEAD_BYTES = 64 << 10
_CONNECTION_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError)
_T = TypeVar("_T")

# Delete an entry only if it still starts with the header that was read: KEYS = entry;
# ARGV = last header byte, header bytes.
_DROP_IF_SAME = """
if redis.call('GETRANGE', KEYS[1], 0, tonumber(ARGV[1])) == ARGV[2] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class _RangePayload(Payload):
    """One entry on the server, read by byte ranges; the first range is already fetched."""

    def __init__(self, store: RedisKVStore, redis_key: str, size: int, head: bytes) -> None:
        self._store = store
        self._redis_key = redis_key
        self._head = head
        self._lock = threading.Lock()
        self._closed = False
        self.size = size
        self.identity = "redis:" + checksum(head)

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
            chunk = self._store._call(
                f"read entry {self._redis_key!r}",
                lambda: cast(bytes, self._store.client.getrange(self._redis_key, offset, end - 1)),
            )
            if len(chunk) < end - offset:
                raise StoreError(f"entry {self._redis_key!r} was evicted or replaced while read")
        buffer[: len(chunk)] = chunk
        return len(chunk)

    def close(self) -> None:
        """Forget the fetched head; later reads raise `StoreError`."""
        with self._lock:
            self._closed = True
            self._head = b""


class RedisKVStore(KVStore):
    """Store on a Redis server (``redis://`` or TLS ``rediss://`` URL, password in the URL).

    `url` defaults to `$KVBLEND_REDIS_URL`; a server off this machine named without a password
    is warned about once (`redis_access.warn_if_open`). Building the store does not connect: a
    server that is down only makes operations raise `StoreError`. `prefix` namespaces every key,
    so several stores (or other applications) can share one server. Thread safe; several
    processes and machines may use one server at once.
    """

    tier_name = "redis"

    def __init__(
        self,
        url: str | None = None,
        *,
        prefix: str = DEFAULT_PREFIX,
        ttl_s: float | None = None,
        socket_timeout_s: float = 2.0,
        connect_timeout_s: float = 1.0,
        retry_after_s: float = 1.0,
        max_retry_after_s: float = 30.0,
        prefetch_ahead: int = 8,
        max_records: int = DEFAULT_MAX_RECORDS,
    ) -> None:
        url = url or os.environ.get(REDIS_URL_ENV)
        if not url:
            raise ValueError(f"no Redis URL: pass url= or set ${REDIS_URL_ENV}")
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0 or None, got {ttl_s}")
        self.url = redacted(url)
        warn_if_open(url)
        self.prefix = prefix
        self.ttl_s = ttl_s
        # One retry on a broken connection (a restarted server); a timeout is not retried.
        self.client = redis.Redis.from_url(
            url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=connect_timeout_s,
            retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
        )
        self._records = RedisRecordLogs(self.client, prefix, max_records)
        self._drop_script = self.client.register_script(_DROP_IF_SAME)
        self._retry_after_s = retry_after_s
        self._max_retry_after_s = max_retry_after_s
        self._prefetch_ahead = prefetch_ahead
        self._pool = PrefetchPool(max_workers=4, name="kvblend-redis")
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._delay = 0.0
        self._last_warning = -float("inf")
        self._hits = self._misses = self._corrupt = 0

    # ------------------------------------------------------------------ availability
    @property
    def available(self) -> bool:
        """False while the store is backing off after a connection failure."""
        return time.monotonic() >= self._down_until

    def _call(self, action: str, operation: Callable[[], _T]) -> _T:
        """Run one server operation; map its errors to `StoreError` and track availability."""
        with self._lock:
            wait = self._down_until - time.monotonic()
        if wait > 0:
            raise RemoteUnavailableError(
                f"Redis at {self.url} unavailable, next attempt in {wait:.1f} s"
            )
        try:
            result = operation()
        except _CONNECTION_ERRORS as error:
            self._failed(error)
            message = f"cannot {action} on Redis at {self.url}: {error}"
            raise RemoteUnavailableError(message) from error
        except redis.RedisError as error:  # refused by the server: OOM, wrong type, ...
            raise StoreError(f"cannot {action} on Redis at {self.url}: {error}") from error
        if self._delay:
            with self._lock:
                recovered, self._delay = self._delay > 0, 0.0
            if recovered:
                logger.warning("KV store Redis tier at %s is available again", self.url)
        return result

    def _failed(self, error: BaseException) -> None:
        now = time.monotonic()
        with self._lock:
            self._delay = min(self._max_retry_after_s, max(self._retry_after_s, 2 * self._delay))
            self._down_until = now + self._delay
            delay = self._delay
            warn = now - self._last_warning >= 60.0
            if warn:
                self._last_warning = now
        log = logger.warning if warn else logger.debug
        log(
            "KV store Redis tier at %s unavailable (%s); using the local tiers, next attempt "
            "in %.1f s",
            self.url,
            error,
            delay,
        )

    # ------------------------------------------------------------------ keys
    def _entry_key(self, key: str) -> str:
        return f"{self.prefix}kv:v{FORMAT_VERSION}:{validate_key(key)}"

    # ------------------------------------------------------------------ entries
    def get(
        self,
        key: str,
        device: torch.device | str | None = None,
        *,
        expect: EntrySpec | None = None,
    ) -> LazyTensors | None:
        """Open the entry under `key` (one round trip); tensors are fetched on access.

        Returns None on a miss or a corrupt entry, or one not as `expect` describes it (dropped
        and counted). Raises `StoreError` if the server cannot be reached.
        """
        opened = self._open(key, expect)
        with self._lock:
            if opened is None:
                self._misses += 1
            else:
                self._hits += 1
        if opened is None:
            return None
        payload, header, header_bytes = opened
        target = torch.device(device) if device is not None else None
        return lazy_entry(
            payload, header, key, target, pool=self._pool, prefetch_ahead=self._prefetch_ahead,
            on_corrupt=lambda error: self._drop_corrupt(key, header_bytes, error),
            finite=expect is not None and expect.finite,
        )  # fmt: skip

    def _open(
        self, key: str, expect: EntrySpec | None = None
    ) -> tuple[_RangePayload, EntryHeader, bytes] | None:
        """Fetch the length and head of `key`'s entry and verify its header (None: a miss)."""
        redis_key = self._entry_key(key)

        def fetch() -> list:
            pipe = self.client.pipeline(transaction=False)
            pipe.strlen(redis_key)
            pipe.getrange(redis_key, 0, _HEAD_BYTES - 1)
            if self.ttl_s is not None:
                pipe.expire(redis_key, int(max(1, self.ttl_s)))
            return pipe.execute()

        size, head = self._call(f"read entry {key!r}", fetch)[:2]
        if not size:
            return None
        head = bytes(head)
        payload = _RangePayload(self, redis_key, int(size), head)
        try:
            header = read_header(payload, key)
            check_expected(header, expect)
        except CorruptEntryError as error:
            self._drop_corrupt(key, head, error)
            return None
        return payload, header, head[: 8 + int.from_bytes(head[:8], "little")]

    def put(
        self, key: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
    ) -> None:
        """Write the entry with one SET (with the TTL, if any); raises `StoreError` on failure."""
        redis_key = self._entry_key(key)
        checked, user_metadata = validate_entry(tensors, metadata)
        data = encode_entry(key, checked, user_metadata)
        expiry = int(max(1, self.ttl_s)) if self.ttl_s is not None else None
        self._call(
            f"write entry {key!r} ({len(data)} bytes)",
            lambda: self.client.set(redis_key, data, ex=expiry),
        )

    def contains(self, key: str) -> bool:
        """Return True if the server holds an entry under `key` (not verified)."""
        redis_key = self._entry_key(key)
        return bool(self._call(f"look up {key!r}", lambda: self.client.exists(redis_key)))

    def delete(self, key: str) -> bool:
        """Remove the entry under `key`; return True if there was one."""
        redis_key = self._entry_key(key)
        return bool(self._call(f"delete {key!r}", lambda: self.client.delete(redis_key)))

    def keys(self) -> list[str]:
        """Return the keys of every entry under this store's prefix (``SCAN``)."""
        start = len(self._entry_key("x")) - 1

        def scan() -> list[str]:
            found = self._scan(f"{self._entry_key('x')[:start]}*")
            return [name.decode("utf-8", "replace")[start:] for name in found]

        return self._call("list the entries", scan)

    def metadata(self, key: str) -> dict[str, str] | None:
        """Return the caller's metadata of `key`, reading only the entry's head."""
        opened = self._open(key)
        return opened[1].metadata if opened is not None else None

    def _drop_corrupt(self, key: str, header: bytes, error: CorruptEntryError) -> None:
        """Count a corrupt entry and delete it, unless it was replaced since it was read."""
        with self._lock:
            self._corrupt += 1
        logger.warning("dropping a corrupt entry of the KV store on %s: %s", self.url, error)
        if not header:
            return
        try:
            self._call(
                f"drop {key!r}",
                lambda: self._drop_script(
                    keys=[self._entry_key(key)], args=[len(header) - 1, header]
                ),
            )
        except StoreError as failure:
            logger.warning("could not drop corrupt entry %r: %s", key, failure)

    # ------------------------------------------------------------------ maintenance
    def _scan(self, pattern: str) -> list[bytes]:
        return list(self.client.scan_iter(match=pattern, count=1000))

    def stats(self) -> StoreStats:
        """Return counters; `entries` and `bytes` are this prefix's entries on the server.

        `evictions` is the server's ``evicted_keys`` (all clients, since it started) and
        `capacity_bytes` its ``maxmemory`` (None when unbounded).
        """

        def read() -> tuple[int, int, int, int]:
            keys = self._scan(f"{self.prefix}kv:*")
            pipe = self.client.pipeline(transaction=False)
            for redis_key in keys:
                pipe.strlen(redis_key)
            sizes = pipe.execute() if keys else []
            info = self.client.info("memory") | self.client.info("stats")
            return (
                len(keys),
                sum(int(size) for size in sizes),
                int(info.get("evicted_keys", 0)),
                int(info.get("maxmemory", 0)),
            )

        entries, volume, evictions, maxmemory = self._call("read statistics", read)
        with self._lock:
            return StoreStats(
                entries=entries,
                bytes=volume,
                hits=self._hits,
                misses=self._misses,
                evictions=evictions,
                corrupt_dropped=self._corrupt,
                capacity_bytes=maxmemory or None,
            )

    def clear(self) -> None:
        """Remove every entry and record log under this store's prefix (other keys are kept)."""

        def remove() -> None:
            keys = self._scan(f"{self.prefix}kv:*") + self._scan(f"{self.prefix}log:*")
            for start in range(0, len(keys), 1000):
                self.client.unlink(*keys[start : start + 1000])

        self._call("clear", remove)

    def close(self) -> None:
        """Stop the prefetch threads and close the connections (reopened on next use)."""
        self._pool.close()
        self.client.connection_pool.disconnect()

    # ------------------------------------------------------------------ record logs
    def append_records(self, log: str, records: Sequence[bytes]) -> None:
        """Append ``records`` to ``log`` on the server, atomically (one Lua script)."""
        checked = RedisRecordLogs.check(log, records)
        self._call("append to a record log", lambda: self._records.append(log, checked))

    def read_records(self, log: str, cursor: int = 0) -> tuple[list[bytes], int]:
        """Return the records of ``log`` after ``cursor`` and the new cursor."""
        RedisRecordLogs.check(log, [])
        return self._call("read a record log", lambda: self._records.read(log, cursor))
