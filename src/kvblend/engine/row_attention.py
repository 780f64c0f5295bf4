"""Attention of a pass's computed rows over a layer's whole patched KV.

A blended prefill computes a subset of the prompt's rows (sorted positions), yet each of them
must attend to every key at or before its own position, cached or fresh. Three exact ways, by
how many rows are computed:

- every row (and no sliding window): plain causal attention;
- most rows (a reused prefix, then computed text): queries scattered into a zero
  ``[heads, total, head_dim]`` tensor, plain causal attention, the computed rows kept. On the
  kernels that skip the upper triangle this beats masked chunks;
- sparse rows: query chunks of `QUERY_CHUNK` rows, each over the keys up to its last position
  (from the window's start on sliding-window layers) with an additive mask of exactly that key
  range, so a chunk skips the causal upper triangle beyond it.

With ``KVBLEND_ATTENTION=flex`` the masked case is instead one FlexAttention call per layer
(`FlexRows`): the exact causal (and sliding-window) mask of the computed rows as a block mask,
built once per pass, over the grouped KV heads (no copies); compiled on CUDA, where it is meant
to run (the CPU runs the same code eagerly, which is exact but slow, and what tests check).

The chunk boundaries come from the computed rows on the host (the plan knows them), so the
layer loop never reads the device. Masks are kept for the whole pass while they fit in
``mask_budget`` bytes and built per call beyond it, so mask memory stays O(rows x keys) only
for short prompts and never grows past the budget (a 32K-token prompt would otherwise hold
about 1 GiB of bf16 masks).
"""

from __future__ import annotations

import functools
import os
from typing import Any, NamedTuple

import numpy as np
import torch

from .decoder import Decoder, repeat_kv, scaled_attention, sdpa_takes_gqa

# Query rows per attention call when the computed rows are sparse: smaller chunks skip more of
# the causal upper triangle but keep SDPA's kernels from running at full speed; on a CPU, 256
# selected rows of a 4K prompt took about half the time of 64.
QUERY_CHUNK = 256

# Masks kept for a pass, in bytes, before they are rebuilt at every call instead.
MASK_BUDGET = 64 << 20


