"""The Redis back-end: `RedisKVStore`, entries on a Redis server shared by processes and machines.

`store` is the store itself; `access` keeps secrets out of logs, warns about open servers and
states the ACL a deployment grants; `health` takes a server that stopped answering out until a
``PING`` is answered; `payload` reads an entry's tensors with ranged reads; `record_logs` keeps
the record logs on the server. Importing it needs the ``redis`` package (the ``redis`` extra);
nothing here imports the disk back-end.
"""

from kvblend.store.redis.store import (
    DEFAULT_PREFIX,
    OTHER_KEY_IDLE_S,
    REDIS_URL_ENV,
    RedisKVStore,
)

__all__ = ["DEFAULT_PREFIX", "OTHER_KEY_IDLE_S", "REDIS_URL_ENV", "RedisKVStore"]
