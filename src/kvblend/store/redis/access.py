"""Who may use a Redis tier: URLs without secrets in logs, open servers warned about, the ACL.

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
from urllib.parse import parse_qsl, urlencode, urlsplit

logger = logging.getLogger(__name__)

#: Commands kvblend runs on a Redis server: entries (STRLEN, GETRANGE, PTTL, SET, EXPIRE,
#: EXISTS, DEL, UNLINK, SCAN, INFO), Lua scripts (EVALSHA, loaded by SCRIPT LOAD, or EVAL)
#: and, inside them, the record logs' GET, SET, DEL, LLEN, RPUSH, LTRIM, LRANGE; and PING.
#: (redis-py also sends CLIENT SETINFO on connecting, and goes on when it is refused.)
REQUIRED_COMMANDS = (
    "get set del unlink strlen getrange pttl expire exists scan info "
    "llen rpush ltrim lrange evalsha eval script|load ping"
).split()


def required_acl(prefix: str = "kvblend:") -> str:
    """Return the ACL rules (``ACL SETUSER``) of a user that may run kvblend with key `prefix`."""
    commands = " ".join(f"+{command}" for command in REQUIRED_COMMANDS)
    return f"~{prefix}* resetchannels -@all {commands}"


#: Query parameters of a Redis URL whose values are shown: redis-py's connection settings.
#: Every other parameter's value (``password=``, ``ssl_password=``, anything unknown) is hidden.
SHOWN_PARAMETERS = frozenset(
    "db socket_timeout socket_connect_timeout socket_read_size socket_keepalive "
    "retry_on_timeout retry_on_error max_connections health_check_interval ssl_check_hostname "
    "ssl_cert_reqs ssl_ca_certs ssl_certfile ssl_min_version timeout protocol "
    "decode_responses client_name".split()
)
_HIDDEN = "***"


def redacted(url: object) -> str:
    """Return `url` with every secret in it replaced by ``***``: kvblend's only URL redaction.

    Hides the password of the user information (``redis://user:***@host``) and the value of
    every query parameter not in `SHOWN_PARAMETERS` (``?password=***``); drops a fragment.
    Every URL kvblend prints, logs, raises or stores (`RedisKVStore.url`) goes through it.
    Never raises: a URL that does not parse is shown as its scheme alone.
    """
    text = str(url)
    try:
        parts = urlsplit(text)
        netloc = parts.netloc
        if "@" in netloc:
            userinfo, host = netloc.rsplit("@", 1)
            user = userinfo.split(":", 1)[0]
            netloc = f"{user}:{_HIDDEN}@{host}" if ":" in userinfo else f"{user}@{host}"
        query = urlencode(
            [
                (name, value if name.lower() in SHOWN_PARAMETERS else _HIDDEN)
                for name, value in parse_qsl(parts.query, keep_blank_values=True)
            ],
            safe="*/:",
        )
        shown = f"{parts.scheme}://{netloc}{parts.path}" if "://" in text else parts.path
        return f"{shown}?{query}" if query else shown
    except ValueError:
        scheme = text.split("://", 1)[0] if "://" in text else ""
        return f"{scheme}://{_HIDDEN}" if scheme.isalnum() else _HIDDEN


def has_password(url: str) -> bool:
    """Whether `url` gives a password, in its user information or its query (``?password=``)."""
    parts = urlsplit(url)
    if parts.password:
        return True
    return any(value for name, value in parse_qsl(parts.query) if name.lower() == "password")


def is_loopback(host: str | None) -> bool:
    """Whether `host` names this machine.

    ``localhost`` (and names under ``.localhost``), 127.0.0.0/8, ``::1``, and IPv4 loopback
    addresses mapped into IPv6 (``::ffff:127.0.0.1``).
    """
    if not host:
        return True
    name = host.lower().rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(name.split("%", 1)[0])  # without an IPv6 zone
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_if_open(url: str) -> bool:
    """Log one warning per server if `url` names one off this machine without a password.

    A Unix socket (``unix://``) is local. Returns whether a warning was logged now.
    """
    parts = urlsplit(url)
    if parts.scheme == "unix" or has_password(url) or is_loopback(parts.hostname):
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
