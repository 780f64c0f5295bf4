"""The blended prefill: one plain loop over the decoder's layers.

A selector (`kvblend.engine.selectors`) picks the rows computed from layer 0 on: the uncached
tokens always, and the reused tokens its strategy recomputes. The computed rows are known on
the host before the first layer, so every size and index the loop needs (attention chunks, the
correction's rows) is set up once per pass and no layer reads a value back from the device.
The prompt's un-rotated KV of every layer lives in one preallocated buffer (`PromptKV`,
`prompt_kv.py`). At every layer the loop then

1. waits for the layer's cached KV: the first layer that reads cached KV issues its copies, a
   group of layers per copy (every document's keys and values at once, straight from the
   stored tensors) with one event per group, for every layer from it on when the pass computes
   only some rows; on CUDA they run on a side stream, so later groups load while earlier
   layers compute (one group of every layer on the CPU; a second pass takes over the first
   pass's buffer and waits on its copies),
2. lets the selector narrow the computed rows, at its refine layers,
3. projects the computed rows (keys and values in one product), moves the stale cached rows by
   the correction (`correction.py`) and writes the fresh K/V over their cached rows (one op),
4. rotates the whole layer's keys in one step (`rotate`, over a table of every position made
   once per prefill), attends the computed rows over them (`row_attention.py`) and runs the MLP.

Keys are kept un-rotated (before RoPE) and rotated to their prompt positions with the model's own
rotary embedding, so re-placing a cached segment is exact. Read `blend_io.py` for the token kinds.
A prefill can be cancelled between layers (``cancel``, a `threading.Event`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from .blend_io import (
    COMPUTE,
    MOVED,
    PREFIX,
    BlendInput,
    BlendOutput,
    CachedSpan,
    LayerKV,
    host_rows,
    moved_span_index,
    moved_spans_read,
    on_host,
    read_back,
    to_device,
)
from .config import BlendConfig
from .correction import StaleCorrection
from .decoder import Decoder, rope_table, rotate
from .prompt_kv import LayerLoads, PromptKV
from .results import BlendCancelledError
from .row_attention import RowAttention, attend
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
class PassState:
    """One pass over one prompt: the rows it computes and their hidden states, as layers go.

    ``computed`` are the sorted computed positions on the host; everything the loop needs
    about them (chunk bounds, the correction's rows) is derived there, never read back.
    """

    decoder: Decoder
    prompt: BlendInput
    host_kinds: np.ndarray
    table: torch.Tensor  # `rope_table` of every position
    kv: PromptKV
    computed: np.ndarray
    hidden: torch.Tensor  # [len(computed), hidden]
    share: float  # the stale-KV correction's share (0: off)
    loads: LayerLoads = field(init=False)  # the cached K/V's copies, a group of layers each
    rows: torch.Tensor = field(init=False)  # ``computed`` on the device
    row_table: torch.Tensor = field(init=False)
    attention: RowAttention = field(init=False)
    correction: StaleCorrection | None = field(init=False)
    load_s: float = 0.0
    token_layers: int = 0

    @property
    def total(self) -> int:
        return self.prompt.token_ids.numel()

    @property
    def every_row(self) -> bool:
        return self.computed.size == self.total

    def set_rows(self, computed: np.ndarray, rows: torch.Tensor) -> None:
        """Make ``computed`` (host) / ``rows`` (device) the computed rows: attention, correction."""
        self.computed, self.rows = computed, rows
        self.row_table = self.table.index_select(0, rows)
        self.attention = RowAttention(self.decoder, rows, self.total, host=computed)
        self.correction = None
        if self.share > 0 and not self.every_row:
            spans = moved_span_index(self.host_kinds, self.prompt.spans)
            self.correction = StaleCorrection(
                self.host_kinds, spans, computed, self.share, self.decoder.device
            )

    def narrow(self, keep: torch.Tensor | np.ndarray) -> None:
        """Keep only the computed rows ``keep`` (indices into ``computed``).

        ``keep`` on the device is read back (a host sync); on the host (an array) it is not.
        """
        if isinstance(keep, np.ndarray):
            host, keep = keep, to_device(keep, self.decoder.device)
        else:
            host = read_back(keep)
        self.hidden = self.hidden.index_select(0, keep)
        self.set_rows(self.computed[host], self.rows.index_select(0, keep))


def begin_pass(
    decoder: Decoder, prompt: BlendInput, table: torch.Tensor, computed: np.ndarray, share: float,
    start: BlendOutput | None,
) -> PassState:  # fmt: skip
    """Embed the computed rows and prepare their attention and correction.

    From ``start`` (a first pass), the pass takes over its K/V buffer and its copies, some of
    which may still be under way.
    """
    rows = to_device(computed, decoder.device)
    hidden = decoder.embed(prompt.token_ids.index_select(0, rows))
    assert prompt.host_kinds is not None
    if start is not None and start.raw_kv is not None:
        kv = PromptKV(start.raw_kv)
    else:
        kv = PromptKV.empty(decoder, prompt.token_ids.numel())
    state = PassState(decoder, prompt, prompt.host_kinds, table, kv, computed, hidden, share)
    state.loads = start.loads if start is not None and start.loads is not None else (
        LayerLoads.for_pass(decoder, kv, prompt.spans)
    )  # fmt: skip
    state.set_rows(computed, rows)
    return state


def write_fresh(state: PassState, layer: int) -> torch.Tensor:
    """Step 3: project the computed rows, correct the stale rows, write the fresh K/V.

    Returns the computed rows' un-rotated queries.
    """
    queries, fresh = state.decoder.project_rows(layer, state.hidden)
    state.token_layers += state.computed.size
    target = state.kv.data[layer]
    if state.every_row:
        target.copy_(fresh.permute(1, 2, 0, 3))
        return queries
    if state.correction is not None:  # before the fresh K/V overwrite the cached ones
        state.correction.apply(target, fresh)
    target.index_copy_(2, state.rows, fresh.permute(1, 2, 0, 3))
    return queries


def attend_and_mlp(
    state: PassState, layer: int, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
) -> None:
    """Step 4: the computed rows attend over the whole patched KV, then the MLP."""
    state.hidden = state.hidden + state.attention(layer, queries, keys, values)
    state.hidden = state.decoder.feed_forward(layer, state.hidden)


def check_cancel(cancel: threading.Event | None) -> None:
    """Raise `BlendCancelledError` once ``cancel`` is set (a host flag: no device sync)."""
    if cancel is not None and cancel.is_set():
        raise BlendCancelledError("the prefill was cancelled")


def load_cached(state: PassState, layer: int, refine_layers: frozenset[int]) -> None:
    """Step 1: have the cached K/V that ``layer`` reads placed, then wait for it.

    A layer reads cached K/V when the pass computes only some rows, or at a refine layer (which
    reads it to choose rows). The first such layer issues the copies (`LayerLoads`, a group of
    layers each): of every layer from it on when the pass computes only some rows (they all
    read it), else of that layer alone (a pass computing every row until a refine layer). Each
    layer then waits for its own group only, so on CUDA later groups load while it computes.
    """
    loads = state.loads
    if not loads.issued(layer) and (not state.every_row or layer in refine_layers):
        loaded = time.perf_counter()
        stop = state.decoder.shape.num_layers if not state.every_row else layer + 1
        loads.issue(range(layer, stop))
        state.load_s += time.perf_counter() - loaded
    loads.wait(layer)


def run_layers(
    state: PassState,
    selector: Selector | None,
    observer: PassObserver | None,
    need_logits: bool,
    cancel: threading.Event | None = None,
    stop: int | None = None,
) -> BlendOutput:
    """Run the layer loop of a pass and return its KV (and logits).

    Nothing in it reads a value back from the device (no host sync on CUDA), except a
    selector's refine step, which chooses rows by their values. ``stop``: run the first
    ``stop`` layers only (a probe; the copies of every layer are issued all the same).
    """
    decoder, prompt = state.decoder, state.prompt
    refine_layers = selector.refine_layers if selector is not None else frozenset()
    out = BlendOutput(None, [], [], [], raw_kv=state.kv.data, loads=state.loads)
    last = (decoder.shape.num_layers if stop is None else stop) - 1
    for layer in range(last + 1):
        check_cancel(cancel)
        load_cached(state, layer, refine_layers)  # step 1
        if layer in refine_layers:  # step 2: the selector narrows the computed rows
            assert selector is not None
            cached = (state.kv.data[layer, 0], state.kv.data[layer, 1])
            kinds = prompt.kinds
            state.narrow(selector.refine(decoder, layer, state.hidden, state.rows, kinds, cached))
        queries = write_fresh(state, layer)
        raw_keys, values = state.kv.data[layer, 0], state.kv.data[layer, 1]
        keys = rotate(raw_keys, state.table)
        if layer < last or need_logits or observer is not None:
            queries = rotate(queries, state.row_table)
            if observer is not None:
                observer.observe(layer, queries, keys, values)
            if layer < last:
                attend_and_mlp(state, layer, queries, keys, values)
            elif need_logits:  # only the last row's output feeds the logits
                state.hidden = last_row(decoder, layer, state.hidden, queries, keys, values)
        out.keys.append(keys)
        out.values.append(values)
        assert out.raw_keys is not None
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
    cancel: threading.Event | None = None,
    table: torch.Tensor | None = None,
    layers: int | None = None,
) -> BlendOutput:
    """One pass over the layers: compute ``selection.computed``, read the other rows' KV.

    ``layers``: run the first ``layers`` layers only (a probe: no logits).
    """
    share = selector.correction if selector is not None else 0.0
    refine_layers = selector.refine_layers if selector is not None else frozenset()
    start = selection.start
    reads_cache = selector is not None and selector.refine_reads_cache
    if start is not None and (keep_raw_keys or (refine_layers and reads_cache)):
        raise ValueError(
            "a start pass cannot be combined with raw keys or refine layers that read the cache"
        )
    blend_input = on_host(blend_input)
    total = blend_input.token_ids.numel()
    computed = host_rows(selection.computed)
    if need_logits and (computed[-1] != total - 1 or layers is not None):
        raise RuntimeError("logits need the last prompt token computed through every layer")
    if table is None:
        table = prompt_rope(decoder, total)
    state = begin_pass(decoder, blend_input, table, computed, share, start)
    out = run_layers(state, selector, observer, need_logits, cancel, layers)
    if not keep_raw_keys:
        out.raw_keys = None
    else:  # KV to be stored: tensors of their own, not views of one buffer
        assert out.raw_keys is not None
        out.raw_keys = [keys.clone() for keys in out.raw_keys]
        out.values = [values.clone() for values in out.values]
    out.stats = pass_stats(state, blend_input)
    return out


def pass_stats(state: PassState, blend_input: BlendInput) -> dict[str, float]:
    """Return what a pass did, counted on the host after its last layer."""
    kinds = state.host_kinds
    moved = kinds == MOVED
    return {
        "load_s": state.load_s,
        "recomputed_tokens": int(moved[state.computed].sum()),
        "token_layers": state.token_layers,
        "token_layers_full": state.total * state.decoder.shape.num_layers,
        "moved_tokens": int(moved.sum()),
        "moved_spans_read": moved_spans_read(blend_input.spans, state.computed, state.total),
    }


def last_row(
    decoder: Decoder,
    layer: int,
    hidden: torch.Tensor,
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
) -> torch.Tensor:
    """Run the last layer for the last row only.

    The other rows' K/V are written already and only the last row's output feeds the logits:
    it attends to every key (from the window's start on a sliding-window layer).
    """
    total = keys.shape[1]
    window = decoder.windows[layer]
    if window is not None and window < total:
        keys, values = keys[:, total - window :], values[:, total - window :]
    out = attend(decoder, layer, queries[:, -1:], keys, values, None, causal=False)
    return decoder.feed_forward(layer, hidden[-1:] + out)


def prompt_rope(decoder: Decoder, total: int) -> torch.Tensor:
    """Return the `rope_table` of positions ``0..total-1`` (made once per prefill)."""
    cos, sin = decoder.rotary(torch.arange(total, device=decoder.device))
    return rope_table(cos, sin)


def selection_context(
    decoder: Decoder,
    blend_input: BlendInput,
    cancel: threading.Event | None = None,
    table: torch.Tensor | None = None,
) -> SelectionContext:
    """Return what a selector sees of a prompt (``blend_input`` on the decoder's device).

    Its kinds are on the host; its first passes compute the rows a selector names and read the
    rest from the cache.
    """
    blend_input = on_host(blend_input)
    assert blend_input.host_kinds is not None

    def first_pass(
        computed: torch.Tensor, observer: PassObserver, layers: int | None = None
    ) -> BlendOutput:
        selection = Selection(computed)
        return run_pass(
            decoder, blend_input, selection, observer=observer, need_logits=False,
            cancel=cancel, table=table, layers=layers,
        )  # fmt: skip

    kinds = torch.from_numpy(blend_input.host_kinds)
    return SelectionContext(decoder, kinds, blend_input.spans, first_pass)


@torch.inference_mode()
def run_blend(
    decoder: Decoder,
    blend_input: BlendInput,
    config: BlendConfig,
    *,
    need_logits: bool = True,
    keep_raw_keys: bool = False,
    cancel: threading.Event | None = None,
) -> BlendOutput:
    """Run the blended prefill of one prompt and return logits and the fused KV cache.

    ``cancel``: checked between layers; once set, `BlendCancelledError` is raised.
    """
    blend_input = on_host(blend_input)
    device = decoder.device
    blend_input = BlendInput(
        to_device(blend_input.token_ids, device), to_device(blend_input.kinds, device),
        blend_input.spans,
        blend_input.host_kinds,
    )  # fmt: skip
    selector = selector_class(config.strategy)(config.settings)
    table = prompt_rope(decoder, blend_input.token_ids.numel())
    started = time.perf_counter()
    selection = selector.select(selection_context(decoder, blend_input, cancel, table))
    select_s = time.perf_counter() - started
    out = run_pass(
        decoder, blend_input, selection, selector=selector, need_logits=need_logits,
        keep_raw_keys=keep_raw_keys, cancel=cancel, table=table,
    )  # fmt: skip
    out.stats["probe_s"] = 0.0
    if selection.start is not None:  # the first pass's work and reads count too
        out.stats["probe_s"] = select_s
        out.stats["load_s"] += selection.start.stats["load_s"]
        out.stats["token_layers"] += selection.start.stats["token_layers"]
    return out
