"""What a command's precompute did, in lines a person reads: the estimate, the summary, Ctrl-C.

`PrecomputeTally` listens to the engine's `PrecomputeProgress` reports (the progress bar shows
the same ones): before a large precompute it says how much the store will grow, before one
that finds part of its documents stored it says what it resumes, and it adds up the documents
computed and those already stored over every precompute call of the command. `summary` renders
the command's last line from it, counting new, already stored and skipped documents apart;
`interrupted` says what a Ctrl-C kept.
"""

from __future__ import annotations

import sys
from typing import TextIO

from kvblend.documents.progress import PrecomputeProgress, format_bytes

#: Expected store growth from which a precompute says so before it starts.
LARGE_PRECOMPUTE_BYTES = 64 << 20


def plural(count: int, noun: str) -> str:
    """``3 documents``, ``1 document``."""
    return f"{count:,} {noun}{'' if count == 1 else 's'}"


class PrecomputeTally:
    """Adds up a command's precompute reports; says what a large or resumed one will do."""

    def __init__(self, *, quiet: bool = False, stream: TextIO | None = None) -> None:
        self.quiet = quiet
        self.stream = stream
        #: Documents computed and stored, and found stored, over the finished calls.
        self.computed = 0
        self.already_stored = 0
        self.tokens = 0
        self.bytes_written = 0
        self._current: PrecomputeProgress | None = None

    def _say(self, line: str) -> None:
        if not self.quiet:
            print(line, file=self.stream or sys.stderr, flush=True)

    def __call__(self, progress: PrecomputeProgress) -> None:
        """Take one report; the first of a call may say what it will do."""
        first = self._current is None
        self._current = progress
        if not first or not progress.to_compute:
            return
        if progress.already_stored:
            documents = plural(progress.documents, "document")
            self._say(
                f"resuming: {progress.already_stored:,} of {documents} already stored, computing "
                f"the other {progress.to_compute:,}"
            )
        if progress.bytes_expected >= LARGE_PRECOMPUTE_BYTES:
            per_token = progress.bytes_expected / max(1, progress.tokens)
            self._say(
                f"precomputing {plural(progress.to_compute, 'document')} "
                f"({progress.tokens:,} tokens): the store grows by about "
                f"{format_bytes(progress.bytes_expected)} ({format_bytes(per_token)} a token)"
            )

    def finish_call(self) -> None:
        """Fold the current call's last report into the totals (after it returns or stops)."""
        state, self._current = self._current, None
        if state is not None:
            self.computed += state.computed
            self.already_stored += state.already_stored
            self.tokens += state.tokens_done if state.computed else 0
            self.bytes_written += state.bytes_written

    @property
    def stored(self) -> int:
        """Documents the store holds now: computed here or found there."""
        return self.computed + self.already_stored


def summary(tally: PrecomputeTally, skipped: int, seconds: float) -> str:
    """Return the precompute command's last line: new, already stored, skipped, counted apart."""
    parts = []
    if tally.computed:
        parts.append(
            f"precomputed {plural(tally.computed, 'new document')} in {seconds:.1f} s "
            f"({tally.tokens:,} tokens, {format_bytes(tally.bytes_written)} written)"
        )
    if tally.already_stored:
        every = "" if tally.computed else "all "
        parts.append(f"{every}{plural(tally.already_stored, 'document')} already stored")
    if not parts:
        parts.append("nothing was stored")
    elif not tally.computed:
        parts[0] = f"nothing to compute: {parts[0]}"
    if skipped:
        parts.append(f"{skipped:,} skipped (named above)")
    return "; ".join(parts)


def interrupted(tally: PrecomputeTally, requested: int) -> str:
    """Say what a Ctrl-C kept: the documents stored so far (a rerun computes the others)."""
    kept = tally.stored
    return (
        f"interrupted: {kept:,} of {plural(requested, 'document')} stored "
        f"({tally.computed:,} computed here, {format_bytes(tally.bytes_written)} written); "
        f"run the same command again to compute the other {requested - kept:,}"
    )
