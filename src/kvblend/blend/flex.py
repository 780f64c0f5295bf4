"""FlexAttention over a pass's computed rows, its block mask built on the device.

The computed rows are sorted positions; query ``i`` (at position ``rows[i]``) may attend to keys
``<= rows[i]`` (and ``> rows[i] - window`` on a sliding-window layer). FlexAttention takes that
mask as a `BlockMask`: for every block of `BLOCK` queries, the key blocks it must visit, split
into *full* blocks (every query of the block sees every key of it: no mask evaluated) and
*partial* ones (the ``mask_mod`` decides per element). Because the rows are sorted, a query
block's visible keys are one range, from its first row's window start to its last row, so
both sets are ranges of key blocks, computed with a handful of device ops from each block's
first and last position (`block_mask`): nothing is read back to the host and no dense mask is
made (``create_block_mask`` evaluates the mask over every element instead: about a second
eagerly for a 4K prompt). The ``mask_mod`` reads the rows from a tensor, so a new prompt of the
same sizes reuses a compiled kernel.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

#: Queries and keys per block of the block mask (FlexAttention's default).
BLOCK = 128


def size_bucket(n: int) -> int:
    """Round ``n`` up to a size bucket: a multiple of `BLOCK`, ``m * 2**k`` with ``m`` in 4..7.

    At most a quarter more than ``n`` (an eighth on average), four buckets per doubling: the
    shapes a compiled kernel (or loop) is made for.
    """
    blocks = -(-max(n, 1) // BLOCK)
    if blocks <= 4:
        return blocks * BLOCK
    shift = blocks.bit_length() - 3  # keep the top three bits
    return ((blocks + (1 << shift) - 1) >> shift << shift) * BLOCK


def _blocks(x: torch.Tensor) -> torch.Tensor:
    return torch.div(x, BLOCK, rounding_mode="floor")


def block_ranges(
    first: torch.Tensor, last: torch.Tensor, window: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Key-block ranges of query blocks whose rows span positions ``first..last`` (each).

    Returns ``(low, high, full_low, full_high)``: the blocks visited are ``low..high``
    (inclusive), of which ``full_low..full_high - 1`` are full (an empty range when equal).
    """
    high = _blocks(last)
    full_high = torch.minimum(_blocks(first + 1), high + 1)  # blocks wholly at or before first
    if window is None:
        low = torch.zeros_like(first)
        full_low = low
    else:
        low = _blocks((first - window + 1).clamp(min=0))
        full_low = torch.maximum(_blocks((last - window + 1).clamp(min=0) + BLOCK - 1), low)
    full_high = torch.maximum(full_high, full_low)
    return low, high, full_low, full_high


def block_mask_data(
    padded: torch.Tensor, key_blocks: int, window: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices`` of sorted rows.

    ``padded``: the rows' positions, their count a multiple of `BLOCK` (padding repeats a
    position at or after the last row's). Each ``[1, 1, query blocks(, key_blocks)]`` int32.
    """
    blocks = padded.view(-1, BLOCK)
    low, high, full_low, full_high = block_ranges(blocks[:, 0], blocks[:, -1], window)
    full = full_high - full_low
    before = full_low - low  # partial blocks before the full ones (window edge)
    partial = high + 1 - low - full
    step = torch.arange(key_blocks, device=padded.device).unsqueeze(0)
    # partial blocks: low .. full_low - 1, then full_high .. high
    indices = torch.where(
        step < before.unsqueeze(1),
        low.unsqueeze(1) + step,
        (full_high - before).unsqueeze(1) + step,
    )
    full_indices = full_low.unsqueeze(1) + step

    def shaped(x: torch.Tensor, most: int) -> torch.Tensor:
        return x.clamp(0, most).to(torch.int32)[None, None]

    last = key_blocks - 1  # indices past a query block's count are never read: any block
    return (
        shaped(partial, key_blocks), shaped(indices, last), shaped(full, key_blocks),
        shaped(full_indices, last),
    )  # fmt: skip


def row_mask_mod(rows: torch.Tensor, window: int | None) -> Any:
    """Return the rows' exact mask as a ``mask_mod``: key ``<= rows[query]`` (in the window)."""

    def causal(batch: Any, head: Any, query: Any, key: Any) -> Any:
        allowed = key <= rows[query]
        return allowed if window is None else allowed & (key > rows[query] - window)

    return causal


def pad_rows(rows: torch.Tensor, size: int) -> torch.Tensor:
    """``rows`` followed by copies of its last position, ``size`` in all (device ops only)."""
    extra = size - rows.numel()
    return rows if extra == 0 else torch.cat((rows, rows[-1:].expand(extra)))


@functools.cache
def _compiled_flex() -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_kernel(device: torch.device) -> Any:
    """FlexAttention as it runs here.

    Inside a compiled step, the plain function (traced into its graph); elsewhere compiled on
    CUDA (one kernel per shape) and eager on the CPU (exact but slow: it materialises the
    scores; the eager CPU loop uses query chunks instead).
    """
    from torch.nn.attention.flex_attention import flex_attention

    if torch.compiler.is_compiling() or device.type != "cuda":
        return flex_attention
    return _compiled_flex()


class FlexRows:
    """The computed rows' attention in one FlexAttention call per layer, masks built once.

    ``rows`` are the sorted positions (on the device), ``total`` the keys (the buffer's rows);
    one block mask per window size of the model, reused by every layer of the pass. Queries are
    padded to a `size_bucket`, so a compiled kernel serves every prompt of a bucket.
    """

    def __init__(
        self, rows: torch.Tensor, total: int, windows: set[int | None], scaling: float
    ) -> None:
        self.count = rows.numel()
        self.total = total
        self.scaling = scaling
        self.padded = pad_rows(rows, size_bucket(self.count))
        key_blocks = -(-total // BLOCK)
        self.data = {window: block_mask_data(self.padded, key_blocks, window) for window in windows}

    def block_mask(self, window: int | None) -> Any:
        """Return the `BlockMask` of ``window`` (a plain object over this pass's tensors)."""
        from torch.nn.attention.flex_attention import BlockMask

        partial, indices, full, full_indices = self.data[window]
        return BlockMask.from_kv_blocks(
            partial, indices, full, full_indices, BLOCK_SIZE=BLOCK,
            mask_mod=row_mask_mod(self.padded, window),
            seq_lengths=(self.padded.numel(), self.total), compute_q_blocks=False,
        )  # fmt: skip

    def __call__(
        self, window: int | None, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> torch.Tensor:
        """Attention ``[rows, heads * head_dim]`` of rotated ``queries`` over the layer's K/V."""
        padding = self.padded.numel() - self.count
        if padding:
            queries = torch.cat((queries, queries[:, -1:].expand(-1, padding, -1)), dim=1)
        out = flex_kernel(keys.device)(
            queries.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
            block_mask=self.block_mask(window), scale=self.scaling,
            enable_gqa=queries.shape[0] != keys.shape[0],
        )  # fmt: skip
        return out[0, :, : self.count].transpose(0, 1).reshape(self.count, -1)
