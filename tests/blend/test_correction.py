"""The stale-KV correction, against a per-row reference written out in plain loops.

Each moved row that is not recomputed moves by ``share`` times the mean change (fresh minus
cached, keys compared before RoPE) of its own document's recomputed rows, or of every recomputed
row when its document has none; rows chosen on the host and on the device give the same tensors.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import tiny_model
from kvblend.blend.correction import apply_correction, stale_correction
from kvblend.blend.rope import inverse_table, rope_table, rotate
from kvblend.blend.types import COMPUTE, MOVED, PREFIX, RowSet
from kvblend.models.decoder import Decoder

# prefix 0-3, document A 4-11 (moved), question 12-13, document B 14-19 (moved), C 20-23 (moved)
KINDS = np.array([PREFIX] * 4 + [MOVED] * 8 + [COMPUTE] * 2 + [MOVED] * 6 + [MOVED] * 4
                 + [COMPUTE] * 2, dtype=np.int8)  # fmt: skip
SPANS = {0: range(4, 12), 1: range(14, 20), 2: range(20, 24)}
COMPUTED = np.array([5, 7, 12, 13, 15, 24, 25])  # A: 5, 7; B: 15; C: none (takes the overall)
SHARE = 0.5


def _span_index() -> np.ndarray:
    index = np.full(KINDS.size, -1)
    for number, rows in SPANS.items():
        index[list(rows)] = number
    return index


def _reference(layer_kv: torch.Tensor, fresh: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The corrected K/V, one moved row at a time."""
    inverse = inverse_table(table)
    unrotated = layer_kv.clone()
    unrotated[0] = rotate(layer_kv[0], inverse)
    fresh_keys = rotate(fresh[:, 0].transpose(0, 1), inverse[COMPUTED]).transpose(0, 1)
    fresh_raw = torch.stack((fresh_keys, fresh[:, 1]), 1)  # [rows, 2, kv_heads, head_dim]
    change = {int(row): fresh_raw[i] - unrotated[:, :, row] for i, row in enumerate(COMPUTED)}
    moved_changes = [change[r] for r in change if KINDS[r] == MOVED]
    overall = torch.stack(moved_changes).mean(0)
    out = unrotated.clone()
    for rows in SPANS.values():
        own = [change[r] for r in rows if r in change]
        mean = torch.stack(own).mean(0) if own else overall
        for row in rows:
            out[:, :, row] += SHARE * mean
    out[0] = rotate(out[0], table)
    return out


@pytest.mark.parametrize("chosen_on", ["host", "device"])
def test_each_document_moves_by_a_share_of_its_recomputed_rows_change(chosen_on: str) -> None:
    decoder = Decoder(tiny_model("llama"))
    table = rope_table(*decoder.rotary(torch.arange(KINDS.size)))
    generator = torch.Generator().manual_seed(6)
    layer_kv = torch.randn(2, 2, KINDS.size, 16, generator=generator)
    layer_kv[0] = rotate(layer_kv[0], table)  # the buffer holds rotated keys
    fresh = torch.randn(COMPUTED.size, 2, 2, 16, generator=generator)
    fresh[:, 0] = rotate(fresh[:, 0].transpose(0, 1), table[COMPUTED]).transpose(0, 1)
    rows = RowSet.from_host(COMPUTED, torch.device("cpu"))
    if chosen_on == "device":
        rows = RowSet(rows.positions)  # no host positions: the means table is made on the device
    correction = stale_correction(KINDS, _span_index(), rows, SHARE, table, table[COMPUTED])
    assert correction is not None
    expected, before = _reference(layer_kv, fresh, table), layer_kv.clone()
    apply_correction(correction, layer_kv, fresh)
    moved_not_computed = [r for r in np.flatnonzero(KINDS == MOVED) if r not in COMPUTED]
    assert torch.allclose(layer_kv[:, :, moved_not_computed], expected[:, :, moved_not_computed],
                          atol=1e-5, rtol=1e-5)  # fmt: skip
    untouched = np.flatnonzero(KINDS != MOVED)
    assert torch.equal(layer_kv[:, :, untouched], before[:, :, untouched])
    assert not torch.allclose(layer_kv, before)  # the correction moved something


def test_no_correction_without_a_share_or_with_every_moved_row_recomputed() -> None:
    table = torch.zeros(KINDS.size, 2, 2, 8)
    some = RowSet.from_host(COMPUTED, torch.device("cpu"))
    assert stale_correction(KINDS, _span_index(), some, 0.0, table, table[COMPUTED]) is None
    every = np.flatnonzero(KINDS != PREFIX)
    everything = RowSet.from_host(every, torch.device("cpu"))
    assert stale_correction(KINDS, _span_index(), everything, SHARE, table, table[every]) is None


@pytest.mark.parametrize("chosen_on", ["host", "device"])
@pytest.mark.parametrize("share", [SHARE, 0.0])
def test_a_temperature_divides_the_stale_keys_after_the_shift(chosen_on: str, share: float) -> None:
    decoder = Decoder(tiny_model("llama"))
    table = rope_table(*decoder.rotary(torch.arange(KINDS.size)))
    generator = torch.Generator().manual_seed(7)
    layer_kv = torch.randn(2, 2, KINDS.size, 16, generator=generator)
    layer_kv[0] = rotate(layer_kv[0], table)
    fresh = torch.randn(COMPUTED.size, 2, 2, 16, generator=generator)
    rows = RowSet.from_host(COMPUTED, torch.device("cpu"))
    if chosen_on == "device":
        rows = RowSet(rows.positions)
    shifted = layer_kv.clone()
    if share > 0:  # the temperature-free correction's result, then divided
        plain = stale_correction(KINDS, _span_index(), rows, share, table, table[COMPUTED])
        assert plain is not None and plain.key_scale == 1.0
        apply_correction(plain, shifted, fresh)
    hot = stale_correction(KINDS, _span_index(), rows, share, table, table[COMPUTED],
                           temperature=1.25)  # fmt: skip
    assert hot is not None and hot.key_scale == pytest.approx(0.8)
    before = layer_kv.clone()
    apply_correction(hot, layer_kv, fresh)
    stale = [r for r in np.flatnonzero(KINDS == MOVED) if r not in COMPUTED]
    assert torch.allclose(layer_kv[0][:, stale], shifted[0][:, stale] / 1.25, atol=1e-6)
    assert torch.allclose(layer_kv[1][:, stale], shifted[1][:, stale], atol=1e-6)  # values kept
    untouched = np.flatnonzero(KINDS != MOVED)
    assert torch.equal(layer_kv[:, :, untouched], before[:, :, untouched])
    every = np.flatnonzero(KINDS != PREFIX)  # nothing stale: nothing to do
    everything = RowSet.from_host(every, torch.device("cpu"))
    assert stale_correction(KINDS, _span_index(), everything, share, table, table[every],
                            temperature=1.25) is None  # fmt: skip