def attention_mask(
    query_positions: torch.Tensor,
    key_begin: int,
    key_end: int,
    window: int | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Additive mask ``[queries, key_end - key_begin]``: 0 where a query may attend, -inf not.

    Keys ``key_begin..key_end-1``; a query at position p may attend to keys <= p and, with a
    sliding ``window``, to keys > p - window.
    """
    keys = torch.arange(key_begin, key_end, device=query_positions.device).unsqueeze(0)
    queries = query_positions.unsqueeze(1)
    allowed = keys <= queries
    if window is not None:
        allowed &= keys > (queries - window)
    mask = torch.zeros(allowed.shape, device=allowed.device, dtype=dtype)
    return mask.masked_fill_(~allowed, float("-inf"))


#: Environment variable choosing the masked attention: ``chunks`` (default) or ``flex``.
ATTENTION_ENV = "KVBLEND_ATTENTION"


@functools.cache
def _flex_kernel(compiled: bool) -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True) if compiled else flex_attention


class FlexRows:
    """The computed rows' attention in one FlexAttention call per layer (a CUDA path).

    The block mask of each window size (query ``i`` at position ``rows[i]`` sees keys
    ``<= rows[i]``, and ``> rows[i] - window``) is built once per pass and reused by every layer.
    """

    def __init__(self, decoder: Decoder, rows: torch.Tensor, total: int) -> None:
        from torch.nn.attention.flex_attention import create_block_mask

        self.decoder = decoder
        self.kernel = _flex_kernel(rows.device.type == "cuda")

        def mask_of(window: int | None) -> Any:
            def causal(batch: Any, head: Any, query: Any, key: Any) -> Any:
                allowed = key <= rows[query]
                return allowed if window is None else allowed & (key > rows[query] - window)

            return create_block_mask(causal, None, None, rows.numel(), total, device=rows.device)

        self.masks = {window: mask_of(window) for window in set(decoder.windows)}

    def __call__(
        self, layer: int, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> torch.Tensor:
        """Return the attention output ``[rows, hidden]`` (after ``o_proj``) at ``layer``."""
        out = self.kernel(
            queries.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
            block_mask=self.masks[self.decoder.windows[layer]], scale=self.decoder.scaling,
            enable_gqa=queries.shape[0] != keys.shape[0],
        )  # fmt: skip
        out = out[0].transpose(0, 1).reshape(queries.shape[1], -1)
        return self.decoder.attention_output(layer, out)


def attend(
    decoder: Decoder,
    layer: int,
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    rows: torch.Tensor | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """Attention output ``[tokens, hidden]`` of rotated inputs, through the model's ``o_proj``.

    SDPA here (`scaled_attention`: ``mask`` additive or boolean, None for plain causal, or
    every key with ``causal=False``), then the adapter's ``attention_output``; ``rows`` keeps
    only those query rows before it.
    """
    out = scaled_attention(queries, keys, values, mask, decoder.scaling, causal)
    if rows is not None:
        out = out.index_select(0, rows)
    return decoder.attention_output(layer, out)


class QueryChunk(NamedTuple):
    """One query chunk: computed rows ``[begin, end)`` over keys ``[key_begin, key_end)``.

    ``begin`` and ``end`` index the computed rows; the keys are prompt positions.
    """

    begin: int
    end: int
    key_begin: int
    key_end: int


class RowAttention:
    """Attention output ``[rows, hidden]`` of the computed rows at any layer of one pass."""

    def __init__(
        self,
        decoder: Decoder,
        rows: torch.Tensor,
        total: int,
        *,
        mask_budget: int = MASK_BUDGET,
        host: np.ndarray | None = None,
    ) -> None:
        """Attention of the computed ``rows`` (sorted positions on the decoder's device).

        ``host``: the same positions on the host (read from ``rows`` when None).
        """
        self.decoder = decoder
        self.rows = rows
        self.total = total
        count = rows.numel()
        self.dense = count == total
        self.scatter = not self.dense and 2 * count >= total
        self.chunks: dict[int | None, list[QueryChunk]] = {}
        self.masks: dict[int | None, list[torch.Tensor]] = {}
        self.mask_bytes = 0
        self.flex: FlexRows | None = None
        windows = set(decoder.windows)
        if (self.dense or self.scatter) and windows == {None}:
            return  # no masks: plain causal attention at every layer
        if os.environ.get(ATTENTION_ENV) == "flex":
            self.flex = FlexRows(decoder, rows, total)
            return
        positions = rows.tolist() if host is None else host  # first and last of every chunk
        firsts = [int(p) for p in positions[::QUERY_CHUNK]]
        lasts = [int(p) for p in positions[QUERY_CHUNK - 1 :: QUERY_CHUNK]]
        if len(lasts) < len(firsts):
            lasts.append(int(positions[-1]))
        element = torch.empty((), dtype=decoder.dtype).element_size()
        kept = 0
        for window in windows:
            if window is None and (self.dense or self.scatter):
                continue
            chunks = []
            for number, (first, last) in enumerate(zip(firsts, lasts, strict=True)):
                key_begin = 0 if window is None else max(0, first - window + 1)
                begin = number * QUERY_CHUNK
                chunks.append(
                    QueryChunk(begin, min(begin + QUERY_CHUNK, count), key_begin, last + 1)
                )
            self.chunks[window] = chunks
            size = sum((c.end - c.begin) * (c.key_end - c.key_begin) for c in chunks) * element
            if kept + size <= mask_budget:
                self.masks[window] = [self._mask(chunk, window) for chunk in chunks]
                kept += size
        self.mask_bytes = kept

    def _mask(self, chunk: QueryChunk, window: int | None) -> torch.Tensor:
        positions = self.rows[chunk.begin : chunk.end]
        return attention_mask(positions, chunk.key_begin, chunk.key_end, window, self.decoder.dtype)

    def __call__(
        self, layer: int, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> torch.Tensor:
        """Return the attention output of the computed rows at ``layer``.

        ``queries`` are rotated ``[heads, rows, head_dim]``; ``keys``/``values`` the layer's
        whole rotated KV ``[kv_heads, total, head_dim]``.
        """
        window = self.decoder.windows[layer]
        if self.flex is not None and not (window is None and self.dense):
            return self.flex(layer, queries, keys, values)
        if window is None and self.dense:
            return attend(self.decoder, layer, queries, keys, values, None)
        if window is None and self.scatter:
            heads, _, head_dim = queries.shape
            padded = queries.new_zeros(heads, self.total, head_dim)
            padded.index_copy_(1, self.rows, queries)
            return attend(self.decoder, layer, padded, keys, values, None, rows=self.rows)
        kept = self.masks.get(window)
        groups = queries.shape[0] // keys.shape[0]
        expand = groups > 1 and not sdpa_takes_gqa(True, keys.device)
        if expand and window is None and len(self.chunks[window]) > 1:
            # Masked calls need the KV heads expanded (see Decoder.attend): once per layer, not
            # once per chunk (sliding-window chunks read short, disjoint-ish key ranges).
            key_end = self.chunks[window][-1].key_end
            keys, values = (
                repeat_kv(keys[:, :key_end], groups),
                repeat_kv(values[:, :key_end], groups),
            )
        outputs = [
            attend(
                self.decoder,
                layer,
                queries[:, chunk.begin : chunk.end],
                keys[:, chunk.key_begin : chunk.key_end],
                values[:, chunk.key_begin : chunk.key_end],
                kept[number] if kept is not None else self._mask(chunk, window),
            )
            for number, chunk in enumerate(self.chunks[window])
        ]
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)
