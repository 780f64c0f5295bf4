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
