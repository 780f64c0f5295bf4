"""Record logs on a Redis server: a counter and a list per log, changed only by Lua scripts.

The semantics are those of `kvblend.store.record_logs` (sequence numbers from 1, a cursor is the
last number a reader has seen, the oldest records dropped past ``max_records``, a cleared log
starts again). A log is two keys, ``<prefix>log:{<name>}:head`` (the last sequence number) and
``<prefix>log:{<name>}:records`` (the records kept, oldest first); the name in braces is a
Redis Cluster hash tag, so both keys live on one node. Appends and reads are Lua scripts, which
Redis runs atomically: concurrent appenders from any machine get one sequence, and a reader
never sees a counter and a list that disagree. A log whose keys hold anything an append did not
write (a garbage counter, a key of another type, a list longer than its counter says: an evicted
counter) is deleted by the next read or append, never trusted, and starts again (readers with a
newer cursor restart, as after a clear; the engine's registry then rebuilds itself from the
store's entries).

Commands: ``EVALSHA`` (and ``SCRIPT LOAD``/``EVAL`` when the server lacks the script) running
``GET``, ``SET``, ``DEL``, ``LLEN``, ``RPUSH``, ``LTRIM`` and ``LRANGE`` on the two keys of a log;
`docs/deployment.md` lists them as an ACL. Without them (an ACL user without scripting) every
call raises, and the registry falls back to the store's entries.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvblend.store.record_logs import DEFAULT_MAX_RECORDS, _validate_records, validate_log_name

__all__ = ["RedisRecordLogs"]

# The head of a log (KEYS = counter, list): its last sequence number, or nil when either key holds
# something no append wrote (a garbage counter, a key of another type, more records than the
# counter counts: an evicted counter). A damaged log is deleted, never trusted: it starts again.
_HEAD = """
local function log_head()
  local raw = redis.pcall('GET', KEYS[1])
  local kept = redis.pcall('LLEN', KEYS[2])
  local head = 0
  if raw then head = type(raw) == 'string' and tonumber(raw) or nil end
  if head == nil or head < 0 or head >= 9007199254740992 or head ~= math.floor(head)
      or type(kept) ~= 'number' or kept > head then
    redis.call('DEL', KEYS[1], KEYS[2])
    return 0, true
  end
  return head, false
end
"""
# KEYS = counter, list; ARGV = max records, records... Returns the new last sequence number.
_APPEND = (
    _HEAD
    + """
local head = log_head()
for i = 2, #ARGV, 1000 do
  redis.call('RPUSH', KEYS[2], unpack(ARGV, i, math.min(i + 999, #ARGV)))
end
redis.call('LTRIM', KEYS[2], -tonumber(ARGV[1]), -1)
head = head + #ARGV - 1
redis.call('SET', KEYS[1], head)
return head
"""
)
# KEYS = counter, list; ARGV = cursor. Returns {last sequence number, records after cursor...}.
_READ = (
    _HEAD
    + """
local head, damaged = log_head()
if damaged then return {0} end
local cursor = tonumber(ARGV[1])
if cursor == head then return {head} end
local kept = redis.call('LLEN', KEYS[2])
local first = head - kept + 1
local start = first
if cursor < head then start = math.max(cursor + 1, first) end
local found = redis.call('LRANGE', KEYS[2], start - first, -1)
table.insert(found, 1, head)
return found
"""
)


class RedisRecordLogs:
    """Record logs under ``prefix`` on the server `client` (a `redis.Redis`) talks to.

    Methods raise redis-py's errors as they are; `RedisKVStore` maps them to `StoreError`.
    """

    def __init__(self, client: Any, prefix: str, max_records: int = DEFAULT_MAX_RECORDS) -> None:
        self.prefix = prefix
        self.max_records = max_records
        self._append = client.register_script(_APPEND)
        self._read = client.register_script(_READ)

    def keys(self, log: str) -> list[str]:
        """Return the counter and list keys of ``log`` (`ValueError` for an invalid name)."""
        name = validate_log_name(log)
        return [f"{self.prefix}log:{{{name}}}:head", f"{self.prefix}log:{{{name}}}:records"]

    @staticmethod
    def check(log: str, records: Sequence[bytes]) -> list[bytes]:
        """Validate a log name and records (`ValueError` if invalid); return the records."""
        validate_log_name(log)
        return _validate_records(records)

    def append(self, log: str, records: Sequence[bytes]) -> None:
        """Append ``records`` to ``log`` atomically."""
        checked = self.check(log, records)
        if checked:
            self._append(keys=self.keys(log), args=[self.max_records, *checked])

    def read(self, log: str, cursor: int = 0) -> tuple[list[bytes], int]:
        """Return the records of ``log`` after sequence number ``cursor`` and the last number."""
        reply = self._read(keys=self.keys(log), args=[int(cursor)])
        return [bytes(record) for record in reply[1:]], int(reply[0])
