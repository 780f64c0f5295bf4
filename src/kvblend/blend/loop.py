"""One pass of the blended prefill: a plain loop over the model's layers, through its adapter.

A pass computes some of the prompt's rows (a `Selection`: the uncached tokens always, and the
reused tokens the strategy recomputes) and reads the others' K/V from the cache; the prefill
(`prefill.run_blend`) runs one, after the selector's first passes if it asks for some. Rows a
selector chose by value on the device (the default's probe, CacheBlend's check layer) stay
there: their count is known on the host, the sorted rows, their RoPE table, attention masks and
the correction are built from them with device ops, and the host learns which rows they were
only after the logits (for the statistics). The prompt's K/V of every layer lives in one
preallocated buffer (`PromptKV`, `kv_buffer.py`), keys rotated to their positions.

`run_pass` checks the selection, begins the pass (`begin_pass`: the buffer, the computed rows'
embeddings, attention and correction) and runs `run_layers`, which at every layer

1. waits for the layer's cached K/V (`load_cached`): the first layer that reads cached K/V
   issues its copies, a group of layers per copy (every document's keys and values at once,
   straight from the stored tensors, in host memory or on the device), each group's keys
   rotated once as they land, with one event per group, for every layer from it on when the
   pass computes only some rows; on CUDA they run on a side stream, so later groups load while
   earlier layers compute (one group of every layer on the CPU; a second pass takes over the
   first pass's buffer and waits on its copies),
2. lets the selector narrow the computed rows, at its refine layers (`refine`),
3. runs the layer (`compute_layer`, `layer_step.py`): projects the computed rows, rotates their
   queries and keys, moves the stale cached rows by the correction, writes the fresh K/V (one
   op), attends the computed rows over the whole layer (`attention/`) and runs the MLP. The
   step is a pure function, run eagerly or compiled (`compiled.py`, ``KVBLEND_COMPILE``: one
   graph per size bucket for every layer),

then counts what the pass did (`pass_stats`), after its logits.

The loop calls the model only through the `ModelAdapter` protocol (`adapter.py`). Keys are
stored un-rotated and rotated with the model's own rotary embedding, so re-placing a cached
segment is exact. Read `types.py` for the token kinds. A pass can pause between layers (``pause``:
the vLLM connector's blends yield there until the engine's next step) and be cancelled there
(``cancel``: a `threading.Event`, or any `CancelFlag`); a pass that stops orders the compute
stream after every copy it issued before its buffer is handed back (`LayerLoads.fence`).

Precompute runs documents through the same loop: strategy ``full`` over a batch of right-padded
sequences laid one after another (`BlendInput.sequences`), each at positions ``0..n-1`` (its
RoPE table repeated) and attending to its own rows only (`SequenceAttention`), eagerly.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from kvblend.blend.adapter import ModelAdapter
from kvblend.blend.attention.rows import RowAttention, SequenceAttention
from kvblend.blend.compiled import StepRunner, step_runner
from kvblend.blend.correction import CorrectionTensors, stale_correction
from kvblend.blend.kv_buffer import LayerLoads, PromptKV
from kvblend.blend.layer_step import FULL, LAST, WRITE
from kvblend.blend.op_threads import ELEMENT_WORK, big, small_ops
from kvblend.blend.rope import RopeTables, inverse_table, rope_tables, rotate
from kvblend.blend.selectors import Selection, Selector
from kvblend.blend.selectors.base import Narrowing, PassObserver
from kvblend.blend.types import (
    COMPUTE,
    MOVED,
    BlendInput,
    BlendOutput,
    PassCounts,
    RowSet,
    RowsRead,
    as_rows,
    moved_span_index,
    on_host,
    rows_read,
    to_device,
)
from kvblend.errors import BlendCancelledError

__all__ = [
    "CancelFlag",
    "Pause",
    "PassState",
    "prompt_tables",
    "run_pass",
    "stop_if_cancelled",
    "with_kv",
]


class CancelFlag(Protocol):
    """What the loop asks between layers whether to stop (a `threading.Event` is one)."""

    def is_set(self) -> bool:
        """Whether the prefill is cancelled."""
        ...


@dataclass
class PassState:
    """One pass over one prompt: the rows it computes and their hidden states, as layers go.

    ``rows`` are the computed rows; the layer step gets ``padded``, the same positions
    followed by the padding rows of a compiled loop's row bucket (copies of the last row; none
    in the eager loop), and ``hidden`` holds a row for each.
    """

    adapter: ModelAdapter
    prompt: BlendInput
    host_kinds: np.ndarray
    tables: RopeTables
    kv: PromptKV
    share: float  # the stale-KV correction's share (0: off)
    runner: StepRunner
    temperature: float = 1.0  # the stale rows' attention temperature (1: off)
    loads: LayerLoads = field(init=False)  # the cached K/V's copies, a group of layers each
    rows: RowSet = field(init=False)
    padded: torch.Tensor = field(init=False)  # the positions the step computes
    hidden: torch.Tensor = field(init=False)  # [padded rows, hidden]
    row_table: torch.Tensor = field(init=False)  # the RoPE table of ``padded``
    attention: RowAttention | SequenceAttention = field(init=False)
    correction: CorrectionTensors | None = field(init=False)
    load_s: float = 0.0
    token_layers: int = 0
    uncompiled: int = 0  # attention calls of earlier rows run uncompiled (a refused compile)

    @property
    def total(self) -> int:
        """The prompt's rows."""
        return self.prompt.token_ids.numel()

    @property
    def every_row(self) -> bool:
        """Whether the pass computes every row of the prompt."""
        return self.rows.count == self.total

    def set_rows(self, rows: RowSet, hidden: torch.Tensor) -> None:
        """Make ``rows`` (``hidden``: theirs) computed: their RoPE table, attention, correction.

        `begin_pass` sets the first rows, `narrow` the later ones.
        """
        adapter, total = self.adapter, self.total
        self.padded, self.hidden = self.runner.pad(rows.positions, hidden)
        if self.prompt.sequences > 1:  # a batch of sequences, every row computed
            self.attention = SequenceAttention(rows, self.prompt.sequences, adapter.scaling)
        else:
            padded = self.padded if self.runner.compiled else None
            self.attention = RowAttention(
                rows,
                total,
                adapter.windows,
                adapter.scaling,
                adapter.dtype,
                flex=self.runner.flex,
                length=self.kv.data.shape[3],
                padded=padded,
            )
        self.rows = rows = self.attention.rows  # read back when chunks need it (no bounds)
        self.row_table = self.tables.table.index_select(0, self.padded)
        self.correction = None
        if (self.share > 0 or self.temperature != 1.0) and not self.every_row:
            host = rows.host
            if host is not None and self.padded.numel() > rows.count:  # padding: the last row
                host = np.pad(host, (0, self.padded.numel() - rows.count), mode="edge")
            spans = moved_span_index(self.host_kinds, self.prompt.spans)
            self.correction = stale_correction(
                self.host_kinds,
                spans,
                RowSet(self.padded, host),
                self.share,
                self.tables.table,
                self.row_table,
                self.runner.bucket,
                self.temperature,
            )

    def narrow(self, narrowing: Narrowing) -> None:
        """Keep only the computed rows ``narrowing.keep`` (indices into the computed rows)."""
        keep = narrowing.keep
        if isinstance(keep, np.ndarray):
            keep = to_device(keep, self.adapter.device)
        self.uncompiled += self.attention.uncompiled  # the rows before: their refused compiles
        self.set_rows(narrowing.rows, self.hidden[: self.rows.count].index_select(0, keep))


