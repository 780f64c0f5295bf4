"""The CPU's bfloat16 attention of sparse rows: blocks of matrix products, exact to the rows.

The eager loop on the CPU attends bfloat16 rows by two batched products and a softmax per block
of `PRODUCT_ROWS` rows (the bfloat16 units there run several times as fast as SDPA's float32
kernel); every row must still read exactly the keys at or before its own position, with the
KV heads grouped as transformers groups them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvblend.blend.attention.rows import (
    ATTENTION_ENV,
    PRODUCT_ROWS,
    RowAttention,
    product_blocks,
    use_products,
)
from kvblend.blend.selectors.base import chosen_rows
from kvblend.blend.types import RowSet

HEADS, KV_HEADS, HEAD_DIM, TOTAL = 6, 2, 16, 700


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
              scale: float) -> torch.Tensor:  # fmt: skip
    """Each row's attention over the keys up to its position, in float64, one row at a time."""
    groups = q.shape[0] // k.shape[0]
    out = torch.empty(positions.numel(), q.shape[0], q.shape[2], dtype=torch.float64)
    for row, position in enumerate(positions.tolist()):
        for head in range(q.shape[0]):
            keys = k[head // groups, : position + 1].double()
            weights = torch.softmax(keys @ q[head, row].double() * scale, dim=0)
            out[row, head] = weights @ v[head // groups, : position + 1].double()
    return out.reshape(positions.numel(), -1)


def inputs(dtype: torch.dtype, rows: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(HEADS, rows, HEAD_DIM, generator=generator) * 2  # peaked weights
    k = torch.randn(KV_HEADS, TOTAL, HEAD_DIM, generator=generator)
    v = torch.randn(KV_HEADS, TOTAL, HEAD_DIM, generator=generator)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def sparse_rows(seed: int = 1) -> RowSet:
    generator = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(TOTAL - 1, generator=generator)[:299]
    positions = torch.cat([chosen, torch.tensor([TOTAL - 1])]).sort().values
    return RowSet.from_host(positions.numpy(), torch.device("cpu"))


def test_products_are_chosen_for_bfloat16_on_the_cpu_only(monkeypatch) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert use_products(cpu, torch.bfloat16)
    assert not use_products(cpu, torch.float32) and not use_products(cpu, torch.float16)
    assert not use_products(cuda, torch.bfloat16)
    monkeypatch.setenv(ATTENTION_ENV, "products")
    assert use_products(cpu, torch.float32)
    monkeypatch.setenv(ATTENTION_ENV, "chunks")
    assert not use_products(cpu, torch.bfloat16)
    monkeypatch.setenv(ATTENTION_ENV, "fast")
    with pytest.raises(ValueError, match="flex, products or chunks"):
        use_products(cpu, torch.bfloat16)


def test_blocks_read_every_needed_key_and_mask_from_their_first_row() -> None:
    positions = sparse_rows().host_positions()
    blocks = product_blocks(positions, positions)
    assert [b.begin for b in blocks] == list(range(0, positions.size, PRODUCT_ROWS))
    assert blocks[-1].end == positions.size
    for block in blocks:
        assert block.end - block.begin <= PRODUCT_ROWS
        assert block.key_end == positions[block.end - 1] + 1
        assert block.masked_from == positions[block.begin] + 1
    lower, upper = positions - 5, positions + 5  # loose bounds: wider, never narrower
    for block in product_blocks(lower, upper):
        assert block.masked_from <= positions[block.begin] + 1
        assert block.key_end >= positions[block.end - 1] + 1


@pytest.mark.parametrize("pattern", ["sparse", "device-chosen"])
def test_products_equal_each_rows_causal_attention(monkeypatch, pattern: str) -> None:
    """float32 (the path forced): every row's output is its own causal attention's."""
    monkeypatch.setenv(ATTENTION_ENV, "products")
    if pattern == "sparse":
        rows = sparse_rows()
    else:  # chosen on the device: the host knows bounds of the positions only
        generator = torch.Generator().manual_seed(2)
        base = np.array([0, *range(650, TOTAL)])
        candidates = np.arange(50, 650)
        picked = torch.from_numpy(candidates)[torch.randperm(600, generator=generator)[:200]]
        rows = chosen_rows(base, picked, candidates, torch.device("cpu"))
        assert rows.host is None and rows.bounds() is not None
    scale = HEAD_DIM**-0.5
    attention = RowAttention(rows, TOTAL, [None, None], scale, torch.float32)
    assert attention.blocks and not attention.chunks
    q, k, v = inputs(torch.float32, rows.count)
    got = attention(None, q, k, v)
    expected = reference(q, k, v, rows.positions, scale)
    assert torch.allclose(got.double(), expected, atol=1e-5, rtol=0)


def test_bfloat16_products_stay_within_bfloat16s_rounding_of_exact(monkeypatch) -> None:
    """The scores rounded once to bfloat16: within 1% of exact, a few times SDPA's error.

    SDPA keeps float32 scores (at float32's speed); on real prompts both paths' KL to full
    prefill is the same (docs/benchmarks.md): this bounds the rounding on peaked weights.
    """
    rows, scale = sparse_rows(4), HEAD_DIM**-0.5
    q, k, v = inputs(torch.bfloat16, rows.count)
    expected = reference(q, k, v, rows.positions, scale)
    products = RowAttention(rows, TOTAL, [None], scale, torch.bfloat16)
    assert products.blocks  # the default on the CPU in bfloat16
    monkeypatch.setenv(ATTENTION_ENV, "chunks")
    chunks = RowAttention(rows, TOTAL, [None], scale, torch.bfloat16)
    assert not chunks.blocks and chunks.chunks
    errors = {}
    for name, attention in (("products", products), ("chunks", chunks)):
        got = attention(None, q, k, v)
        assert got.dtype == torch.bfloat16 and got.shape == expected.shape
        errors[name] = (got.double() - expected).abs().mean().item()
    magnitude = expected.abs().mean().item()
    assert errors["products"] < 0.01 * magnitude, (errors, magnitude)
    assert errors["products"] < 5 * errors["chunks"], errors


def test_sliding_window_layers_keep_their_chunks() -> None:
    rows, scale = sparse_rows(), HEAD_DIM**-0.5
    attention = RowAttention(rows, TOTAL, [None, 128], scale, torch.bfloat16)
    assert attention.blocks and list(attention.chunks) == [128]
    q, k, v = inputs(torch.bfloat16, rows.count)
    assert attention(128, q, k, v).shape == (rows.count, HEADS * HEAD_DIM)
