"""The blended prefill: one plain loop over the decoder's layers.

Every prompt token is one of three kinds:

- ``PREFIX``: reused from a cache computed at the same positions and context (exact, never
  recomputed unless the strategy is ``full``);
- ``MOVED``: reused from a segment cache computed elsewhere; a strategy picks which of these are
  recomputed;
- ``COMPUTE``: not cached (question, template text, separators, new documents): computed in full
  at every layer.

Keys are kept un-rotated (before RoPE) and rotated to their prompt positions at every layer with
the model's own rotary embedding, so re-placing a cached segment is exact. Tokens that are
recomputed at a layer overwrite their cached K/V rows there and attend to the whole patched KV
with an exact per-token causal mask (key position <= query position).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from .config import BlendConfig
from .decoder import Decoder, apply_rope, signed_sin

PREFIX, MOVED, COMPUTE = 0, 1, 2

# Query rows per attention call when the active tokens are sparse: each chunk attends only to
# the keys up to its last position, which skips most of the causal upper triangle. Smaller
# chunks skip more of it but keep SDPA's kernels from running at full speed: on a CPU, 256
# selected rows of a 4K prompt took about half the time of 64.
_QUERY_CHUNK = 256


class LayerKV(Protocol):
    """A cached segment's KV, readable one layer at a time."""

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Un-rotated keys and values ``[kv_heads, tokens, head_dim]`` of layer ``index``."""
        ...


@dataclass
class CachedSpan:
    """Prompt rows ``[start, end)`` whose KV comes from ``source``."""

    start: int
    end: int
    source: LayerKV
    kind: int = MOVED


@dataclass
class BlendInput:
    """Everything the loop needs about one prompt."""

    token_ids: torch.Tensor  # [tokens] long
    kinds: torch.Tensor  # [tokens] int8: PREFIX / MOVED / COMPUTE
    spans: list[CachedSpan]


@dataclass
class BlendOutput:
    """What the loop returns: logits, the fused KV cache and what it did."""

    logits: torch.Tensor | None  # [vocab] float32
    keys: list[torch.Tensor]  # per layer, rotated [kv_heads, tokens, head_dim]
    values: list[torch.Tensor]
    raw_keys: list[torch.Tensor] | None  # per layer, un-rotated (when asked for)
    stats: dict[str, float] = field(default_factory=dict)
    scores: torch.Tensor | None = None  # [tokens] tail attention, from a probe pass


def initial_active(
    kinds: torch.Tensor, spans: Sequence[CachedSpan], config: BlendConfig
) -> torch.Tensor:
    """Boolean mask of the tokens computed at layer 0 under ``config.strategy``."""
    if config.strategy == "full":
        return torch.ones_like(kinds, dtype=torch.bool)
    active = kinds == COMPUTE
    if config.strategy == "cacheblend":
        return active | (kinds == MOVED)
    if config.strategy == "epic" and config.epic_tokens > 0:
        active = active.clone()
        for span in spans:
            if span.kind == MOVED:
                active[span.start : min(span.end, span.start + config.epic_tokens)] = True
    return active


def _attention_mask(
    query_positions: torch.Tensor, key_count: int, window: int | None, dtype: torch.dtype
) -> torch.Tensor:
    """Additive mask ``[queries, keys]``: 0 where a query may attend, -inf elsewhere.

    Built once per prompt in the compute dtype, so attention does not convert a boolean mask
    at every layer.
    """
    keys = torch.arange(key_count, device=query_positions.device)
    allowed = keys.unsqueeze(0) <= query_positions.unsqueeze(1)
    if window is not None:
        allowed &= keys.unsqueeze(0) > (query_positions.unsqueeze(1) - window)
    mask = torch.zeros(allowed.shape, device=allowed.device, dtype=dtype)
    return mask.masked_fill_(~allowed, float("-inf"))


class _Attention:
    """Attention of the active rows over the full patched KV, with per-token causal masks."""

    def __init__(self, decoder: Decoder, active_positions: torch.Tensor, total: int) -> None:
        self.decoder = decoder
        self.positions = active_positions
        self.total = total
        count = active_positions.numel()
        self.dense = count == total  # every row active: plain causal
        # Most rows active (a reused prefix followed by computed text, say): plain causal
        # attention over queries scattered into a zero [heads, total, head_dim] tensor is exact
        # for the active rows and, on the kernels that skip the upper triangle, cheaper than
        # masked chunks. Sparse rows (cacheblend after its check layer) use the masked chunks.
        self.scatter = not self.dense and 2 * count >= total
        self._masks: dict[int | None, list[tuple[int, int, int, int, torch.Tensor]]] = {}

    def _chunks(self, window: int | None) -> list[tuple[int, int, int, int, torch.Tensor]]:
        if window not in self._masks:
            chunks = []
            count = self.positions.numel()
            for begin in range(0, count, _QUERY_CHUNK):
                end = min(begin + _QUERY_CHUNK, count)
                rows = self.positions[begin:end]
                key_end = int(rows[-1]) + 1
                key_begin = 0 if window is None else max(0, int(rows[0]) - window + 1)
                mask = _attention_mask(rows, key_end, window, self.decoder.dtype)
                chunks.append((begin, end, key_begin, key_end, mask[:, key_begin:]))
            self._masks[window] = chunks
        return self._masks[window]

    def __call__(
        self, layer: int, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> torch.Tensor:
        window = self.decoder.windows[layer]
        if self.dense and window is None:
            return self.decoder.attend(layer, queries, keys, values, None)
        if self.scatter and window is None:
            heads, _, head_dim = queries.shape
            padded = queries.new_zeros(heads, self.total, head_dim)
            padded.index_copy_(1, self.positions, queries)
            return self.decoder.attend(layer, padded, keys, values, None, rows=self.positions)
        outputs = [
            self.decoder.attend(
                layer,
                queries[:, begin:end],
                keys[:, key_begin:key_end],
                values[:, key_begin:key_end],
                mask,
            )
            for begin, end, key_begin, key_end, mask in self._chunks(window)
        ]
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)


class _Correction:
    """The stale-KV correction of one active set: what the recomputed rows say about the others.

    A moved document's KV was computed without the text that now precedes it. Its recomputed
    rows measure, at every layer, how much their fresh K and V differ from the cached ones; part
    of that change is shared by the whole document (the context it missed is the same for all
    of its tokens). ``share`` times the mean change of a document's recomputed rows is added to
    its rows that are not recomputed; a document with no recomputed rows gets the mean over
    every recomputed row. Keys are corrected before RoPE.
    """

    def __init__(
        self, kinds: torch.Tensor, span_index: torch.Tensor, active: torch.Tensor, share: float
    ) -> None:
        self.share = share
        moved = kinds == MOVED
        self.local = moved[active].nonzero().squeeze(1)  # recomputed moved rows, within active
        self.rows = active[self.local]
        stale = moved.clone()
        stale[active] = False
        self.rest = stale.nonzero().squeeze(1)  # moved rows read from the cache
        self.enabled = share > 0 and self.rows.numel() > 0 and self.rest.numel() > 0
        if not self.enabled:
            return
        spans = int(span_index.max()) + 1
        self.row_span = span_index[self.rows]
        counts = torch.bincount(self.row_span, minlength=spans)
        rest_span = span_index[self.rest]
        # Column ``spans`` of the mean table holds the mean over every recomputed row.
        self.rest_column = torch.where(counts[rest_span] > 0, rest_span, spans)
        self.divisor = torch.cat([counts, counts.new_tensor([self.rows.numel()])]).clamp_min(1)
        self.spans = spans

    def deltas(self, fresh: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
        """``share`` x the mean ``fresh - cached`` of each row's document, for `rest` rows.

        ``fresh`` and ``cached`` are ``[kv_heads, len(rows), head_dim]``.
        """
        change = (fresh - cached).float()
        sums = change.new_zeros(change.shape[0], self.spans + 1, change.shape[2])
        sums.index_add_(1, self.row_span, change)
        sums[:, self.spans] = change.sum(dim=1)
        means = sums * (self.share / self.divisor.to(sums.dtype)).view(1, -1, 1)
        return means[:, self.rest_column].to(fresh.dtype)


def _span_index(kinds: torch.Tensor, spans: Sequence[CachedSpan]) -> torch.Tensor:
    """``[tokens]``: the index of the moved span each moved row belongs to, -1 elsewhere."""
    index = torch.full(kinds.shape, -1, dtype=torch.long, device=kinds.device)
    for number, span in enumerate(s for s in spans if s.kind == MOVED):
        index[span.start : span.end] = number
    return index.masked_fill_(kinds != MOVED, -1)


def _select(score: torch.Tensor, moved_rows: torch.Tensor, keep: int) -> torch.Tensor:
    """Return the ``keep`` entries of ``moved_rows`` (indices into ``score``) scoring most."""
    if keep >= moved_rows.numel():
        return moved_rows
    if keep <= 0:
        return moved_rows[:0]
    top = torch.topk(score[moved_rows], keep, sorted=False).indices
    return moved_rows[top].sort().values


def tail_rows(kinds: torch.Tensor) -> torch.Tensor:
    """Positions of the uncached tail: the computed tokens after the last moved one.

    In a RAG prompt that is the question and the template text after it, the part of the prompt
    the answer is generated from.
    """
    moved = (kinds == MOVED).nonzero()
    start = int(moved[-1]) + 1 if moved.numel() else 0
    tail = (kinds[start:] == COMPUTE).nonzero().squeeze(1) + start
    return tail if tail.numel() else torch.tensor([kinds.numel() - 1], device=kinds.device)


def tail_attention(
    decoder: Decoder,
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
) -> torch.Tensor:
    """How much each token contributes to the attention output of ``queries``: ``[tokens]``.

    The attention weight each query pays each key, times the norm of that key's value (the
    size of what it adds to the output: attention sinks take much weight and add little),
    summed over heads and queries. ``queries`` are rotated ``[heads, rows, head_dim]``;
    ``keys`` (rotated) and ``values`` are ``[kv_heads, tokens, head_dim]`` (GQA: query head ``h``
    reads KV head ``h // groups``, as transformers' ``repeat_kv``); ``mask`` is the float32
    additive ``[rows, tokens]`` causal (and sliding-window) mask of the queries' positions.
    """
    kv_heads, total, head_dim = keys.shape
    groups = queries.shape[0] // kv_heads
    grouped = queries.reshape(kv_heads, groups * queries.shape[1], head_dim)
    scores = torch.bmm(grouped, keys.transpose(1, 2)).float() * decoder.scaling
    weights = (scores.view(kv_heads, groups, -1, total) + mask).softmax(dim=-1)
    return (weights.sum(dim=(1, 2)) * values.float().norm(dim=-1)).sum(dim=0)


@torch.inference_mode()
def select_by_attention(
    decoder: Decoder, blend_input: BlendInput, ratio: float
) -> tuple[torch.Tensor, torch.Tensor, BlendOutput]:
    """Return the moved positions the question draws most from, the scores and the probe pass.

    A probe pass computes only the uncached tokens (as ``reuse`` would) over the reused KV and
    sums, over every layer, head and tail query, what each token contributes to the attention
    output of the prompt's tail (`tail_attention`). The top ``ratio`` of moved tokens by that
    score are returned, sorted. The probe's KV (reused rows in place, rotated) is a starting
    point for the prefill that recomputes the selected rows.
    """
    kinds = blend_input.kinds.to(decoder.device)
    moved = (kinds == MOVED).nonzero().squeeze(1)
    probe = _forward(
        decoder, blend_input, (kinds == COMPUTE).nonzero().squeeze(1), {},
        need_logits=False, keep_raw_keys=False, probe_rows=tail_rows(kinds),
    )  # fmt: skip
    assert probe.scores is not None
    return _select(probe.scores, moved, round(ratio * moved.numel())), probe.scores, probe


@torch.inference_mode()
def run_blend(
    decoder: Decoder,
    blend_input: BlendInput,
    config: BlendConfig,
    *,
    need_logits: bool = True,
    keep_raw_keys: bool = False,
) -> BlendOutput:
    """Run the blended prefill of one prompt and return logits and the fused KV cache."""
    kinds = blend_input.kinds.to(decoder.device)
    checks = dict(config.schedule()) if config.strategy == "cacheblend" else {}
    probe_s = 0.0
    probe_token_layers = 0
    probe_load_s = 0.0
    start_kv = None
    moved_count = int((kinds == MOVED).sum())
    keep = round(config.recompute_ratio * moved_count)
    if config.strategy == "attention":
        active_mask = kinds == COMPUTE
        if 0 < keep < moved_count:  # otherwise nothing or everything is chosen: no probe
            started = time.perf_counter()
            selected, _, probe = select_by_attention(decoder, blend_input, config.recompute_ratio)
            active_mask[selected] = True
            start_kv = (probe.keys, probe.values)
            probe_token_layers = int(probe.stats["token_layers"])
            probe_load_s = float(probe.stats["load_s"])  # the probe read the cached KV
            probe_s = time.perf_counter() - started
        elif keep:
            active_mask |= kinds == MOVED
        active = active_mask.nonzero().squeeze(1)
    else:
        active = initial_active(kinds, blend_input.spans, config).nonzero().squeeze(1)
    out = _forward(
        decoder, blend_input, active, checks, deviation=config.deviation,
        need_logits=need_logits, keep_raw_keys=keep_raw_keys, start_kv=start_kv,
        correction=config.correction,
    )  # fmt: skip
    out.stats["probe_s"] = probe_s
    out.stats["load_s"] += probe_load_s
    out.stats["token_layers"] += probe_token_layers  # the probe's work counts too
    return out


def _forward(
    decoder: Decoder,
    blend_input: BlendInput,
    active: torch.Tensor,
    checks: dict[int, float],
    *,
    deviation: str = "value",
    need_logits: bool,
    keep_raw_keys: bool,
    probe_rows: torch.Tensor | None = None,
    start_kv: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None,
    correction: float = 0.0,
) -> BlendOutput:
    """Run the layer loop: compute the ``active`` positions, read the other rows from spans.

    ``start_kv``: rotated keys and values per layer of an earlier pass over the same prompt
    whose computed rows are a subset of ``active`` (the ``attention`` probe); they are updated
    in place instead of loading and rotating every cached row again (no check layers then).

    ``checks`` maps check layers to the ratio of moved tokens kept there (``cacheblend``, by
    ``deviation`` of the value or key projection).
    ``probe_rows`` (positions, a subset of ``active``): also sum the attention those rows pay
    every token at every layer into ``BlendOutput.scores``.
    ``correction``: the share of the mean K/V change of each moved document's recomputed rows
    added to its other rows at every layer (`_Correction`; 0: none).
    """
    device, dtype = decoder.device, decoder.dtype
    shape = decoder.shape
    token_ids = blend_input.token_ids.to(device)
    kinds = blend_input.kinds.to(device)
    total = token_ids.numel()
    positions = torch.arange(total, device=device)
    cos, sin = decoder.rotary(positions)
    sin = signed_sin(sin)

    moved_total = int((kinds == MOVED).sum())
    attention = _Attention(decoder, active, total)
    span_index = _span_index(kinds, blend_input.spans) if correction > 0 else None
    fix = None if span_index is None else _Correction(kinds, span_index, active, correction)
    hidden = decoder.embed(token_ids[active])
    scores = None
    probe_local = None
    probe_masks: dict[int | None, torch.Tensor] = {}  # per sliding window, built once
    if probe_rows is not None:
        probe_rows = probe_rows.to(device)
        scores = torch.zeros(total, device=device, dtype=torch.float32)
        probe_local = torch.searchsorted(active, probe_rows)
        for window in set(decoder.windows):
            probe_masks[window] = _attention_mask(probe_rows, total, window, torch.float32)

    keys_out: list[torch.Tensor] = []
    values_out: list[torch.Tensor] = []
    raw_out: list[torch.Tensor] | None = [] if keep_raw_keys else None
    load_s = 0.0
    token_layers = 0
    last_layer = shape.num_layers - 1
    if start_kv is not None and (checks or keep_raw_keys):
        raise ValueError("start_kv cannot be combined with check layers or raw keys")
    for i in range(shape.num_layers):
        dense = active.numel() == total and i not in checks
        if start_kv is not None:
            keys, values = start_kv[0][i], start_kv[1][i]
        elif not dense:
            # Cached K/V of this layer, written into full-length buffers.
            loaded = time.perf_counter()
            raw_keys = torch.empty(
                shape.num_kv_heads, total, shape.head_dim, device=device, dtype=dtype
            )
            values = torch.empty_like(raw_keys)
            for span in blend_input.spans:
                span_keys, span_values = span.source.layer(i)
                raw_keys[:, span.start : span.end] = span_keys
                values[:, span.start : span.end] = span_values
            load_s += time.perf_counter() - loaded
        if i in checks:
            # Only the compared projection runs over every active row; the rows kept after the
            # selection get their queries, keys and values below.
            use_keys = deviation == "key"
            fresh = decoder.project_kv(i, hidden, keys=use_keys)
            cached = (raw_keys if use_keys else values).index_select(1, active)
            rows = _select(
                (fresh.float() - cached.float()).pow(2).sum(dim=(0, 2)),
                (kinds[active] == MOVED).nonzero().squeeze(1),
                round(checks[i] * moved_total),
            )
            rows = torch.cat([(kinds[active] == COMPUTE).nonzero().squeeze(1), rows]).sort().values
            active = active.index_select(0, rows)
            hidden = hidden.index_select(0, rows)
            attention = _Attention(decoder, active, total)
            if span_index is not None:
                fix = _Correction(kinds, span_index, active, correction)

        queries, fresh_keys, fresh_values = decoder.project(i, hidden)
        if fix is not None and fix.enabled:
            # Before the recomputed rows overwrite their cached K/V: the rest move by part of
            # the change those rows show (keys un-rotated on both sides).
            cached_keys = (
                raw_keys.index_select(1, fix.rows)
                if start_kv is None
                else apply_rope(keys.index_select(1, fix.rows), cos[fix.rows], -sin[fix.rows])
            )
            key_change = fix.deltas(fresh_keys.index_select(1, fix.local), cached_keys)
            value_change = fix.deltas(
                fresh_values.index_select(1, fix.local), values.index_select(1, fix.rows)
            )
            values.index_add_(1, fix.rest, value_change)
            if start_kv is None:
                raw_keys.index_add_(1, fix.rest, key_change)
            else:
                rest = fix.rest
                keys.index_add_(1, rest, apply_rope(key_change, cos[rest], sin[rest]))
        if start_kv is not None:
            # Only the computed rows change; the others are rotated already.
            keys.index_copy_(1, active, apply_rope(fresh_keys, cos[active], sin[active]))
            values.index_copy_(1, active, fresh_values)
        else:
            if dense:
                # Every row is computed here: the fresh K/V are the layer's whole KV.
                raw_keys, values = fresh_keys.contiguous(), fresh_values.contiguous()
            else:
                raw_keys.index_copy_(1, active, fresh_keys)
                values.index_copy_(1, active, fresh_values)
            keys = apply_rope(raw_keys, cos, sin)
        token_layers += active.numel()
        if i < last_layer or need_logits or scores is not None:
            queries = apply_rope(queries, cos[active], sin[active])
            if scores is not None:
                assert probe_rows is not None and probe_local is not None
                rows_q = queries.index_select(1, probe_local)
                mask = probe_masks[decoder.windows[i]]
                scores += tail_attention(decoder, rows_q, keys, values, mask)
            if i < last_layer:
                hidden = hidden + attention(i, queries, keys, values)
                hidden = decoder.feed_forward(i, hidden)
            elif need_logits:
                # Only the last row's output is used (the logits); the other rows' K/V of
                # this layer are already written.
                last = positions[-1:]
                mask = _attention_mask(last, total, decoder.windows[i], dtype)
                out = decoder.attend(i, queries[:, -1:], keys, values, mask)
                hidden = decoder.feed_forward(i, hidden[-1:] + out)
        keys_out.append(keys)
        values_out.append(values)
        if raw_out is not None:
            raw_out.append(raw_keys)

    logits = None
    if need_logits:
        if int(active[-1]) != total - 1:
            raise RuntimeError("the last prompt token must be computed to produce logits")
        logits = decoder.logits(hidden)
    stats = {
        "load_s": load_s,
        "recomputed_tokens": int((kinds[active] == MOVED).sum()),
        "token_layers": token_layers,
        "token_layers_full": total * shape.num_layers,
        "moved_tokens": moved_total,
    }
    return BlendOutput(logits, keys_out, values_out, raw_out, stats, scores)
