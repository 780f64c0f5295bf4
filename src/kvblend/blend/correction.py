"""The stale-KV correction: what the recomputed rows of a moved document say about the rest.

A moved document's KV was computed without the text that now precedes it. Its recomputed rows
measure, at every layer, how much their fresh K and V differ from the cached ones; part of that
change is shared by the whole document (the context it missed is the same for all of its
tokens). ``share`` times the mean change of a document's recomputed rows is added to its rows
that are not recomputed; a document with no recomputed rows gets the mean over every recomputed
row. Keys are corrected before RoPE: the buffer holds rotated keys, so a key change is
un-rotated by its row's own table and the shift rotated by the table of the row it moves
(RoPE is linear).

A temperature ``T`` on the stale rows (APE's, arXiv 2502.05431, on the rows a blend reads from a
cache computed without the prompt's other text) divides their keys by ``T`` after the shift:
every later query's logit over such a key is divided by ``T``, in the prefill and, since the
fused cache keeps the divided keys, in every decoding step after it.

The correction is built from the computed rows on the device, with sizes the host knows (the
count of computed rows, the moved rows of the prompt), so it needs no read-back when a probe
chose the rows there: a means table ``[documents + 1, rows]`` (zero weight for computed rows
that are not moved) made with a scatter-add, and at every layer a handful of device ops on keys
and values together: one gather, a difference, an un-rotation, one matrix product (every
document's mean at once), a gather of each moved row's mean, its rotation and one scatter-add
into the layer's K/V. Every moved row is shifted, recomputed ones too: the fresh K/V written
right after overwrite them, so which rows were recomputed never has to be known on the host.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from kvblend.blend.rope import inverse_table, rotate_
from kvblend.blend.types import MOVED, RowSet, to_device


class CorrectionTensors(NamedTuple):
    """What `apply_correction` reads at every layer (device tensors, made once per row set)."""

    rows: torch.Tensor  # [rows] the computed positions
    row_inverse: torch.Tensor  # [rows, 1, 2, 2, half] the inverse rotation of each computed row
    weights: torch.Tensor  # [spans + 1, rows] float32: share / count per document, and overall
    moved: torch.Tensor  # [moved] every moved position
    column: torch.Tensor  # [moved] the means-table row each moved position takes
    moved_table: torch.Tensor  # [moved, 1, 2, 2, half] the rotation of each moved position
    key_scale: float = 1.0  # the stale keys are multiplied by it (1 / temperature; 1: off)


def stale_correction(
    kinds: np.ndarray,
    span_index: np.ndarray,
    rows: RowSet,
    share: float,
    table: torch.Tensor,
    row_table: torch.Tensor,
    bucket: Callable[[int], int] | None = None,
    temperature: float = 1.0,
) -> CorrectionTensors | None:
    """Build the correction of the computed ``rows`` (None when it would change nothing).

    ``kinds`` and ``span_index`` (`moved_span_index`) are ``[tokens]`` host arrays; ``table``
    the `rope_table` of every position, ``row_table`` that of the computed rows. Rows known on
    the host get their means table made there; rows chosen on the device, on the device.
    ``bucket`` (a compiled loop's): the moved rows and the table's documents are padded to
    sizes it gives, padding moved rows at the buffer's row past the prompt (never read), so
    the tensors' sizes are a bucket's. ``temperature``: the stale keys' (1: none).
    """
    moved = np.flatnonzero(kinds == MOVED)
    if (share <= 0 and temperature == 1.0) or moved.size == 0:
        return None
    device, total = rows.positions.device, kinds.size
    spans = int(span_index.max()) + 1
    moved_span, moved_count = span_index[moved], moved.size
    documents = spans + 1  # the means table: a row per document, then the overall mean
    if bucket is not None:
        documents = max(8, 1 << spans.bit_length())
        padding = bucket(moved.size) - moved.size
        moved = np.pad(moved, (0, padding), constant_values=total)
        moved_span = np.pad(moved_span, (0, padding))
    span_of_all = np.where(span_index >= 0, span_index, spans)  # ``spans``: not moved
    weights: torch.Tensor
    column: torch.Tensor
    if rows.host is not None:
        host_weights, host_column = _host_means(
            span_of_all[rows.host], moved_span, spans, share, documents, int(moved_count)
        )
        if host_weights is None:
            if temperature == 1.0 or np.isin(moved[:moved_count], rows.host).all():
                return None  # nothing stale, or nothing to do
            host_weights = np.zeros((documents, rows.host.size), dtype=np.float32)
        weights, column = to_device(host_weights, device), to_device(host_column, device)
    else:
        span_of = to_device(span_of_all, device).index_select(0, rows.positions)
        weights, column = _device_means(
            span_of, to_device(moved_span, device), spans, share, documents
        )
    positions, moved_rows = rows.positions, to_device(moved, device)
    return CorrectionTensors(
        positions,
        inverse_table(row_table).unsqueeze(1),
        weights,
        moved_rows,
        column,
        table.index_select(0, moved_rows).unsqueeze(1),
        1.0 / temperature,
    )


def _host_means(
    span_of: np.ndarray,
    moved_span: np.ndarray,
    spans: int,
    share: float,
    documents: int,
    moved: int,
) -> tuple[np.ndarray | None, np.ndarray]:
    """Return the means table and each moved row's column, from rows known on the host.

    ``span_of``: each computed row's moved span (``spans`` if it is not moved). None when no
    moved row is recomputed, or every one of the ``moved`` is (nothing stale). The table has
    ``documents`` rows: one per span, then the overall mean, then zeros.
    """
    recomputed = span_of < spans
    count = int(recomputed.sum())
    if count == 0 or count == moved:
        return None, moved_span
    counts = np.bincount(span_of[recomputed], minlength=spans + 1)
    weights = np.zeros((documents, span_of.size), dtype=np.float32)
    columns = np.flatnonzero(recomputed)
    weights[span_of[columns], columns] = share / counts[span_of[columns]]
    weights[spans] = share * recomputed / count
    return weights, np.where(counts[moved_span] > 0, moved_span, spans)


def _device_means(
    span_of: torch.Tensor, moved_span: torch.Tensor, spans: int, share: float, documents: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_host_means` on the device, with sizes the host knows (a scatter-add, no bincount)."""
    device, count = span_of.device, span_of.numel()
    recomputed = (span_of < spans).float()  # 1 for a recomputed moved row
    counts = torch.zeros(spans + 1, device=device).index_add_(0, span_of, recomputed)
    weights = torch.zeros(documents, count, device=device)
    columns = torch.arange(count, device=device)
    weights.index_put_((span_of, columns), share * recomputed / counts[span_of].clamp(min=1))
    weights[spans] = share * recomputed / recomputed.sum().clamp(min=1)
    return weights, torch.where(counts.index_select(0, moved_span) > 0, moved_span, spans)


def apply_correction(c: CorrectionTensors, layer_kv: torch.Tensor, fresh: torch.Tensor) -> None:
    """Move the moved rows of ``layer_kv`` before the computed rows overwrite theirs.

    ``layer_kv`` is the layer's ``[2, kv_heads, tokens, head_dim]`` K/V (keys rotated);
    ``fresh`` the computed rows' ``[rows, 2, kv_heads, head_dim]`` K/V (keys rotated).
    """
    rows = c.rows.numel()
    cached = layer_kv.index_select(2, c.rows).permute(2, 0, 1, 3)
    change = fresh - cached  # [rows, 2, kv_heads, head_dim]
    rotate_(change[:, 0], c.row_inverse)  # the keys' change before RoPE
    means = c.weights @ change.reshape(rows, -1).float()  # [spans + 1, 2 * kv_heads * head_dim]
    shift = means.index_select(0, c.column).to(layer_kv.dtype).view(-1, *fresh.shape[1:])
    rotate_(shift[:, 0], c.moved_table)  # each moved row's key shift at its own position
    if c.key_scale == 1.0:
        layer_kv.index_add_(2, c.moved, shift.permute(1, 2, 0, 3))
        return
    moved = layer_kv.index_select(2, c.moved).add_(shift.permute(1, 2, 0, 3))
    moved[0].mul_(c.key_scale)  # the temperature: keys only
    layer_kv.index_copy_(2, c.moved, moved)
