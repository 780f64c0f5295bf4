"""Stopping a long benchmark run by a signal: after the question under way, its result written.

`StopRequest` is a context manager for a run's main thread. The first SIGTERM (or SIGINT, unless
the process started with SIGINT ignored, as a shell's background job does) asks the run to stop:
the run sees it between questions (`StopRequest.__call__`), writes its rows, summaries, command
and report as a finished run would, and says it stopped. A second signal acts at once, as it
would without the context (SIGINT raises `KeyboardInterrupt`, SIGTERM ends the process).
Outside the main thread, where Python delivers no signal, it installs nothing.
"""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType, TracebackType
from typing import Any


class StopRequest:
    """Whether a signal asked the run to stop; the run stops between two units of work."""

    def __init__(self, unit: str = "question") -> None:
        self.unit = unit
        self.signal: str | None = None
        self._previous: dict[int, Any] = {}

    def __call__(self) -> bool:
        """Return whether a signal asked the run to stop."""
        return self.signal is not None

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is not threading.main_thread():
            return self
        for number in (signal.SIGTERM, signal.SIGINT):
            previous = signal.getsignal(number)
            if number == signal.SIGINT and previous is signal.SIG_IGN:
                continue  # a background job: ^C in the shell is not meant for it
            self._previous[number] = previous
            signal.signal(number, self._handle)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._restore()

    def _restore(self) -> None:
        for number, previous in self._previous.items():
            signal.signal(number, previous)
        self._previous = {}

    def _handle(self, number: int, frame: FrameType | None) -> None:
        name = signal.Signals(number).name
        if self.signal is not None:  # asked twice: act as the signal would without us
            self._restore()
            signal.raise_signal(number)
            return
        self.signal = name
        print(
            f"{name}: stopping after this {self.unit}; the result keeps every finished "
            f"{self.unit} and the same command resumes the run ({name} again stops at once)",
            file=sys.stderr,
            flush=True,
        )


__all__ = ["StopRequest"]
