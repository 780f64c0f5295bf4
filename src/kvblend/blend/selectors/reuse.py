"""``reuse``: no reused token recomputed, the quality floor of a blend."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from kvblend.blend.selectors.base import Forecast, Selection, SelectionContext, Selector, SpanRows


class ReuseSelector(Selector):
    """Compute only the uncached rows; every cached row is read as stored."""

    name = "reuse"

    def select(self, context: SelectionContext) -> Selection:
        """Compute the uncached rows only."""
        return Selection(torch.from_numpy(np.flatnonzero(context.uncached.numpy())))

    def forecast(self, kinds: np.ndarray, spans: Iterable[SpanRows]) -> Forecast:
        """Nothing recomputed."""
        return Forecast(0)
