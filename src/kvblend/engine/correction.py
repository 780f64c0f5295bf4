"""The stale-KV correction: what the recomputed rows of a moved document say about the rest.

A moved document's KV was computed without the text that now precedes it. Its recomputed rows
measure, at every layer, how much their fresh K and V differ from the cached ones; part of that
change is shared by the whole document (the context it missed is the same for all of its
tokens). ``share`` times the mean change of a document's recomputed rows is added to its rows
that are not recomputed; a document with no recomputed rows gets the mean over every recomputed
row. Keys are corrected before RoPE.
"""

from __future__ import annotations

import torch

from .blend_io import MOVED


class StaleCorrection:
    """The correction of one set of computed rows (built when the set is chosen or narrowed)."""

    def __init__(
        self, kinds: torch.Tensor, span_index: torch.Tensor, computed: torch.Tensor, share: float
    ) -> None:
        """Build the correction for the rows ``computed`` (sorted positions) at this layer.

        ``kinds`` and ``span_index`` (`moved_span_index`) are ``[tokens]``.
        """
        self.share = share
        moved = kinds == MOVED
        # Recomputed moved rows: their index among the computed rows, and their positions.
        self.recomputed_local = moved[computed].nonzero().squeeze(1)
        self.recomputed = computed[self.recomputed_local]
        stale = moved.clone()
        stale[computed] = False
        self.stale = stale.nonzero().squeeze(1)  # moved rows read from the cache
        self.enabled = share > 0 and self.recomputed.numel() > 0 and self.stale.numel() > 0
        if not self.enabled:
            return
        spans = int(span_index.max()) + 1
        self.recomputed_span = span_index[self.recomputed]
        counts = torch.bincount(self.recomputed_span, minlength=spans)
        stale_span = span_index[self.stale]
        # Column ``spans`` of the mean table holds the mean over every recomputed row.
        self.stale_column = torch.where(counts[stale_span] > 0, stale_span, spans)
        self.divisor = torch.cat([counts, counts.new_tensor([self.recomputed.numel()])])
        self.divisor = self.divisor.clamp_min(1)
        self.spans = spans

    def deltas(self, fresh: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
        """``share`` x the mean ``fresh - cached`` of each stale row's document.

        ``fresh`` and ``cached`` are ``[kv_heads, len(recomputed), head_dim]``; the result is
        ``[kv_heads, len(stale), head_dim]``.
        """
        change = (fresh - cached).float()
        sums = change.new_zeros(change.shape[0], self.spans + 1, change.shape[2])
        sums.index_add_(1, self.recomputed_span, change)
        sums[:, self.spans] = change.sum(dim=1)
        means = sums * (self.share / self.divisor.to(sums.dtype)).view(1, -1, 1)
        return means[:, self.stale_column].to(fresh.dtype)
