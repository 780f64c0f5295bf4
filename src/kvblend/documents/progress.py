"""What a precompute has done so far (`PrecomputeProgress`), and the bar that shows it.

`kvblend.documents.segment_kv.SegmentKV.ensure_many` reports a `PrecomputeProgress` once before
it computes anything (the documents already stored, the tokens to compute and the store's
expected growth), after each layer of a batch's pass, and after each batch is stored.
`PrecomputeBar` renders those reports as a tqdm bar on stderr: tokens computed, documents
stored and bytes written of the expected total. The expected growth is exact but for each
entry's header: an entry's tensors are known from the model's shape, the KV dtype and the codec.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["PrecomputeBar", "PrecomputeProgress", "ProgressListener", "format_bytes"]


@dataclass(frozen=True)
class PrecomputeProgress:
    """How far one precompute call is; documents are distinct texts."""

    #: Distinct documents asked for.
    documents: int
    #: Of them, found intact in the store: not computed again.
    already_stored: int
    #: Documents computed and stored so far.
    computed: int
    #: Tokens to compute in all (each document behind its document context).
    tokens: int
    #: Tokens computed so far, a batch's tokens counted layer by layer as its pass runs.
    tokens_done: int
    #: Bytes of the entries written so far (their tensors).
    bytes_written: int
    #: Bytes the store grows by once every document is stored (their tensors).
    bytes_expected: int

    @property
    def to_compute(self) -> int:
        """Documents this call computes (not already stored)."""
        return self.documents - self.already_stored


ProgressListener = Callable[[PrecomputeProgress], None]


def format_bytes(count: float) -> str:
    """``count`` bytes in the largest binary unit that keeps it at least 1 (``1.5 GiB``)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


class PrecomputeBar:
    """A tqdm bar of a precompute: tokens computed, documents stored, bytes written.

    ``disable``: True hides it, None shows it only when stderr is a terminal (tqdm's rule),
    False always shows it. Use it as a context manager and call it with each report.
    """

    def __init__(self, disable: bool | None = None, desc: str = "precomputing KV") -> None:
        self.disable = disable
        self.desc = desc
        self._bar: Any = None

    def __call__(self, progress: PrecomputeProgress) -> None:
        """Show ``progress`` (the bar opens at the first report with tokens to compute)."""
        if self._bar is None:
            if not progress.tokens:
                return  # every document was stored: nothing to wait for
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=progress.tokens,
                desc=self.desc,
                unit="tok",
                unit_scale=True,
                disable=self.disable,
            )
        bar = self._bar
        bar.set_postfix_str(
            f"{progress.computed}/{progress.to_compute} docs, wrote "
            f"{format_bytes(progress.bytes_written)} of ~{format_bytes(progress.bytes_expected)}",
            refresh=False,
        )
        bar.update(progress.tokens_done - bar.n)

    def __enter__(self) -> PrecomputeBar:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.close()
