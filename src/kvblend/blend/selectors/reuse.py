"""``reuse``: no reused token recomputed, the quality floor of a blend."""

from __future__ import annotations

import numpy as np
import torch

from kvblend.blend.selectors.base import Selection, SelectionContext, Selector


class ReuseSelector(Selector):
    """Compute only the uncached rows; every cached row is read as stored."""

    name = "reuse"

    def select(self, context: SelectionContext) -> Selection:
        """Compute the uncached rows only."""
        return Selection(torch.from_numpy(np.flatnonzero(context.uncached.numpy())))