def begin_pass(
    adapter: ModelAdapter,
    prompt: BlendInput,
    tables: RopeTables,
    rows: RowSet,
    share: float,
    start: BlendOutput | None,
    runner: StepRunner,
    corrected: bool,
    temperature: float = 1.0,
) -> PassState:
    """Embed the computed rows and prepare their attention and correction.

    From ``start`` (a first pass), the pass takes over its K/V buffer and its copies, some of
    which may still be under way. ``corrected``: a correction will read this buffer (this
    pass's or a later one's), so its uncached rows start as zeros.
    """
    assert prompt.host_kinds is not None
    total = prompt.token_ids.numel()
    if start is not None and start.kv is not None:
        kv = start.kv
    else:  # uncached rows zeroed: the correction reads every computed row's K/V
        zeroed = None
        if corrected and (prompt.host_kinds == MOVED).any():
            zeroed = to_device(np.flatnonzero(prompt.host_kinds == COMPUTE), adapter.device)
        kv = PromptKV.empty(
            adapter, total, tables.table.shape[0], zeroed, runner.compiled, runner.zero_to
        )
    state = PassState(adapter, prompt, prompt.host_kinds, tables, kv, share, runner, temperature)
    state.loads = (
        start.loads
        if start is not None and start.loads is not None
        else (LayerLoads.for_pass(adapter, kv, prompt.spans, tables.table))
    )
    state.set_rows(rows, adapter.embed(prompt.token_ids.index_select(0, rows.positions)))
    return state


