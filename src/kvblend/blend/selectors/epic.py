"""``epic``: the first tokens of every moved document recomputed (EPIC, 2024).

A moved document's first tokens attended only to the document head when cached, and they act
as the attention sink of the document's other tokens; recomputing them in their new context
restores most of what the document missed, at a cost set per document rather than per token.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from kvblend.blend.selectors.base import (
    CORRECTION,
    STALE_TEMPERATURE,
    Forecast,
    Selection,
    SelectionContext,
    Selector,
    Setting,
    SpanRows,
    non_negative_int,
)
from kvblend.blend.types import MOVED


class EpicSelector(Selector):
    """Recompute ``epic_tokens`` leading tokens of every moved span at every layer."""

    name = "epic"
    settings = {
        "epic_tokens": Setting(16, non_negative_int, "leading tokens of each moved document"),
        "correction": CORRECTION,
        "stale_temperature": STALE_TEMPERATURE,
    }

    def select(self, context: SelectionContext) -> Selection:
        """Compute the uncached rows and each moved span's leading tokens."""
        computed = context.uncached.numpy()  # a fresh host array
        lead = self.options["epic_tokens"]
        if lead > 0:
            for span in context.spans:
                if span.kind == MOVED:
                    computed[span.start : min(span.end, span.start + lead)] = True
        return Selection(torch.from_numpy(np.flatnonzero(computed)))

    def forecast(self, kinds: np.ndarray, spans: Iterable[SpanRows]) -> Forecast:
        """Count the moved rows among each moved span's first ``epic_tokens``."""
        lead = self.options["epic_tokens"]
        is_moved = np.asarray(kinds) == MOVED
        rows = sum(
            int(np.count_nonzero(is_moved[span.start : min(span.end, span.start + lead)]))
            for span in spans
            if span.kind == MOVED
        )
        return Forecast(rows, lead_rows=lead)
