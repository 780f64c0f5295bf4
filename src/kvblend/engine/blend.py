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


def _select(deviation: torch.Tensor, moved_rows: torch.Tensor, keep: int) -> torch.Tensor:
    """Rows (indices into the active set) of the ``keep`` moved rows that deviate most."""
    if keep >= moved_rows.numel():
        return moved_rows
    if keep <= 0:
        return moved_rows[:0]
    top = torch.topk(deviation[moved_rows], keep, sorted=False).indices
    return moved_rows[top].sort().values


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
    device, dtype = decoder.device, decoder.dtype
    shape = decoder.shape
    token_ids = blend_input.token_ids.to(device)
    kinds = blend_input.kinds.to(device)
    total = token_ids.numel()
    positions = torch.arange(total, device=device)
    cos, sin = decoder.rotary(positions)
    sin = signed_sin(sin)

    active = initial_active(kinds, blend_input.spans, config).nonzero().squeeze(1)
    moved_total = int((kinds == MOVED).sum())
    checks = dict(config.schedule()) if config.strategy == "cacheblend" else {}
    attention = _Attention(decoder, active, total)
    hidden = decoder.embed(token_ids[active])

    keys_out: list[torch.Tensor] = []
    values_out: list[torch.Tensor] = []
    raw_out: list[torch.Tensor] | None = [] if keep_raw_keys else None
    load_s = 0.0
    token_layers = 0
    last_layer = shape.num_layers - 1
    for i in range(shape.num_layers):
        dense = active.numel() == total and i not in checks
        if not dense:
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
            use_keys = config.deviation == "key"
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

        queries, fresh_keys, fresh_values = decoder.project(i, hidden)
        if dense:
            # Every row is computed here: the fresh K/V are the layer's whole KV.
            raw_keys, values = fresh_keys.contiguous(), fresh_values.contiguous()
        if not dense:
            raw_keys.index_copy_(1, active, fresh_keys)
            values.index_copy_(1, active, fresh_values)
        keys = apply_rope(raw_keys, cos, sin)
        token_layers += active.numel()
        if i < last_layer or need_logits:
            queries = apply_rope(queries, cos[active], sin[active])
            hidden = hidden + attention(i, queries, keys, values)
            hidden = decoder.feed_forward(i, hidden)
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
    return BlendOutput(logits, keys_out, values_out, raw_out, stats)
