"""The CPU loop's query chunks: every needed key read, few masked out, no more calls than before.

A chunk of sorted rows reads the keys up to its last row's position, and masks, for each row,
those after its own: `masked_share` measures that waste. On the CPU the rows a probe chose are
planned from their exact positions (host memory there), not from the probe's loose bounds.
"""

from __future__ import annotations

import numpy as np

from kvblend.blend.attention.rows import QUERY_CHUNK, masked_share, max_calls, query_chunks


def _late_rows(total: int, count: int, seed: int) -> np.ndarray:
    """``count`` sorted positions, dense near the end (as the default's question-aware rows)."""
    rng = np.random.default_rng(seed)
    tail = np.arange(total - 34, total)  # the question: always computed
    chosen = set(tail.tolist())
    while len(chosen) < count:
        chosen.add(int((total - 35) * rng.random() ** 0.27))
    return np.array(sorted(chosen), dtype=np.int64)


def test_masked_share_counts_the_keys_after_each_row() -> None:
    rows = np.array([3, 5, 9])
    chunks = query_chunks(rows, rows, None, calls=1)
    assert [(c.begin, c.end, c.key_begin, c.key_end) for c in chunks] == [(0, 3, 0, 10)]
    assert masked_share(chunks, rows, None) == (30 - (4 + 6 + 10)) / 30


def test_exact_positions_keep_masked_keys_few_within_the_call_budget() -> None:
    for seed in range(3):
        rows = _late_rows(4153, 917, seed)
        chunks = query_chunks(rows, rows, None)
        assert len(chunks) <= max_calls(rows.size) == -(-rows.size // QUERY_CHUNK)
        assert all(c.key_end >= rows[c.end - 1] + 1 for c in chunks)  # every needed key
        assert chunks[0].begin == 0 and chunks[-1].end == rows.size
        exact = masked_share(chunks, rows, None)
        assert exact < 0.10
        # the same rows known only by order-statistic bounds (a probe's, on CUDA) waste more
        candidates = np.arange(4153 - 34)
        lower = np.sort(np.concatenate((rows[-34:], candidates[: rows.size - 34])))
        upper = np.sort(np.concatenate((rows[-34:], candidates[-(rows.size - 34) :])))
        loose = masked_share(query_chunks(lower, upper, None), rows, None)
        assert exact < loose
