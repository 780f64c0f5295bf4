"""Who may use a Redis tier: URLs without passwords in logs, open servers warned about, the ACL.

Stored KV reveals the documents it was computed from, so a Redis server holding it must not be
open to whoever can reach it. kvblend cannot see from a URL whether the server demands a
password, but it can see that it was given none: connecting to a server off this machine
without one logs a warning, once per server and process. `REQUIRED_ACL` is the least a
deployment must grant kvblend's user (docs/deployment.md): the keys under its prefix and the
commands it runs, in pipelines and inside its Lua scripts.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
from urllib.parse import urlsplit, urlunsplit

logger = logging.getLogger(__name__)

#: Commands kvblend runs on a Redis server: entries (STRLEN, GETRANGE, SET, EXPIRE, EXISTS,
#: DEL, UNLINK, SCAN, INFO), Lua scripts (EVALSHA, loaded by SCRIPT LOAD, or EVAL) and, inside
#: them, the record logs' GET, SET, DEL, LLEN, RPUSH, LTRIM, LRANGE; and PING. (redis-py also
#: sends CLIENT SETINFO on connecting, and goes on when it is refused.)
REQUIRED_COMMANDS = (
    "get set del unlink strlen getrange expire exists scan info "
    "llen rpush ltrim lrange evalsha eval script|load ping"
).split()


def required_acl(prefix: str = "kvblend:") -> str:
    """Return the ACL rules (``ACL SETUSER``) of a user that may run kvblend with key `prefix`."""
    commands = " ".join(f"+{command}" for command in REQUIRED_COMMANDS)
    return f"~{prefix}* resetchannels -@all {commands}"


def redacted(url: str) -> str:
    """Return `url` with its password replaced by ``***`` (for messages and logs)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


def is_loopback(host: str | None) -> bool:
    """Whether `host` names this machine (``localhost``, 127.0.0.0/8, ``::1``)."""
    if not host or host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_if_open(url: str) -> bool:
    """Log one warning per server if `url` names one off this machine without a password.

    A Unix socket (``unix://``) is local. Returns whether a warning was logged now.
    """
    parts = urlsplit(url)
    if parts.scheme == "unix" or parts.password or is_loopback(parts.hostname):
        return False
    server = f"{parts.hostname}:{parts.port or 6379}"
    with _warned_lock:
        if server in _warned:
            return False
        _warned.add(server)
    logger.warning(
        "KV store connects to the Redis server %s without a password: stored KV reveals the "
        "documents, so give the server a password or an ACL user (redis://user:password@host; "
        "see docs/deployment.md) unless its network is private",
        server,
    )
    return True
