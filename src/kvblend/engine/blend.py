"""The blended prefill: one plain loop over the decoder's layers.

A selector (`kvblend.engine.selectors`) picks the rows computed from layer 0 on: the uncached
tokens always, and the reused tokens its strategy recomputes. At every layer the loop then

1. loads the layer's cached KV into full-length buffers (or takes a first pass's KV),
2. lets the selector narrow the computed rows, at its refine layers,
3. projects the computed rows, moves the stale cached rows by the correction (`correction.py`)
   and writes the fresh K/V over their cached rows,
4. attends the computed rows over the whole patched KV (`row_attention.py`) and runs the MLP.

Keys are kept un-rotated (before RoPE) and rotated to their prompt positions with the model's own
rotary embedding, so re-placing a cached segment is exact. Read `blend_io.py` for the token kinds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .blend_io import (
    COMPUTE,
    MOVED,
    PREFIX,
    BlendInput,
    BlendOutput,
    CachedSpan,
    LayerKV,
    moved_span_index,
)
from .config import BlendConfig
from .correction import StaleCorrection
from .decoder import Decoder, apply_rope, signed_sin
from .row_attention import RowAttention, attention_mask
from .selectors import Selection, SelectionContext, Selector, selector_class
from .selectors.base import PassObserver

__all__ = [
    "COMPUTE",
    "MOVED",
    "PREFIX",
    "BlendInput",
    "BlendOutput",
    "CachedSpan",
    "LayerKV",
    "run_blend",
    "run_pass",
    "selection_context",
]


@dataclass
class Rotary:
    """The prompt's RoPE tables: ``cos`` and the signed ``sin`` of every position."""

    cos: torch.Tensor
    sin: torch.Tensor

    def rotate(self, x: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` rotated to positions ``rows`` (every position when None)."""
        if rows is None:
            return apply_rope(x, self.cos, self.sin)
        return apply_rope(x, self.cos[rows], self.sin[rows])

    def unrotate(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return apply_rope(x, self.cos[rows], -self.sin[rows])


class CachedBuffers:
    """A layer's KV loaded from the cache: un-rotated keys, rotated once after the writes."""

    def __init__(self, raw_keys: torch.Tensor, values: torch.Tensor, rotary: Rotary) -> None:
        self.raw_keys, self.values, self.rotary = raw_keys, values, rotary

    def cached_keys(self, rows: torch.Tensor) -> torch.Tensor:
        return self.raw_keys.index_select(1, rows)

    def shift(self, rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.values.index_add_(1, rows, values)
        self.raw_keys.index_add_(1, rows, keys)

    def write(self, rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.raw_keys.index_copy_(1, rows, keys)
        self.values.index_copy_(1, rows, values)

    def finish(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return self.rotary.rotate(self.raw_keys), self.values, self.raw_keys


class StartBuffers(CachedBuffers):
    """A layer's KV taken from a first pass: keys already rotated, updated in place."""

    def cached_keys(self, rows: torch.Tensor) -> torch.Tensor:
        return self.rotary.unrotate(self.raw_keys.index_select(1, rows), rows)

    def shift(self, rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.values.index_add_(1, rows, values)
        self.raw_keys.index_add_(1, rows, self.rotary.rotate(keys, rows))

    def write(self, rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.raw_keys.index_copy_(1, rows, self.rotary.rotate(keys, rows))
        self.values.index_copy_(1, rows, values)

    def finish(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return self.raw_keys, self.values, None


def load_cached(
    decoder: Decoder, spans: list[CachedSpan], layer: int, total: int, rotary: Rotary
) -> CachedBuffers:
    """Return the cached un-rotated K/V of ``layer`` written into full-length buffers.

    Rows no span covers are left unset: they are computed, so written before they are read.
    """
    shape = decoder.shape
    raw_keys = torch.empty(
        shape.num_kv_heads, total, shape.head_dim, device=decoder.device, dtype=decoder.dtype
    )
    values = torch.empty_like(raw_keys)
    for span in spans:
        span_keys, span_values = span.source.layer(layer)
        raw_keys[:, span.start : span.end] = span_keys
        values[:, span.start : span.end] = span_values
    return CachedBuffers(raw_keys, values, rotary)


@dataclass
class PassState:
    """One pass over one prompt: the rows it computes and their hidden states, as layers go."""

    decoder: Decoder
    prompt: BlendInput
    rotary: Rotary
    computed: torch.Tensor  # sorted positions
    hidden: torch.Tensor  # [len(computed), hidden]
    share: float  # the stale-KV correction's share (0: off)
    attention: RowAttention | None = None
    correction: StaleCorrection | None = None
    load_s: float = 0.0
    token_layers: int = 0

    @classmethod
    def begin(
        cls, decoder: Decoder, prompt: BlendInput, computed: torch.Tensor, share: float
    ) -> PassState:
        """Embed the computed rows and prepare their attention and correction."""
        positions = torch.arange(prompt.token_ids.numel(), device=decoder.device)
        cos, sin = decoder.rotary(positions)
        hidden = decoder.embed(prompt.token_ids[computed])
        state = cls(decoder, prompt, Rotary(cos, signed_sin(sin)), computed, hidden, share)
        state.narrow(None)
        return state

    @property
    def total(self) -> int:
        return self.prompt.token_ids.numel()

    def narrow(self, keep: torch.Tensor | None) -> None:
        """Keep only the computed rows ``keep`` (indices into ``computed``; None: all)."""
        if keep is not None:
            self.computed = self.computed.index_select(0, keep)
            self.hidden = self.hidden.index_select(0, keep)
        kinds = self.prompt.kinds
        self.attention = RowAttention(self.decoder, self.computed, self.total)
        if self.share > 0:
            spans = moved_span_index(kinds, self.prompt.spans)
            self.correction = StaleCorrection(kinds, spans, self.computed, self.share)


def load_layer(
    state: PassState, layer: int, start: BlendOutput | None, refine: bool
) -> CachedBuffers | None:
    """Step 1: the layer's KV buffers (None: every row is computed, nothing to read)."""
    if start is not None:
        return StartBuffers(start.keys[layer], start.values[layer], state.rotary)
    if state.computed.numel() == state.total and not refine:
        return None
    loaded = time.perf_counter()
    buffers = load_cached(state.decoder, state.prompt.spans, layer, state.total, state.rotary)
    state.load_s += time.perf_counter() - loaded
    return buffers


def write_fresh(
    state: PassState, layer: int, buffers: CachedBuffers | None
) -> tuple[torch.Tensor, CachedBuffers]:
    """Step 3: project the computed rows, correct the stale rows, write the fresh K/V.

    Returns the computed rows' un-rotated queries and the layer's patched buffers.
    """
    queries, fresh_keys, fresh_values = state.decoder.project(layer, state.hidden)
    state.token_layers += state.computed.numel()
    if buffers is None:  # every row computed: the fresh K/V are the layer's whole KV
        return queries, CachedBuffers(
            fresh_keys.contiguous(), fresh_values.contiguous(), state.rotary
        )
    correct_stale(state.correction, buffers, fresh_keys, fresh_values)
    buffers.write(state.computed, fresh_keys, fresh_values)
    return queries, buffers


def correct_stale(
    correction: StaleCorrection | None,
    buffers: CachedBuffers,
    fresh_keys: torch.Tensor,
    fresh_values: torch.Tensor,
) -> None:
    """Move the stale cached rows by part of the change their recomputed neighbours show.

    Runs before the recomputed rows overwrite their cached K/V (keys un-rotated on both sides).
    """
    if correction is None or not correction.enabled:
        return
    rows, local = correction.recomputed, correction.recomputed_local
    key_change = correction.deltas(fresh_keys.index_select(1, local), buffers.cached_keys(rows))
    value_change = correction.deltas(
        fresh_values.index_select(1, local), buffers.values.index_select(1, rows)
    )
    buffers.shift(correction.stale, key_change, value_change)


def attend_and_mlp(
    state: PassState, layer: int, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
) -> None:
    """Step 4: the computed rows attend over the whole patched KV, then the MLP."""
    assert state.attention is not None
    state.hidden = state.hidden + state.attention(layer, queries, keys, values)
    state.hidden = state.decoder.feed_forward(layer, state.hidden)


def run_layers(
    state: PassState,
    start: BlendOutput | None,
    selector: Selector | None,
    observer: PassObserver | None,
    need_logits: bool,
    keep_raw_keys: bool,
) -> BlendOutput:
    """Run the layer loop of a pass and return its KV (and logits).

    Nothing in it reads a value back from the device (no host sync on CUDA), except a
    selector's refine step, which chooses rows by their values.
    """
    decoder, prompt = state.decoder, state.prompt
    refine_layers = selector.refine_layers if selector is not None else frozenset()
    out = BlendOutput(None, [], [], [] if keep_raw_keys else None)
    last = decoder.shape.num_layers - 1
    for layer in range(last + 1):
        buffers = load_layer(state, layer, start, layer in refine_layers)
        if layer in refine_layers:  # step 2: the selector narrows the computed rows
            assert selector is not None and buffers is not None
            cached = (buffers.raw_keys, buffers.values)
            kinds = prompt.kinds
            state.narrow(
                selector.refine(decoder, layer, state.hidden, state.computed, kinds, cached)
            )
        queries, buffers = write_fresh(state, layer, buffers)
        keys, values, raw_keys = buffers.finish()
        if layer < last or need_logits or observer is not None:
            queries = state.rotary.rotate(queries, state.computed)
            if observer is not None:
                observer.observe(layer, queries, keys, values)
            if layer < last:
                attend_and_mlp(state, layer, queries, keys, values)
            elif need_logits:  # only the last row's output feeds the logits
                state.hidden = last_row(decoder, layer, state.hidden, queries, keys, values)
        out.keys.append(keys)
        out.values.append(values)
        if out.raw_keys is not None and raw_keys is not None:
            out.raw_keys.append(raw_keys)
    if need_logits:
        out.logits = decoder.logits(state.hidden)
    return out


def run_pass(
    decoder: Decoder,
    blend_input: BlendInput,
    selection: Selection,
    *,
    selector: Selector | None = None,
    observer: PassObserver | None = None,
    need_logits: bool = True,
    keep_raw_keys: bool = False,
) -> BlendOutput:
    """One pass over the layers: compute ``selection.computed``, read the other rows' KV."""
    share = selector.correction if selector is not None else 0.0
    refine_layers = selector.refine_layers if selector is not None else frozenset()
    start = selection.start
    if start is not None and (refine_layers or keep_raw_keys):
        raise ValueError("a start pass cannot be combined with refine layers or raw keys")
    total = blend_input.token_ids.numel()
    if need_logits and int(selection.computed[-1]) != total - 1:
        raise RuntimeError("the last prompt token must be computed to produce logits")
    state = PassState.begin(decoder, blend_input, selection.computed, share)
    out = run_layers(state, start, selector, observer, need_logits, keep_raw_keys)
    kinds = blend_input.kinds
    out.stats = {
        "load_s": state.load_s,
        "recomputed_tokens": int((kinds[state.computed] == MOVED).sum()),
        "token_layers": state.token_layers,
        "token_layers_full": total * decoder.shape.num_layers,
        "moved_tokens": int((kinds == MOVED).sum()),
        "moved_spans_read": moved_spans_read(blend_input.spans, state.computed, total),
    }
    return out


def moved_spans_read(spans: list[CachedSpan], computed: torch.Tensor, total: int) -> int:
    """How many moved spans kept some cached rows (were not recomputed whole)."""
    done = torch.zeros(total, dtype=torch.bool, device=computed.device)
    done[computed] = True
    return sum(1 for s in spans if s.kind == MOVED and not bool(done[s.start : s.end].all()))


def last_row(
    decoder: Decoder,
    layer: int,
    hidden: torch.Tensor,
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
) -> torch.Tensor:
    """Run the last layer for the last row only.

    The other rows' K/V are written already and only the last row's output feeds the logits.
    """
    total = keys.shape[1]
    last = torch.arange(total - 1, total, device=keys.device)  # made on the device: no copy
    mask = attention_mask(last, 0, total, decoder.windows[layer], decoder.dtype)
    out = decoder.attend(layer, queries[:, -1:], keys, values, mask)
    return decoder.feed_forward(layer, hidden[-1:] + out)


def selection_context(decoder: Decoder, blend_input: BlendInput) -> SelectionContext:
    """Return what a selector sees of a prompt (``blend_input`` on the decoder's device).

    Its first passes compute the rows a selector names and read the rest from the cache.
    """

    def first_pass(computed: torch.Tensor, observer: PassObserver) -> BlendOutput:
        selection = Selection(computed)
        return run_pass(decoder, blend_input, selection, observer=observer, need_logits=False)

    return SelectionContext(decoder, blend_input.kinds, blend_input.spans, first_pass)


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
    device = decoder.device
    blend_input = BlendInput(
        blend_input.token_ids.to(device), blend_input.kinds.to(device), blend_input.spans
    )
    selector = selector_class(config.strategy)(config.settings)
    started = time.perf_counter()
    selection = selector.select(selection_context(decoder, blend_input))
    select_s = time.perf_counter() - started
    out = run_pass(
        decoder, blend_input, selection, selector=selector,
        need_logits=need_logits, keep_raw_keys=keep_raw_keys,
    )  # fmt: skip
    out.stats["probe_s"] = 0.0
    if selection.start is not None:  # the first pass's work and reads count too
        out.stats["probe_s"] = select_s
        out.stats["load_s"] += selection.start.stats["load_s"]
        out.stats["token_layers"] += selection.start.stats["token_layers"]
    return out
