"""Whether a Redis server answers: one failure takes it out, a background check brings it back.

A server can fail in ways that cost every caller a timeout: down (connections refused at once),
unreachable (connections time out) or stalled (it accepts connections and never answers: a
frozen process, a full network buffer, a firewall dropping replies). `RedisHealth` makes any of
them cost one timeout, not one per request: the first connection error or timeout marks the
server down, and every later request is refused at once (`RemoteUnavailableError`, which the
tiered store turns into a miss) without touching the network. A background thread then sends
``PING`` after `first_check_s`, doubling the wait up to `max_check_s` while it fails; the first
``PING`` answered marks the server up again. So requests never wait on a server that is still
failing, and a recovered server is used again within `max_check_s` at most.

The outage is logged once a minute at most, and its end once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvblend.store.base import RemoteUnavailableError

logger = logging.getLogger(__name__)

__all__ = ["WARNING_INTERVAL_S", "RedisHealth"]

#: Seconds between two warnings about one outage.
WARNING_INTERVAL_S = 60.0


class RedisHealth:
    """Up or down state of one server (`server`: its redacted URL), checked with `ping`.

    `ping` is called on the background thread only; whatever it raises means "still down".
    """

    def __init__(
        self, server: str, ping: Callable[[], object], first_check_s: float, max_check_s: float
    ) -> None:
        if first_check_s <= 0 or max_check_s < first_check_s:
            raise ValueError(
                f"Redis health checks need 0 < retry_after_s <= max_retry_after_s, got "
                f"{first_check_s} and {max_check_s}"
            )
        self.server = server
        self._ping = ping
        self._first_check_s = first_check_s
        self._max_check_s = max_check_s
        self._lock = threading.Lock()
        self._down = False
        self._next_check = 0.0
        self._checker: threading.Thread | None = None
        self._stop = threading.Event()
        self._last_warning = -float("inf")
        #: How many times the server was found down, and found answering again.
        self.outages = self.recoveries = 0

    @property
    def available(self) -> bool:
        """False from a failure until a background check sees the server answer."""
        return not self._down

    def check(self, action: str) -> None:
        """Raise `RemoteUnavailableError` at once while the server is down."""
        if not self._down:
            return
        with self._lock:
            if not self._down:
                return
            self._start_checker()  # stopped by close(): the store is in use again
            wait = max(0.0, self._next_check - time.monotonic())
        raise RemoteUnavailableError(
            f"cannot {action}: Redis at {self.server} unavailable, skipped until a background "
            f"check sees it answer (next check in {wait:.1f} s)"
        )

    def failed(self, error: BaseException) -> None:
        """Mark the server down after `error` (a connection error or timeout)."""
        now = time.monotonic()
        with self._lock:
            first = not self._down
            self._down = True
            self.outages += first
            self._start_checker()
            warn = first and now - self._last_warning >= WARNING_INTERVAL_S
            if warn:
                self._last_warning = now
        (logger.warning if warn else logger.debug)(
            "KV store Redis tier at %s unavailable (%s); using the local tiers and skipping it "
            "until a background check sees it answer (first check in %.1f s)",
            self.server,
            error,
            self._first_check_s,
        )

    def close(self) -> None:
        """Stop the background check (a later failure or request while down starts it again)."""
        with self._lock:
            self._stop.set()
            self._checker = None

    def _start_checker(self) -> None:
        """Start the background check unless one runs (call with the lock held)."""
        if self._checker is not None and self._checker.is_alive():
            return
        self._stop = threading.Event()
        self._next_check = time.monotonic() + self._first_check_s
        self._checker = threading.Thread(
            target=self._run, args=(self._stop,), name="kvblend-redis-health", daemon=True
        )
        self._checker.start()

    def _run(self, stop: threading.Event) -> None:
        delay = self._first_check_s
        while not stop.wait(delay):
            try:
                self._ping()
            except Exception as error:  # noqa: BLE001 - anything but an answer: still down
                delay = min(self._max_check_s, 2 * delay)
                with self._lock:
                    self._next_check = time.monotonic() + delay
                logger.debug("Redis at %s still unavailable: %s", self.server, error)
                continue
            with self._lock:
                self._down = False
                self.recoveries += 1
                if self._checker is threading.current_thread():
                    self._checker = None
            logger.warning("KV store Redis tier at %s is available again", self.server)
            return
