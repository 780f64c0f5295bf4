"""The test run stops on SIGINT and SIGTERM, even started as a background job (SIGINT ignored)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]

SLEEPER = """
import pathlib, time

def test_sleeps():
    pathlib.Path({marker!r}).write_text("started")
    time.sleep(120)
"""


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_the_run(tmp_path: Path, signum: int) -> None:
    marker = tmp_path / "started"
    (tmp_path / "test_sleeper.py").write_text(SLEEPER.format(marker=str(marker)))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
    }
    run = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest",
         "--rootdir", str(tmp_path), "--basetemp", str(tmp_path / "inner"),
         str(tmp_path / "test_sleeper.py")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path,
        # as a shell starts a background job: SIGINT ignored
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert run.poll() is None, run.communicate()[0]
            assert time.monotonic() < deadline, "the inner test never started"
            time.sleep(0.2)
        run.send_signal(signum)
        output, _ = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()
    assert run.returncode == 2, output  # pytest's "interrupted"
    assert "KeyboardInterrupt" in output and "1 passed" not in output


@pytest.mark.slow
def test_importing_the_fixtures_keeps_sigterm_default() -> None:
    """A spawned pool worker that imports conftest for its helpers still ends on SIGTERM."""
    code = "import signal, conftest; print(signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)"
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.stdout.strip() == "True", result.stderr
