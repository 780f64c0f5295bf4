"""`RedisKVStore`: entries on a Redis server, shared by every process and machine that uses it.

Each entry is one Redis string holding exactly the bytes the disk tier writes (`entry_format`:
safetensors with per-tensor checksums and, with a store key, MACs), under
``<prefix>kv:v<format>:<key>``: nothing is pickled, and a damaged or foreign value is detected
and dropped like on disk. `get()` costs one round trip (the entry's length, its first 64 KiB,
which hold the header, and its expiry), a second one on a hit with `ttl_s` (renewing it only
once the header verified), and returns a `LazyTensors`; each tensor is then fetched with its own
``GETRANGE`` (`payload`) on the store's prefetch threads, so the blend loop starts on
layer 0 while later layers are still on the wire.

Redis bounds the size itself: ``maxmemory`` with ``maxmemory-policy allkeys-lru`` (or
``volatile-lru`` with `ttl_s`) evicts old entries; with ``noeviction`` a full server refuses
writes, which `put()` reports as `StoreError`. `ttl_s` sets an expiry on every entry, renewed
on each verified hit (never by a read that finds the entry damaged or of another key).

An entry signed with another store key (`OtherStoreKeyError`) is a miss, left in place, and
`put()` does not write over it; reading one gives it an expiry of `OTHER_KEY_IDLE_S` (one day)
if it has none, which every verified hit by a process of its own key pushes back to a day at
least: an entry of a key nobody uses any more expires, and the key's slot is then free for
this store's own entry.

Record logs (`append_records` / `read_records`) live on the server too, as a counter and a list
per log changed by Lua scripts (`kvblend.store.redis.record_logs`), so every process sees one
sequence.

Failures: every server error is raised as `StoreError` (`RemoteUnavailableError` when the server
cannot be reached, which the store logs itself, at most once a minute). The first connection
error or timeout (`socket_timeout_s`) takes the server out: every later request fails at once,
without touching the network, until a background ``PING`` (after `retry_after_s`, doubling up
to `max_retry_after_s`) is answered (`health`). So a dead or stalled server costs one
timeout, not one per request. An entry replaced or evicted while it is read is a miss
(`EntryReplacedError`), never counted as damage. `RemoteTieredKVStore` turns these errors into
misses and warnings.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from kvblend.store.base import (
    CorruptEntryError,
    EntrySpec,
    KVStore,
    OtherStoreKeyError,
    RemoteUnavailableError,
    StoreError,
    StoreStats,
    validate_entry,
    validate_key,
)
from kvblend.store.entry_format import (
    FORMAT_VERSION,
    EntryHeader,
    check_expected,
    encode_entry,
    read_header,
)
from kvblend.store.entry_mac import OtherKeyWarnings, load_store_key
from kvblend.store.lazy import LazyTensors, PrefetchPool, lazy_entry
from kvblend.store.record_logs import DEFAULT_MAX_RECORDS
from kvblend.store.redis.access import redacted, warn_if_open
from kvblend.store.redis.health import RedisHealth
from kvblend.store.redis.payload import RangePayload
from kvblend.store.redis.record_logs import RedisRecordLogs

try:
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry
except ImportError as _missing:  # pragma: no cover - depends on the installed extras
    raise ImportError(
        "the Redis tier needs the redis package: pip install 'redis>=5' 'hiredis>=3' (the redis "
        "extra; from a clone of kvblend: pip install -e '.[redis]')"
    ) from _missing

logger = logging.getLogger(__name__)

#: Environment variable naming the Redis server of the default store (``redis://...``).
REDIS_URL_ENV = "KVBLEND_REDIS_URL"
DEFAULT_PREFIX = "kvblend:"
#: Bytes fetched with the entry length on `get()`; headers of engine entries are a few KiB.
_HEAD_BYTES = 64 << 10
_CONNECTION_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError)
#: Reads of an entry's head before one that does not parse is taken for damage.
_OPEN_ATTEMPTS = 3
#: Expiry given to an entry of another store key when it is read (renewed by its key's hits).
OTHER_KEY_IDLE_S = 24 * 3600
_T = TypeVar("_T")

# Delete an entry only if it still starts with the header that was read: KEYS = entry;
# ARGV = last header byte, header bytes.
_DROP_IF_SAME = """
if redis.call('GETRANGE', KEYS[1], 0, tonumber(ARGV[1])) == ARGV[2] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class RedisKVStore(KVStore):
    """Store on a Redis server (``redis://`` or TLS ``rediss://`` URL, password in the URL).

    `url` defaults to `$KVBLEND_REDIS_URL`; only its redacted form is kept (`url`), and a server
    off this machine named without a password is warned about once
    (`kvblend.store.redis.access.warn_if_open`). Building the store does not connect: a server
    that is down only makes operations raise `StoreError`, and after the first timeout they fail
    at once until `health` sees the server answer. `prefix` namespaces every key, so several
    stores (or other applications) can share one server. `store_key` (default
    ``$KVBLEND_STORE_KEY``) signs entries and refuses unsigned ones (`kvblend.store.entry_mac`).
    Thread safe; several processes and machines may use one server at once.
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
        store_key: str | None = None,
    ) -> None:
        url = url or os.environ.get(REDIS_URL_ENV)
        if not url:
            raise ValueError(f"no Redis URL: pass url= or set ${REDIS_URL_ENV}")
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0 or None, got {ttl_s}")
        self._store_key = load_store_key(store_key)
        self.url = redacted(url)
        self._other_key = OtherKeyWarnings(f"the KV store on {self.url}")
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
        self.health = RedisHealth(self.url, self.client.ping, retry_after_s, max_retry_after_s)
        self._prefetch_ahead = prefetch_ahead
        self._pool = PrefetchPool(max_workers=4, name="kvblend-redis")
        self._lock = threading.Lock()
        self._hits = self._misses = self._corrupt = 0

    # ------------------------------------------------------------------ availability
    @property
    def available(self) -> bool:
        """False from a connection failure until a background check sees the server answer."""
        return self.health.available

    def _call(self, action: str, operation: Callable[[], _T]) -> _T:
        """Run one server operation; map its errors to `StoreError` and track availability."""
        self.health.check(action)
        try:
            return operation()
        except _CONNECTION_ERRORS as error:
            self.health.failed(error)
            message = f"cannot {action} on Redis at {self.url}: {error}"
            raise RemoteUnavailableError(message) from error
        except redis.RedisError as error:  # refused by the server: OOM, wrong type, ...
            raise StoreError(f"cannot {action} on Redis at {self.url}: {error}") from error

    def _count_replaced(self) -> None:
        """Count a lookup whose entry was replaced while it was read as a miss, not a hit."""
        with self._lock:
            self._hits -= 1
            self._misses += 1

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
        opened = self._open(key, expect, touch=True)
        with self._lock:
            if opened is None:
                self._misses += 1
            else:
                self._hits += 1
        if opened is None:
            return None
        payload, header = opened
        target = torch.device(device) if device is not None else None
        return lazy_entry(
            payload,
            header,
            key,
            target,
            pool=self._pool,
            prefetch_ahead=self._prefetch_ahead,
            on_corrupt=lambda error: self._drop_corrupt(key, payload.header, error),
            finite=expect is not None and expect.finite,
            replaced=payload.replaced,
        )

    def _open(
        self, key: str, expect: EntrySpec | None = None, *, touch: bool = False
    ) -> tuple[RangePayload, EntryHeader] | None:
        """Fetch the length and head of `key`'s entry and verify its header (None: a miss).

        The length and the head are two commands: an entry replaced between them reads as
        damaged, so a damaged head is fetched again, and only one that reads the same twice is
        corrupt (dropped and counted). An entry of another store key is a miss, left in place
        (`_other_key_found`). With `touch` (a lookup), a verified hit renews the entry's expiry.
        """
        redis_key = self._entry_key(key)

        def fetch() -> tuple[int, bytes, int]:
            pipe = self.client.pipeline(transaction=False)
            pipe.strlen(redis_key)
            pipe.getrange(redis_key, 0, _HEAD_BYTES - 1)
            pipe.pttl(redis_key)
            size, head, pttl = pipe.execute()
            return int(size), bytes(head), int(pttl)

        fetched = self._call(f"read entry {key!r}", fetch)
        for attempt in range(_OPEN_ATTEMPTS):
            size, head, pttl = fetched
            if not size:
                return None
            payload = RangePayload(
                self._call, self.client, redis_key, size, head, on_replaced=self._count_replaced
            )
            try:
                header = read_header(payload, key, self._store_key)
                check_expected(header, expect)
            except CorruptEntryError as error:
                again = self._call(f"read entry {key!r}", fetch)
                if again[:2] != fetched[:2] and attempt + 1 < _OPEN_ATTEMPTS:
                    fetched = again  # replaced while read: read the new value
                    continue
                self._drop_corrupt(key, head, error)
                return None
            except OtherStoreKeyError as error:
                self._other_key_found(redis_key, error)
                return None
            payload.header = head[: 8 + int.from_bytes(head[:8], "little")]
            if touch:
                self._renew(key, redis_key, pttl)
            return payload, header
        return None

    def _renew(self, key: str, redis_key: str, pttl: int) -> None:
        """After a verified hit: renew `ttl_s`, or push an other-key expiry back to a day."""
        try:
            if self.ttl_s is not None:
                seconds = int(max(1, self.ttl_s))
                self._call(f"renew {key!r}", lambda: self.client.expire(redis_key, seconds))
            elif pttl >= 0:  # an expiry a reader of another key gave it: its key still uses it
                self._call(
                    f"renew {key!r}",
                    lambda: self.client.expire(redis_key, OTHER_KEY_IDLE_S, gt=True),
                )
        except StoreError as error:  # the hit stands
            logger.debug("could not renew entry %r: %s", key, error)

    def _other_key_found(self, redis_key: str, error: OtherStoreKeyError) -> None:
        """Count and report another key's entry; give it an expiry if it has none.

        Its key's verified hits keep pushing that expiry back (`_renew`), so only an entry
        nobody of its key reads any more expires.
        """
        self._other_key.found(error)
        if error.replaceable:
            return  # written over by this store's own entry
        try:
            self._call(
                "age an entry of another store key",
                lambda: self.client.expire(redis_key, OTHER_KEY_IDLE_S, nx=True),
            )
        except StoreError as failure:
            logger.debug("could not give %s an expiry: %s", redis_key, failure)

    def put(
        self, key: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
    ) -> None:
        """Write the entry with one SET (with the TTL, if any); raises `StoreError` on failure."""
        redis_key = self._entry_key(key)
        checked, user_metadata = validate_entry(tensors, metadata)
        data = encode_entry(key, checked, user_metadata, self._store_key)
        if self._store_key is not None:
            self._refuse_other_key(key, redis_key)
        expiry = int(max(1, self.ttl_s)) if self.ttl_s is not None else None
        self._call(
            f"write entry {key!r} ({len(data)} bytes)",
            lambda: self.client.set(redis_key, data, ex=expiry),
        )

    def _refuse_other_key(self, key: str, redis_key: str) -> None:
        """Raise `OtherStoreKeyError` if the server holds another key's entry under `key`."""

        def fetch() -> tuple[int, bytes]:
            pipe = self.client.pipeline(transaction=False)
            pipe.strlen(redis_key)
            pipe.getrange(redis_key, 0, _HEAD_BYTES - 1)
            size, head = pipe.execute()
            return int(size), bytes(head)

        size, head = self._call(f"read entry {key!r}", fetch)
        if not size:
            return
        payload = RangePayload(self._call, self.client, redis_key, size, head, lambda: None)
        try:
            read_header(payload, key, self._store_key)
        except OtherStoreKeyError as error:
            if not error.replaceable:
                self._other_key.found(error)
                raise OtherStoreKeyError(key, f"not written: {error.reason}") from None
        except CorruptEntryError:
            pass  # written over
        finally:
            payload.close()

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
                other_key=self._other_key.count,
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
        self.health.close()
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
