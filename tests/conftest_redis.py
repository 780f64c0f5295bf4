"""A real `redis-server` for tests: started on a free loopback port in a temporary folder.

No fake: the tests that claim the Redis tier works talk to Debian's ``redis-server``. Where it is
not installed the tests are skipped, except in CI (``CI=true``), where that is a failure.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class RedisServer:
    """One ``redis-server`` process; `start()` again after `kill()`/`stop()` gives an empty one."""

    def __init__(self, executable: str, folder: Path, *extra: str) -> None:
        self.executable = executable
        self.folder = folder
        self.port = _free_port()
        self.extra = extra
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        subprocess.run(
            [
                self.executable,
                "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.folder),
                "--save", "", "--appendonly", "no", "--daemonize", "yes",
                "--pidfile", str(self.folder / "redis.pid"),
                "--logfile", str(self.folder / "redis.log"), *self.extra,
            ],
            check=True,
        )  # fmt: skip
        deadline = time.monotonic() + 20
        while not self.ping():
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on port {self.port} did not start")
            time.sleep(0.05)

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as connection:
                connection.sendall(b"PING\r\n")
                reply = connection.recv(64)
                return reply.startswith(b"+PONG") or b"NOAUTH" in reply
        except OSError:
            return False

    @property
    def pid(self) -> int:
        return int((self.folder / "redis.pid").read_text())

    def kill(self) -> None:
        """Kill the server (SIGKILL: no clean shutdown) and wait until the port is free."""
        pid = self.pid
        os.kill(pid, signal.SIGKILL)
        while self.ping():
            time.sleep(0.02)
        (self.folder / "redis.pid").unlink(missing_ok=True)

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): connections stay open, requests time out."""
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def stop(self) -> None:
        cli = shutil.which("redis-cli")
        if cli and self.ping():
            subprocess.run(
                [cli, "-p", str(self.port), "shutdown", "nosave"], capture_output=True, timeout=10
            )
        if (self.folder / "redis.pid").exists():
            try:
                os.kill(self.pid, signal.SIGKILL)
            except (OSError, ValueError):
                pass


def redis_executable() -> str:
    """Path of ``redis-server``; skip the test where it is missing, fail in CI."""
    found = shutil.which("redis-server")
    if found is None:
        message = "redis-server is not installed (apt-get install -y redis-server)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)
    return found


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh, empty ``redis-server`` for one test."""
    folder = tmp_path / "redis"
    folder.mkdir()
    server = RedisServer(redis_executable(), folder)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def make_redis_server(tmp_path: Path) -> Iterator:
    """Factory of servers with extra ``redis-server`` options, all stopped after the test."""
    servers: list[RedisServer] = []

    def make(*extra: str) -> RedisServer:
        folder = tmp_path / f"redis-{len(servers)}"
        folder.mkdir()
        server = RedisServer(redis_executable(), folder, *extra)
        servers.append(server)
        server.start()
        return server

    yield make
    for server in servers:
        server.stop()


class StalledServer:
    """A TCP server that accepts connections and never answers (a stalled Redis).

    It keeps every connection open and records what clients send.
    """

    def __init__(self) -> None:
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port = int(self._listener.getsockname()[1])
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.connections = 0
        self.received: list[bytes] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def commands(self) -> list[str]:
        """The names of the commands received so far (RESP arrays' first items), in order."""
        with self._lock:
            data = b"".join(self.received)
        names = []
        for chunk in data.split(b"*")[1:]:  # each command is an array: *N\r\n$len\r\nNAME...
            lines = chunk.split(b"\r\n")
            if len(lines) > 2:
                names.append(lines[2].decode("ascii", "replace").upper())
        return names

    def _accept(self) -> None:
        self._listener.settimeout(0.1)
        while not self._stop.is_set():
            try:
                connection, _ = self._listener.accept()
            except OSError:
                continue
            with self._lock:
                self.connections += 1
            thread = threading.Thread(target=self._serve, args=(connection,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _serve(self, connection: socket.socket) -> None:
        connection.settimeout(0.1)
        with connection:
            while not self._stop.is_set():
                try:
                    data = connection.recv(65536)
                except TimeoutError:
                    continue
                except OSError:
                    return
                if not data:
                    return
                with self._lock:
                    self.received.append(data)

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        for thread in self._threads:
            thread.join(timeout=5)


@pytest.fixture
def stalled_redis() -> Iterator[StalledServer]:
    """A server on a free loopback port that accepts connections and never answers."""
    server = StalledServer()
    try:
        yield server
    finally:
        server.close()
