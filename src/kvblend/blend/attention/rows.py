"""Attention of a pass's computed rows over a layer's whole K/V: the loop's job, not the model's.

A blended prefill computes a subset of the prompt's rows (sorted positions), yet each of them
must attend to every key at or before its own position, cached or fresh. The ways, by how many
rows are computed and where the loop runs:

- every row (and no sliding window): plain causal attention;
- most rows (a reused prefix, then computed text): queries scattered into a zero
  ``[heads, total, head_dim]`` tensor, plain causal attention, the computed rows kept. On the
  kernels that skip the upper triangle this beats a mask;
- sparse rows, on CUDA and in the compiled loop: one FlexAttention call per layer (`FlexRows`),
  its block mask built on the device from the rows once per pass, KV heads grouped (no copies);
  outside a compiled step its kernel is compiled per (key, query) bucket (`flex.py`), and a
  compile dynamo refuses is attended by query chunks instead (logged once, counted);
- sparse rows, in the eager loop on the CPU in bfloat16: blocks of `PRODUCT_ROWS` rows, each
  two batched matrix products (queries by keys, weights by values) with a softmax between, KV
  heads grouped, the keys past the block's first row masked in place (`product_blocks`). There
  the products run on the CPU's bfloat16 units, several times as fast as SDPA's float32 ones
  (which take bfloat16 inputs at float32's speed): half the attention time of the chunks below,
  with the scores rounded once to bfloat16 (their softmax and sums in float32); on NQ prompts
  the blend's KL to full prefill is the chunks' (docs/benchmarks.md);
- sparse rows, in the eager loop on the CPU otherwise (and on sliding-window layers): query
  chunks of `QUERY_CHUNK` rows, each over the keys up to its last row (from its first row's
  window start on sliding-window layers) with an additive mask of exactly that key range, so
  a chunk skips the causal upper triangle beyond it. FlexAttention runs eagerly there only by
  materialising every score (several times slower), and compiled it costs seconds per shape,
  more than it saves on one prefill (docs/benchmarks.md). The key ranges come from the rows'
  positions on the host: exact when the host chose them, and on the CPU, where the device's
  memory is the host's, read in place (a view: nothing copied, nothing waited for); elsewhere
  from order-statistic bounds when a probe chose them on the device (`RowSet.bounds`), so no
  row is read back; a row set with no bounds is read back once. A chunk's keys past a row's
  position are computed and masked out (`masked_share`: 9% of the default's pairs at 4K, 4.5%
  at 7.5K); the chunks' outputs are joined, then laid out once.

``KVBLEND_ATTENTION=flex`` (or ``products``, or ``chunks``) forces one of the last three. Masks
of the chunks are kept for the whole pass while they fit in ``mask_budget`` bytes and built per
call beyond it; the product blocks' boolean masks are kept for the pass.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from kvblend.blend.attention.flex import FlexRows, compiled_flex
from kvblend.blend.op_threads import ELEMENT_WORK, big
from kvblend.blend.types import RowSet

# Query rows per attention call when the computed rows are sparse: smaller chunks skip more of
# the causal upper triangle but keep SDPA's kernels from running at full speed; on a CPU, 256
# selected rows of a 4K prompt took about half the time of 64.
QUERY_CHUNK = 256

#: Computed rows per block of the product path (`product_blocks`): each block reads the keys up
#: to its last row, so smaller blocks skip more of the causal upper triangle; at 4K with
#: SmolLM2's shape, 64 rows a block took 0.66 of 128's time and 0.96 of 32's (bfloat16, one
#: thread).
PRODUCT_ROWS = 64

# Masks kept for a pass, in bytes, before they are rebuilt at every call instead.
MASK_BUDGET = 64 << 20

#: Environment variable choosing the masked attention: ``flex`` or ``chunks``.
ATTENTION_ENV = "KVBLEND_ATTENTION"


def sdpa_takes_gqa(masked: bool, device: torch.device) -> bool:
    """Whether SDPA should get grouped KV heads (``enable_gqa``) rather than expanded ones.

    Unmasked: always. With a mask, only on the CPU: on CUDA that combination falls back to the
    math kernel, so the KV heads are expanded instead, as transformers' sdpa_attention does;
    the CPU's flash kernel takes both at once, and expanding there only adds copies.
    """
    return not masked or device.type == "cpu"


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Repeat each KV head ``groups`` times: ``[kv_heads, tokens, d] -> [heads, tokens, d]``.

    Query head ``h`` reads KV head ``h // groups``, as transformers' ``repeat_kv``.
    """
    kv_heads, tokens, head_dim = x.shape
    return x[:, None].expand(kv_heads, groups, tokens, head_dim).reshape(-1, tokens, head_dim)


