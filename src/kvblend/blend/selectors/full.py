"""``full``: every token computed over the prompt's token ids, the exact baseline."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from kvblend.blend.selectors.base import Forecast, Selection, SelectionContext, Selector, SpanRows


class FullSelector(Selector):
    """Compute every row at every layer; no cached KV is read."""

    name = "full"
    reads_cache = False

    def select(self, context: SelectionContext) -> Selection:
        """Compute every row."""
        return Selection(torch.from_numpy(np.arange(context.kinds.numel())))

    def forecast(self, kinds: np.ndarray, spans: Iterable[SpanRows]) -> Forecast:
        """Nothing reused, so nothing recomputed: every row is computed."""
        return Forecast(0)
