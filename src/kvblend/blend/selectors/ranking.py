"""Ranking a probe's scores by blocks of rows and with a minimum per document (`attention`).

The ``attention`` strategy recomputes the moved rows its probe scores highest. Two settings change
what it ranks, and both are decided here:

- ``window`` (CacheClip-style): the candidate rows of each moved document (its moved rows after
  the leading ones) are laid in blocks of ``window`` consecutive rows from its first candidate
  row, a block's score is the sum of its rows' scores, and whole blocks are recomputed. A
  document's last partial block is no candidate, so the count of recomputed rows is a multiple
  of ``window`` the host knows.
- ``per_document`` (ProphetKV-style): each moved document first gets its own top
  ``per_document`` candidate rows (in blocks of ``window``: its top ``ceil(per_document /
  window)`` blocks, or all it has), then the rest of the budget goes to the top of all the
  other candidates.

Every count is a function of the token kinds and the cached spans (`candidate_runs`,
`unit_budget`), so `attention_budget` reports what `ranked_units` picks. The picking runs on
the decoder's device in a few batched ops (a gather and a sum of the block scores, one ``topk``
over a padded ``[documents, blocks]`` matrix, one over the rest), with nothing read back.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from kvblend.blend.selectors.base import SpanRows
from kvblend.blend.types import MOVED, to_device

__all__ = ["Units", "UnitBudget", "candidate_runs", "ranked_units", "unit_budget", "units_of"]


def candidate_runs(
    kinds: np.ndarray, spans: Iterable[SpanRows], lead_tokens: int, short_document: int
) -> list[np.ndarray]:
    """Each moved span's candidate rows (host): its moved rows after the leading ones, sorted.

    The leading rows are the first ``lead_tokens`` rows of the span, or all of a span of at most
    ``short_document`` rows, as `attention.leading_rows` marks them. Spans in prompt order.
    """
    is_moved = np.asarray(kinds) == MOVED
    runs = []
    for span in spans:
        if span.kind == MOVED:
            length = span.end - span.start
            start = span.start + (length if length <= short_document else lead_tokens)
            start = min(start, span.end)
            runs.append(np.flatnonzero(is_moved[start : span.end]) + start)
    return runs


def per_document_units(runs_sizes: Iterable[int], window: int, per_document: int) -> np.ndarray:
    """Each document's first-stage units: ``ceil(per_document / window)``, at most its blocks."""
    blocks = np.fromiter((size // window for size in runs_sizes), dtype=np.int64)
    return np.minimum(-(-per_document // window), blocks)


@dataclass(frozen=True)
class UnitBudget:
    """The rows `ranked_units` picks, counted from the documents' candidate counts alone.

    ``keep``: rows recomputed at every layer; ``early``: rows recomputed in the funnel's early
    layers (``keep`` and more); ``selectable``: candidate rows in full blocks (``keep`` equal to
    it picks every block: no ranking); ``minimum``: rows of the per-document first stage.
    """

    keep: int
    early: int
    selectable: int
    minimum: int


def unit_budget(
    sizes: Iterable[int], keep: int, early: int, window: int, per_document: int
) -> UnitBudget:
    """Turn a budget of ``keep`` (and ``early``) candidate rows into whole units.

    ``sizes``: each moved document's candidate rows. The rows become ``ceil(rows / window)``
    blocks (at most every full block); the per-document first stage's blocks
    (`per_document_units`) come out of that budget, or are the budget when they exceed it.
    """
    sizes = list(sizes)
    blocks = sum(size // window for size in sizes)
    first = int(per_document_units(sizes, window, per_document).sum()) if per_document else 0
    keep_units = max(min(-(-keep // window), blocks), first)
    early_units = max(min(-(-early // window), blocks), keep_units)
    return UnitBudget(keep_units * window, early_units * window, blocks * window, first * window)


@dataclass(frozen=True)
class Units:
    """The candidate rows in units of ``window`` consecutive rows of one document (host).

    ``rows``: ``[units, window]`` positions, documents in prompt order and each document's
    blocks in order; ``table``: ``[documents, widest]`` each document's unit indices, padded
    with ``units`` (a sentinel scoring -inf), documents without a first-stage unit left out;
    ``first``: how many of each tabled document's units the first stage takes.
    """

    rows: np.ndarray
    table: np.ndarray
    first: np.ndarray
    window: int

    @property
    def count(self) -> int:
        """How many units."""
        return int(self.rows.shape[0])

    @property
    def flat(self) -> np.ndarray:
        """Every unit's rows, sorted (host): the candidates `chosen_rows` bounds positions by."""
        return np.sort(self.rows.reshape(-1))


def units_of(runs: list[np.ndarray], window: int, per_document: int) -> Units:
    """Lay each document's candidate rows (`candidate_runs`) in blocks of ``window``.

    A document's last partial block is left out.
    """
    blocks = [run[: run.size - run.size % window].reshape(-1, window) for run in runs]
    rows = np.concatenate(blocks) if blocks else np.zeros((0, window), dtype=np.int64)
    first = per_document_units((run.size for run in runs), window, per_document)
    starts = np.cumsum([0] + [b.shape[0] for b in blocks])
    taking = np.flatnonzero(first > 0) if per_document else np.zeros(0, dtype=np.int64)
    widest = max((blocks[d].shape[0] for d in taking), default=0)
    table = np.full((taking.size, widest), rows.shape[0], dtype=np.int64)
    for row, document in enumerate(taking):  # a loop over documents, not rows
        table[row, : blocks[document].shape[0]] = np.arange(starts[document], starts[document + 1])
    return Units(rows.astype(np.int64, copy=False), table, first[taking], window)


def ranked_units(scores: torch.Tensor, units: Units, count: int) -> torch.Tensor:
    """Rows of the ``count // window`` units picked first, best first, unit by unit (device).

    A unit scores the sum of its rows' ``scores``. The per-document first stage (``units.first``
    units of each tabled document, its best) comes first, then the best of the other units.
    ``count`` is at least the first stage's rows and at most every unit's; nothing is read back.
    """
    device = scores.device
    window = units.window
    rows = to_device(units.rows, device)
    if count <= 0:
        return rows.new_zeros(0)
    unit_scores = scores[rows].sum(dim=1)  # [units]
    wanted = count // window
    first_count = int(units.first.sum())
    if not first_count:
        order = torch.topk(unit_scores, wanted, sorted=True).indices
        return rows[order].reshape(-1)
    # first stage: each document's top units, one topk over a padded [documents, widest] matrix
    padded = torch.cat((unit_scores, unit_scores.new_full((1,), float("-inf"))))
    table = to_device(units.table, device)
    widest = int(units.first.max())
    top = torch.topk(padded[table], widest, dim=1, sorted=True).indices
    taken = np.flatnonzero(np.arange(widest)[None, :] < units.first[:, None])  # row-major
    first = table.gather(1, top).reshape(-1)[to_device(taken, device)]
    if wanted > first_count:  # second stage: the best of the units left
        rest = unit_scores.index_fill(0, first, float("-inf"))
        first = torch.cat((first, torch.topk(rest, wanted - first_count, sorted=True).indices))
    return rows[first].reshape(-1)
