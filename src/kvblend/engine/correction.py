"""The stale-KV correction: what the recomputed rows of a moved document say about the rest.

A moved document's KV was computed without the text that now precedes it. Its recomputed rows
measure, at every layer, how much their fresh K and V differ from the cached ones; part of that
change is shared by the whole document (the context it missed is the same for all of its
tokens). ``share`` times the mean change of a document's recomputed rows is added to its rows
that are not recomputed; a document with no recomputed rows gets the mean over every recomputed
row. Keys are corrected before RoPE.

Which rows are which is decided on the host once per pass (the computed rows are known there);
at every layer the correction is a handful of device ops on keys and values together: two row
gathers, a difference, one matrix product that takes every document's mean (the means table),
and one scatter-add into the layer's KV.
"""

from __future__ import annotations

import numpy as np
import torch

from .blend_io import MOVED, to_device


class StaleCorrection:
    """The correction of one set of computed rows (built when the set is chosen or narrowed)."""

    def __init__(
        self,
        kinds: np.ndarray,
        span_index: np.ndarray,
        computed: np.ndarray,
        share: float,
        device: torch.device,
    ) -> None:
        """Build the correction for the rows ``computed`` (sorted positions, on the host).

        ``kinds`` and ``span_index`` (`moved_span_index`) are ``[tokens]`` host arrays.
        """
        self.share = share
        moved = kinds == MOVED
        # Recomputed moved rows: their index among the computed rows, and their positions.
        local = np.flatnonzero(moved[computed])
        recomputed = computed[local]
        stale = moved.copy()
        stale[computed] = False
        stale_rows = np.flatnonzero(stale)  # moved rows read from the cache
        self.enabled = share > 0 and recomputed.size > 0 and stale_rows.size > 0
        if not self.enabled:
            return
        spans = int(span_index.max()) + 1
        recomputed_span = span_index[recomputed]
        counts = np.bincount(recomputed_span, minlength=spans)
        # Row s of the means table: share x the mean over span s's recomputed rows; row
        # ``spans``: share x the mean over every recomputed row.
        weights = np.zeros((spans + 1, recomputed.size), dtype=np.float32)
        weights[recomputed_span, np.arange(recomputed.size)] = share / counts[recomputed_span]
        weights[spans] = share / recomputed.size
        stale_span = span_index[stale_rows]
        stale_column = np.where(counts[stale_span] > 0, stale_span, spans)

        def on_device(array: np.ndarray) -> torch.Tensor:
            return to_device(array, device)

        self.local, self.recomputed = on_device(local), on_device(recomputed)
        self.stale, self.stale_column = on_device(stale_rows), on_device(stale_column)
        self.weights = on_device(weights)

    def apply(self, layer_kv: torch.Tensor, fresh: torch.Tensor) -> None:
        """Move the stale rows of ``layer_kv`` before the computed rows overwrite theirs.

        ``layer_kv`` is the layer's un-rotated ``[2, kv_heads, tokens, head_dim]`` KV;
        ``fresh`` the computed rows' ``[rows, 2, kv_heads, head_dim]`` K/V.
        """
        if not self.enabled:
            return
        rows = self.recomputed.numel()
        cached = layer_kv.index_select(2, self.recomputed).permute(2, 0, 1, 3)
        change = (fresh.index_select(0, self.local) - cached).reshape(rows, -1).float()
        means = self.weights @ change  # [spans + 1, 2 * kv_heads * head_dim]
        shift = means.index_select(0, self.stale_column).to(layer_kv.dtype)
        layer_kv.index_add_(2, self.stale, shift.view(-1, *fresh.shape[1:]).permute(1, 2, 0, 3))