#: Called between layers (and between entries read): returns when the prefill may go on, after
#: a while when it yields (the vLLM connector's pacing, `kvblend.vllm.execution.pacing`).
Pause = Callable[[], None]


def stop_if_cancelled(cancel: CancelFlag | None, pause: Pause | None = None) -> None:
    """Raise `BlendCancelledError` once ``cancel`` is set, before and after a ``pause`` there.

    ``cancel`` is a host flag: no device sync.
    """
    if cancel is not None and cancel.is_set():
        raise BlendCancelledError("the prefill was cancelled")
    if pause is not None:
        pause()
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
        stop = state.adapter.shape.num_layers if not state.every_row else layer + 1
        with big(state.kv.data[layer:stop].numel() * ELEMENT_WORK):  # copies and rotations
            loads.issue(range(layer, stop))
        state.load_s += time.perf_counter() - loaded
    loads.wait(layer)


def refine(state: PassState, selector: Selector, layer: int) -> None:
    """Step 2: the selector narrows the computed rows (from the cached K/V it may compare)."""
    count = state.rows.count  # the computed rows, padding left out
    cached: tuple[torch.Tensor, ...] = ()
    if selector.refine_reads_cache:  # the computed rows' cached K/V, keys before RoPE
        layer_kv = state.kv.data[layer].index_select(2, state.rows.positions)
        keys = rotate(layer_kv[0], inverse_table(state.row_table[:count]))
        cached = (keys, layer_kv[1])
    hidden = state.hidden[:count]
    kinds = state.prompt.kinds
    narrowing = selector.refine(state.adapter, layer, hidden, state.rows, kinds, cached)  # type: ignore[arg-type]
    state.narrow(narrowing)


def compute_layer(state: PassState, layer: int, mode: str, observer: PassObserver | None) -> None:
    """Step 3: run the layer over the computed rows (`layer_step`), then show it to ``observer``."""
    layer_kv = state.kv.layers[layer]
    state.hidden, queries = state.runner.step(
        state.adapter,
        layer,
        mode,
        state.hidden,
        layer_kv,
        state.padded,
        state.row_table,
        state.correction,
        state.attention,
    )
    state.token_layers += state.rows.count
    if observer is not None:
        total = state.total
        observer.observe(layer, queries, layer_kv[0, :, :total], layer_kv[1, :, :total])


def run_layers(
    state: PassState,
    selector: Selector | None,
    observer: PassObserver | None,
    need_logits: bool,
    cancel: CancelFlag | None = None,
    stop: int | None = None,
    pause: Pause | None = None,
) -> torch.Tensor | None:
    """Run the layer loop of a pass; return its logits (None when not needed).

    Nothing in it reads a value back from the device (no host sync on CUDA). ``stop``: run
    the first ``stop`` layers only (a probe; the copies of every layer are issued all the same).
    """
    refine_layers = selector.refine_layers if selector is not None else frozenset()
    last = (state.adapter.shape.num_layers if stop is None else stop) - 1
    device = state.adapter.device
    for layer in range(last + 1):
        stop_if_cancelled(cancel, pause)  # the thread count is the caller's here (a pause point)
        with small_ops(device):  # one CPU thread but for the big ops (`threads.big`)
            load_cached(state, layer, refine_layers)  # step 1
            if layer in refine_layers:  # step 2
                assert selector is not None
                refine(state, selector, layer)
            mode = FULL if layer < last else (LAST if need_logits else WRITE)
            compute_layer(state, layer, mode, observer)  # step 3
    if not need_logits:
        return None
    with small_ops(device):
        return state.adapter.logits(state.hidden)