def sdpa(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """Attention ``[queries, heads * head_dim]`` of rotated inputs (before ``o_proj``).

    ``mask`` is an additive ``[queries, keys]`` mask (0 = may attend, -inf = may not), or
    None for plain causal attention over aligned queries and keys (``causal=False``: every
    key). Keys and values may hold the KV heads only (GQA).
    """
    out = sdpa_heads(queries, keys, values, scale, mask, causal)
    return out.transpose(0, 1).reshape(queries.shape[1], -1)


def sdpa_heads(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """`sdpa` before its rows are laid out: ``[heads, queries, head_dim]`` (one op fewer)."""
    groups = queries.shape[0] // keys.shape[0]  # 1 when the caller expanded the heads
    if groups > 1 and not sdpa_takes_gqa(mask is not None, keys.device):
        keys, values = repeat_kv(keys, groups), repeat_kv(values, groups)
    with big(attention_work(queries, keys, mask is None and causal)):
        out = F.scaled_dot_product_attention(
            queries.unsqueeze(0),
            keys.unsqueeze(0),
            values.unsqueeze(0),
            attn_mask=None if mask is None else mask[None, None],
            is_causal=mask is None and causal,
            scale=scale,
            enable_gqa=queries.shape[0] != keys.shape[0],
        )
    return out[0]


def attention_work(queries: torch.Tensor, keys: torch.Tensor, causal: bool = False) -> int:
    """Return the multiply-adds of attention of ``queries`` over ``keys`` (both products).

    ``[heads, rows, head_dim]`` over ``[kv_heads, keys, head_dim]``; ``causal``: aligned rows,
    half the pairs.
    """
    heads, rows, head_dim = queries.shape
    pairs = int(rows) * int(keys.shape[1]) // (2 if causal else 1)
    return 2 * int(heads) * int(head_dim) * pairs


class Masks:
    """Additive masks of query rows over key ranges, made with two device ops each (float32).

    A mask is 0 where a query at position p may attend (keys <= p and, with a sliding
    ``window``, keys > p - window) and -inf elsewhere.
    """

    def __init__(self, device: torch.device, dtype: torch.dtype, length: int) -> None:
        self.keys = torch.arange(length, device=device)
        self.dtype = dtype

    def __call__(
        self, positions: torch.Tensor, key_begin: int, key_end: int, window: int | None
    ) -> torch.Tensor:
        """Mask ``[queries, key_end - key_begin]`` of queries at ``positions``."""
        keys = self.keys[key_begin:key_end]
        queries = positions.unsqueeze(1)
        blocked = keys > queries
        if window is not None:
            blocked |= keys <= queries - window
        mask = torch.where(blocked, float("-inf"), 0.0)  # the default dtype
        return mask if mask.dtype == self.dtype else mask.to(self.dtype)


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
    masks = Masks(query_positions.device, dtype, key_end)
    return masks(query_positions, key_begin, key_end, window)


def last_row_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    position: torch.Tensor | None,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """Attention ``[1, heads * head_dim]`` of one row (``query`` ``[heads, 1, d]``).

    ``position`` None: the row is the last of the keys, and attends to them all (from its
    window's start). Otherwise ``position`` (a one-element tensor: no host value needed) masks
    the keys after it and before its window; KV heads stay grouped (no copies): one product
    of the grouped queries with the keys, a softmax in float32, one with the values.
    """
    kv_heads, length, head_dim = keys.shape
    if position is None:
        if window is not None and window < length:
            keys, values = keys[:, length - window :], values[:, length - window :]
        return sdpa(query, keys, values, scale, causal=False)
    indices = torch.arange(length, device=keys.device)
    blocked = indices > position
    if window is not None:
        blocked |= indices <= position - window
    mask = torch.where(blocked, float("-inf"), 0.0).to(keys.dtype)
    grouped = query.reshape(kv_heads, -1, head_dim)  # query head h reads KV head h // groups
    scores = torch.baddbmm(
        mask.expand(kv_heads, grouped.shape[1], length), grouped, keys.transpose(1, 2), alpha=scale
    )
    weights = scores.softmax(dim=-1, dtype=torch.float32).to(values.dtype)
    return torch.bmm(weights, values).reshape(1, -1)


class QueryChunk(NamedTuple):
    """One query chunk: computed rows ``[begin, end)`` over keys ``[key_begin, key_end)``.

    ``begin`` and ``end`` index the computed rows; the keys are prompt positions.
    """

    begin: int
    end: int
    key_begin: int
    key_end: int


#: Chunk boundaries fall on multiples of this many rows.
CHUNK_STEP = 32

#: What one SDPA call costs on the CPU beside its query-key pairs, in pairs: per pair about 26
#: ns from 32 to 512 rows a call, and about 80 us more per call (SmolLM2's shape, one thread).
CALL_PAIRS = 4096

#: SDPA's CPU kernel takes query blocks of 64 rows from this many rows a call, of 32 below:
#: a pair then costs `SMALL_CALL` times as much (29.8 against 28.3 ns, SmolLM2's shape).
SMALL_ROWS = 192
SMALL_CALL = 1.06


def query_chunks(
    lower: np.ndarray, upper: np.ndarray, window: int | None, calls: int | None = None
) -> list[QueryChunk]:
    """Query chunks and the keys each reads, from host bounds of the rows' positions.

    The boundaries are chosen to read the fewest query-key pairs (plus `CALL_PAIRS` a call, a
    pair of a call under `SMALL_ROWS` rows counted `SMALL_CALL` times) with at most ``calls``
    calls (default `max_calls`), none over twice `QUERY_CHUNK` rows: where bounds are loose
    (rows a probe chose, early in the prompt) a short chunk ends before them, and rows
    bunched at the end share one call. A chunk's keys past a row's position are masked out:
    more calls read fewer of them.
    """
    count = lower.size
    points = np.unique(np.concatenate(([0], np.arange(CHUNK_STEP, count, CHUNK_STEP), [count])))
    key_end = upper[points[1:] - 1].astype(np.int64) + 1  # per chunk ending at points[e]
    key_begin = np.zeros(points.size - 1, dtype=np.int64)  # per chunk starting at points[s]
    if window is not None:
        key_begin = np.maximum(0, lower[points[:-1]].astype(np.int64) - window + 1)
    reach = 2 * QUERY_CHUNK // CHUNK_STEP
    best = np.full(points.size, np.inf)
    best[0] = 0.0
    starts = []  # per number of calls: the best start of a chunk ending at each point
    totals = []
    for _ in range(max_calls(count) if calls is None else calls):
        cost, start = np.full(points.size, np.inf), np.zeros(points.size, dtype=np.int64)
        for back in range(1, min(reach, points.size - 1) + 1):
            ends = np.arange(back, points.size)
            rows = points[ends] - points[ends - back]
            keys = key_end[ends - 1] - key_begin[ends - back]
            pairs = rows * keys * np.where(rows < SMALL_ROWS, SMALL_CALL, 1.0)
            candidate = best[ends - back] + pairs + CALL_PAIRS
            better = candidate < cost[ends]
            cost[ends[better]], start[ends[better]] = candidate[better], ends[better] - back
        best = cost
        starts.append(start)
        totals.append(cost[-1])
    calls = int(np.argmin(totals))
    chunks, end = [], points.size - 1
    for call in range(calls, -1, -1):
        begin = int(starts[call][end])
        chunks.append(
            QueryChunk(
                int(points[begin]), int(points[end]), int(key_begin[begin]), int(key_end[end - 1])
            )
        )
        end = begin
    return chunks[::-1]


def max_calls(count: int) -> int:
    """Return the most query chunks of ``count`` rows: one per `QUERY_CHUNK` rows.

    Each call is an op (on a GPU a launch) and a mask: more calls would read fewer masked keys
    but dispatch more ops.
    """
    return max(1, -(-count // QUERY_CHUNK))


def masked_share(chunks: list[QueryChunk], positions: np.ndarray, window: int | None) -> float:
    """Return the share of the query-key pairs that ``chunks`` compute and then mask out.

    ``positions``: the rows' sorted positions (on the host). A row needs the keys at or before
    its position (and inside its window); every other key of its chunk's range is masked.
    """
    computed = sum((c.end - c.begin) * (c.key_end - c.key_begin) for c in chunks)
    first = np.zeros(positions.size, dtype=np.int64)
    if window is not None:
        first = np.maximum(0, positions.astype(np.int64) - window + 1)
    needed = float((positions.astype(np.int64) + 1 - first).sum())
    return (computed - needed) / computed if computed else 0.0


def _forced_attention() -> str:
    forced = os.environ.get(ATTENTION_ENV, "").strip()
    if forced and forced not in ("flex", "products", "chunks"):
        raise ValueError(f"{ATTENTION_ENV} must be flex, products or chunks, got {forced!r}")
    return forced


def use_flex(device: torch.device, compiled: bool) -> bool:
    """Whether sparse rows attend with FlexAttention (CUDA, the compiled loop) or otherwise."""
    forced = _forced_attention()
    if forced:
        return forced == "flex"
    return compiled or device.type == "cuda"


def use_products(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the eager loop's sparse rows attend by blocks of products or by SDPA chunks.

    Products where the matrix units outrun SDPA's kernel: bfloat16 on the CPU (float32 and
    float16 there run SDPA faster). ``KVBLEND_ATTENTION`` overrides it.
    """
    forced = _forced_attention()
    if forced:
        return forced == "products"
    return device.type == "cpu" and dtype == torch.bfloat16


class ProductBlock(NamedTuple):
    """Computed rows ``[begin, end)`` over keys ``[0, key_end)``, masked from ``masked_from``.

    Every row of the block may read the keys before ``masked_from`` (its first row's position,
    or a lower bound of it, plus one); from there on each row's keys past its position are
    masked.
    """

    begin: int
    end: int
    masked_from: int
    key_end: int


def product_blocks(lower: np.ndarray, upper: np.ndarray) -> list[ProductBlock]:
    """Blocks of `PRODUCT_ROWS` computed rows, each over the keys up to its last row's bound.

    ``lower``/``upper``: host bounds of the rows' sorted positions (equal where exact).
    """
    count = lower.size
    return [
        ProductBlock(begin, end, int(lower[begin]) + 1, int(upper[end - 1]) + 1)
        for begin, end in zip(
            range(0, count, PRODUCT_ROWS),
            [*range(PRODUCT_ROWS, count, PRODUCT_ROWS), count],
            strict=True,
        )
    ]


class RowAttention:
    """Attention output ``[rows, heads * head_dim]`` of the computed rows at any layer of a pass."""

    def __init__(
        self,
        rows: RowSet,
        total: int,
        windows: list[int | None],
        scaling: float,
        dtype: torch.dtype,
        *,
        flex: bool = False,
        length: int | None = None,
        padded: torch.Tensor | None = None,
        mask_budget: int = MASK_BUDGET,
    ) -> None:
        """Attention of the computed ``rows`` over ``total`` keys; ``windows``: per layer.

        ``dtype``: the queries' (the chunks' masks are made in it). ``flex``: sparse rows in
        one FlexAttention call (else blocks of products or query chunks, `use_products`);
        ``length``: the rows of the K/V it is
        given (``total`` and more: a bucket's buffer); ``padded``: the rows' positions
        followed by padding rows' (a compiled loop's row bucket), the queries it is given.
        Without ``padded`` (the eager loop) every path but FlexAttention reads the prompt's
        keys alone (a view), whatever the buffer's length.
        """
        self.rows = rows
        self.positions = rows.positions if padded is None else padded
        # decided here, not in a call: a compiled step sees booleans, never the prompt's length
        self.exact = padded is None or (length or total) == total  # keys sliced to the prompt's
        # FlexAttention outside a compiled step even where its kernel is not compiled (the
        # eager loop told to use it); a compiled loop's step run eagerly attends by chunks
        self.fused = padded is None
        self.aligned = rows.count == total and self.positions.numel() == total  # rows 0, 1, ...
        self.total = total
        self.windows = windows
        self.scaling = scaling
        self.dtype = dtype
        self.mask_budget = mask_budget
        count = rows.count
        self.dense = count == total
        self.scatter = not self.dense and 2 * count >= total
        self.chunks: dict[int | None, list[QueryChunk]] = {}
        self.masks: dict[int | None, list[torch.Tensor]] = {}
        self.blocks: list[ProductBlock] = []  # the product path's (full-attention layers)
        self.blocked: list[torch.Tensor] = []  # their masks: True where a row may not read
        self.block_pairs = self.block_reach = 0  # their query-key pairs, their last key + 1
        device = rows.positions.device
        self.products = not flex and padded is None and use_products(device, dtype)
        self.mask_bytes = 0
        self.uncompiled = 0  # calls attended by chunks because a kernel's compile was refused
        self.flex: FlexRows | None = None
        self.masked = {w for w in windows if w is not None or not (self.dense or self.scatter)}
        if not self.masked:
            return  # no masks: plain causal attention at every layer
        if flex:
            keys = length or total
            self.flex = FlexRows(self.positions, keys, self.masked, scaling, padded is not None)
            return
        self._plan_chunks()

    def graph_key(self) -> tuple[object, ...]:
        """Return what a compiled step's graph takes from this object beside tensor sizes.

        The paths `__call__` takes, decided here, and the chunks' bounds where it attends by
        chunks: the compiled loop refuses a graph's compile by this key (`compiled.step_bucket`).
        """
        plans = {} if self.flex is not None else self.chunks  # planned for eager steps only
        chunks = tuple((str(window), tuple(plan)) for window, plan in plans.items())
        masked = tuple(sorted(str(window) for window in self.masked))
        return (
            self.flex is not None,
            self.exact,
            self.aligned,
            self.dense,
            self.scatter,
            masked,
            chunks,
            tuple(self.blocks),
        )

    def _plan_chunks(self) -> None:
        """Plan the query chunks of every masked window, and keep their masks within budget.

        Over the queries it is given: a compiled loop's padded rows (read back: this only
        happens when its kernel's compile was refused) or the computed rows.
        """
        rows, bounds = self._chunk_rows()
        self.chunk_positions = rows.positions
        element = torch.empty((), dtype=self.dtype).element_size()
        self.make_mask = Masks(rows.positions.device, self.dtype, self.total)
        kept = 0
        for window in self.masked:
            if window is None and self.products:
                kept += self._plan_blocks(bounds, rows.positions)
                continue
            self.chunks[window] = chunks = query_chunks(*bounds, window)
            size = sum((c.end - c.begin) * (c.key_end - c.key_begin) for c in chunks) * element
            if kept + size <= self.mask_budget:
                self.masks[window] = [self._mask(chunk, window) for chunk in chunks]
                kept += size
        self.mask_bytes = kept

    def _chunk_rows(self) -> tuple[RowSet, tuple[np.ndarray, np.ndarray]]:
        """Return the rows the chunks are planned over and host bounds of their positions."""
        rows = self.rows
        extra = self.positions.numel() - rows.count
        if extra:
            host = np.pad(rows.host_positions(), (0, extra), mode="edge")
            rows = RowSet(self.positions, host)
        bounds = rows.bounds()
        if bounds is None:  # chosen on the device with nothing known on the host: read back
            rows = RowSet(rows.positions, rows.host_positions())
            bounds = rows.bounds()
            assert bounds is not None
        elif rows.host is None and rows.positions.device.type == "cpu":
            # On the CPU the device's positions are in host memory: the chunks are planned
            # from them exactly (a view, no copy and nothing to wait for; a loop on CUDA
            # attends with FlexAttention and plans no chunks), which reads fewer masked keys
            # than the bounds a probe's rows come with.
            exact = rows.positions.numpy()
            bounds = (exact, exact)
        if not extra:
            self.rows = rows
        return rows, bounds

    def _plan_blocks(self, bounds: tuple[np.ndarray, np.ndarray], positions: torch.Tensor) -> int:
        """Plan the products path's key blocks (`product_blocks`); return their masks' bytes."""
        self.blocks = product_blocks(*bounds)
        keys = torch.arange(self.total, device=positions.device)
        for block in self.blocks:
            rows = positions[block.begin : block.end, None]
            self.blocked.append(keys[block.masked_from : block.key_end] > rows)
        self.block_pairs = sum((b.end - b.begin) * b.key_end for b in self.blocks)
        self.block_reach = max(block.key_end for block in self.blocks)
        return sum(mask.numel() for mask in self.blocked)  # one byte each

    def _mask(self, chunk: QueryChunk, window: int | None) -> torch.Tensor:
        positions = self.chunk_positions[chunk.begin : chunk.end]
        return self.make_mask(positions, chunk.key_begin, chunk.key_end, window)

    def __call__(
        self, window: int | None, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> torch.Tensor:
        """Return the attention output of the computed rows at a layer of ``window``.

        ``queries`` are rotated ``[heads, rows, head_dim]``; ``keys``/``values`` the layer's
        whole K/V ``[kv_heads, keys, head_dim]`` (keys rotated; a row past the prompt is only
        read by padding rows). In a compiled step every size used here is a tensor's, none the
        prompt's length, so a compiled loop serves every prompt of its size bucket.
        """
        if self.flex is not None:
            if self.fused or torch.compiler.is_compiling() or compiled_flex(keys.device):
                out = self.flex(window, queries, keys, values)
                if out is not None:
                    return out
                self.uncompiled += 1  # refused a compile: logged once (`COMPILE_REFUSALS`)
            if not self.chunks:  # a compiled loop's step run eagerly: the eager loop's chunks
                self._plan_chunks()
        if self.exact:
            keys, values = keys[:, : self.total], values[:, : self.total]
        if window is None and (self.dense or self.scatter):
            if self.aligned:  # rows 0, 1, ...: causal attention aligned at the first key
                return sdpa(queries, keys, values, self.scaling)
            heads, _, head_dim = queries.shape
            with big(heads * keys.shape[1] * head_dim * ELEMENT_WORK):
                scattered = queries.new_zeros(heads, keys.shape[1], head_dim)
                scattered.index_copy_(1, self.positions, queries)
            out = sdpa(scattered, keys, values, self.scaling)
            return out.index_select(0, self.positions)
        if window is None and self.blocks:
            return self._products(queries, keys, values)
        return self._chunked(window, queries, keys, values)

    def last_row(
        self, window: int | None, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> torch.Tensor:
        """Attention ``[1, heads * head_dim]`` of the last computed row (the prompt's last token).

        Over the prompt's keys (from the window's start on a sliding-window layer); over a
        compiled step's longer buffer (a size bucket) with a mask made from the row's position.
        """
        if self.exact:
            keys, values = keys[:, : self.total], values[:, : self.total]
            return last_row_attention(query, keys, values, None, window, self.scaling)
        position = self.positions[-1:]
        return last_row_attention(query, keys, values, position, window, self.scaling)

    def _products(
        self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> torch.Tensor:
        """Attention of the computed rows by blocks: two batched products and a softmax each.

        The queries are scaled first and grouped by KV head (the keys not repeated); the keys
        are transposed once a layer (a block's product would otherwise copy its keys); a
        block's scores are masked in place from its first row on, the softmax sums in float32.
        """
        heads, count, head_dim = queries.shape
        kv_heads = keys.shape[0]
        groups = heads // kv_heads
        out = queries.new_empty(heads, count, head_dim)
        with big(2 * heads * head_dim * self.block_pairs):
            transposed = keys[:, : self.block_reach].transpose(1, 2).contiguous()
            for block, blocked in zip(self.blocks, self.blocked, strict=True):
                rows, key_end = block.end - block.begin, block.key_end
                grouped = queries[:, block.begin : block.end] * self.scaling
                grouped = grouped.reshape(kv_heads, groups * rows, head_dim)
                scores = torch.bmm(grouped, transposed[:, :, :key_end])
                tail = scores.view(kv_heads, groups, rows, key_end)[..., block.masked_from :]
                tail.masked_fill_(blocked, float("-inf"))
                weights = torch.softmax(scores, dim=-1)
                product = torch.bmm(weights, values[:, :key_end])
                out[:, block.begin : block.end] = product.view(heads, rows, head_dim)
        return out.transpose(0, 1).reshape(count, -1)

    def _chunked(
        self, window: int | None, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> torch.Tensor:
        kept = self.masks.get(window)
        chunks = self.chunks[window]
        groups = queries.shape[0] // keys.shape[0]
        if groups > 1 and not sdpa_takes_gqa(True, keys.device) and window is None:
            # Masked calls need the KV heads expanded (see `sdpa`): once per layer, not once
            # per chunk (sliding-window chunks read short, disjoint-ish key ranges).
            key_end = chunks[-1].key_end
            keys, values = (
                repeat_kv(keys[:, :key_end], groups),
                repeat_kv(values[:, :key_end], groups),
            )
        outputs = [
            sdpa_heads(
                queries[:, chunk.begin : chunk.end],
                keys[:, chunk.key_begin : chunk.key_end],
                values[:, chunk.key_begin : chunk.key_end],
                self.scaling,
                kept[number] if kept is not None else self._mask(chunk, window),
            )
            for number, chunk in enumerate(chunks)
        ]  # each [heads, rows, head_dim]: joined, then laid out once (one copy, not one a call)
        out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
        return out.transpose(0, 1).reshape(queries.shape[1], -1)


class SequenceAttention:
    """Attention of every row of equal-length sequences laid one after another (a batch).

    Each sequence (a right-padded document, `BlendInput.sequences`) attends causally to its
    own rows only, all of them at positions ``0..length-1``: one SDPA call over a batch
    dimension, grouped KV heads, on the fused kernels. A sliding window adds the same
    ``[length, length]`` mask for every sequence (KV heads expanded on CUDA, as in `sdpa`).
    """

    def __init__(self, rows: RowSet, sequences: int, scaling: float):
        self.rows = rows
        self.uncompiled = 0  # a batch runs eagerly: no compile to refuse
        self.sequences = sequences
        self.scaling = scaling
        self.masks: dict[int, torch.Tensor] = {}

    def _mask(self, window: int, length: int, device: torch.device) -> torch.Tensor:
        if window not in self.masks:
            positions = torch.arange(length, device=device)
            offset = positions.unsqueeze(0) - positions.unsqueeze(1)  # key - query
            self.masks[window] = (offset <= 0) & (offset > -window)
        return self.masks[window]

    def __call__(
        self, window: int | None, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> torch.Tensor:
        """Return the attention output ``[rows, heads * head_dim]`` of every row at a layer.

        ``window``: the layer's sliding window (None: full attention), as `RowAttention` takes.

        ``queries`` are rotated ``[heads, rows, head_dim]``; ``keys``/``values`` the layer's K/V
        ``[kv_heads, rows, head_dim]`` (keys rotated).
        """
        heads, rows, head_dim = queries.shape
        length = rows // self.sequences
        q, k, v = (
            x[:, :rows].unflatten(1, (self.sequences, length)).transpose(0, 1)
            for x in (queries, keys, values)
        )  # [sequences, heads, length, head_dim]
        mask = None
        if window is not None and length > window:
            mask = self._mask(window, length, queries.device)
            groups = heads // k.shape[1]
            if groups > 1 and not sdpa_takes_gqa(True, k.device):
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        with big(attention_work(queries, keys[:, :length], mask is None)):  # every sequence
            out = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                is_causal=mask is None,
                scale=self.scaling,
                enable_gqa=heads != k.shape[1],
            )
        return out.transpose(1, 2).reshape(rows, heads * head_dim)