def run_pass(
    adapter: ModelAdapter,
    blend_input: BlendInput,
    selection: Selection,
    *,
    selector: Selector | None = None,
    observer: PassObserver | None = None,
    need_logits: bool = True,
    cancel: CancelFlag | None = None,
    tables: RopeTables | None = None,
    layers: int | None = None,
    corrected: bool | None = None,
    after_logits: Callable[[torch.Tensor], torch.Tensor] | None = None,
    pause: Pause | None = None,
) -> BlendOutput:
    """One pass over the layers: compute ``selection.computed``, read the other rows' KV.

    ``layers``: run the first ``layers`` layers only (a probe: no logits). ``corrected``:
    whether a stale-KV correction reads the pass's buffer (default: the selector's).
    ``after_logits(logits)``: device values made from the logits (the guard's signals), read
    back with the pass's rows (``out.extra``).
    """
    share = selector.correction if selector is not None else 0.0
    temperature = selector.stale_temperature if selector is not None else 1.0
    start = selection.start
    blend_input = on_host(blend_input)
    rows = as_rows(selection.computed, adapter.device)
    check_pass(blend_input, rows, selector, start is not None, need_logits, layers)
    tables = tables if tables is not None else prompt_tables(adapter, blend_input)
    runner = pass_runner(adapter, blend_input)
    corrected = (share > 0 or temperature != 1.0) if corrected is None else corrected
    runner.begin(adapter.device)
    with small_ops(adapter.device):  # its rows' embedding, RoPE table, masks, correction
        state = begin_pass(
            adapter, blend_input, tables, rows, share, start, runner, corrected, temperature
        )
    try:
        logits = run_layers(state, selector, observer, need_logits, cancel, layers, pause)
    except BaseException:
        state.loads.fence()  # copies into the buffer may still run: the next user waits
        state.kv.release()  # a static buffer is handed back, not copied out
        raise
    out = BlendOutput(logits, [], [], kv=state.kv, loads=state.loads, tables=tables)
    extra = after_logits(logits) if after_logits is not None and logits is not None else None
    out.read, out.counts, out.extra = pass_stats(state, blend_input, extra)
    return with_kv(out, state.kv)


def check_pass(
    blend_input: BlendInput,
    rows: RowSet,
    selector: Selector | None,
    has_start: bool,
    need_logits: bool,
    layers: int | None,
) -> None:
    """Refuse a pass that cannot give what it is asked for, before any work."""
    if has_start and selector is not None and selector.refine_reads_cache:
        if selector.refine_layers:
            raise ValueError(
                "a start pass cannot be combined with refine layers that read the cache"
            )
    total = blend_input.token_ids.numel()
    bounds = rows.bounds()
    if need_logits and (layers is not None or (bounds is not None and bounds[0][-1] != total - 1)):
        raise RuntimeError("logits need the last prompt token computed through every layer")
    batch = blend_input.sequences
    if batch > 1 and (need_logits or blend_input.spans or rows.count != total or total % batch):
        raise ValueError("a batch of equal-length sequences is computed whole, without logits")


def with_kv(out: BlendOutput, kv: PromptKV) -> BlendOutput:
    """``out`` over ``kv``: its per-layer keys and values (views of the prompt's rows)."""
    rows = kv.prompt_rows()
    out.kv = kv
    out.keys, out.values = (
        [rows[i, 0] for i in range(len(rows))],
        [rows[i, 1] for i in range(len(rows))],
    )
    return out


def pass_stats(
    state: PassState, blend_input: BlendInput, extra: torch.Tensor | None = None
) -> tuple[RowsRead, PassCounts, list[float] | None]:
    """Return what a pass read and did, counted on the host after its last layer, and ``extra``.

    Rows chosen on the device are read back here, after the logits: the host learns which
    rows were recomputed only once the prefill's work is queued. ``extra`` (a few device
    values computed after the logits, the guard's signals) is read in the same read.
    """
    rows = state.rows
    values: list[float] | None = None
    if extra is None:
        computed = rows.host_positions()
    elif rows.host is not None:
        computed, values = rows.host, extra.tolist()
    else:  # one read for both: the rows are exact in float64 up to 2**53
        both = torch.cat((rows.positions.double(), extra.double().reshape(-1))).tolist()
        computed = np.asarray(both[: rows.count], dtype=np.int64)
        values = both[rows.count :]
    read = rows_read(state.host_kinds, blend_input.spans, computed)
    uncompiled = state.uncompiled + state.attention.uncompiled + state.runner.uncompiled
    counts = PassCounts(state.token_layers, state.load_s, uncompiled)
    return read, counts, values


def pass_runner(adapter: ModelAdapter, blend_input: BlendInput) -> StepRunner:
    """How a prompt's passes run (`step_runner`); a batch of sequences: eagerly, unpadded."""
    total = blend_input.token_ids.numel()
    if blend_input.sequences > 1:
        return StepRunner(flex=False, length=total)
    return step_runner(adapter, total)


def prompt_tables(adapter: ModelAdapter, blend_input: BlendInput) -> RopeTables:
    """Return the RoPE tables of a prompt's buffer rows (made once per prefill).

    A batch of sequences: one sequence's positions, repeated for each.
    """
    total, sequences = blend_input.token_ids.numel(), blend_input.sequences
    if sequences > 1:
        length = total // sequences
        table = rope_tables(adapter.rotary, length, length, adapter.device).table
        return RopeTables(table.repeat(sequences, 1, 1, 1))
    length = pass_runner(adapter, blend_input).length
    return rope_tables(adapter.rotary, total, length, adapter.device)
