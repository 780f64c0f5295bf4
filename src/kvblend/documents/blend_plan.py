"""From a prefill plan to blended K/V: the plan's stored entries opened, the blend loop run.

`blend_plan` is the one way from a `PrefillPlan` to the fused K/V, for `BlendEngine.prefill`
(transformers) and for the vLLM connector's worker (`kvblend.vllm.execution.worker`). What
differs between the two is a parameter, not a second copy:

- ``read_whole=False`` (the engine): each entry is opened where the store keeps it, and the loop
  reads it a group of layers at a time; a missing or unreadable entry is computed and stored
  now, and one that fails while its layers are read is recomputed in place (`StoredRows`).
- ``read_whole=True`` (vLLM): each entry is read whole onto the model's device before the loop
  (the store checks its checksum, shape, dtype and finite values as it reads), so one that is
  missing or cannot be used has its rows computed by the blend in full, as vLLM would compute
  them, and is listed in ``lost`` (vLLM stores it after its step).
- ``pause`` and ``cancel``: between two entries opened, as the loop between layers, the prefill
  may pause (the vLLM connector's blends yield there until the engine's next step,
  `kvblend.vllm.execution.pacing`) and is stopped once ``cancel`` is set.
- ``ranks`` (vLLM, read whole): the tensor-parallel ranks agree on the entries they use (one a
  rank could not read is computed on every rank), each reads its own KV heads of an entry, and
  none recomputes an entry alone: a rank's failed read fails the blend instead.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from kvblend.blend.adapter import ModelAdapter
from kvblend.blend.forecast import Lost
from kvblend.blend.loop import CancelFlag, Pause, stop_if_cancelled
from kvblend.blend.prefill import run_blend
from kvblend.blend.selectors import Selector
from kvblend.blend.types import COMPUTE, BlendInput, BlendOutput, CachedSpan
from kvblend.documents.segment_kv import SegmentKV
from kvblend.documents.stored_rows import StoredRows
from kvblend.prompt.plan import PlannedSpan, PrefillPlan

logger = logging.getLogger(__name__)

__all__ = ["PlanBlend", "Ranks", "blend_plan", "open_spans"]


class Ranks(Protocol):
    """Tensor-parallel ranks blending one prompt together.

    The vLLM connector's adapter is one (`kvblend.vllm.execution.adapter.VLLMAdapter`).
    """

    tp_size: int
    kv_heads: slice  # which of an entry's KV heads this rank reads

    def gather_ranks(self, values: torch.Tensor) -> torch.Tensor:
        """Return ``values`` ``[n]`` of every rank, ``[ranks, n]``."""
        ...


@dataclass
class PlanBlend:
    """What `blend_plan` did: the loop's output and how the plan's entries were read."""

    out: BlendOutput
    kinds: np.ndarray  # each token's kind as the loop ran it (an unusable entry's rows: COMPUTE)
    spans: list[CachedSpan]  # the cached spans the loop read
    computed: int = 0  # entries computed now: missing, unreadable, or failing while read
    open_s: float = 0.0  # opening (or reading) the entries, computing missing ones
    loop_s: float = 0.0  # the blend loop


def blend_plan(
    adapter: ModelAdapter,
    segment_kv: SegmentKV,
    plan: PrefillPlan,
    selector: Selector,
    *,
    read_whole: bool = False,
    ranks: Ranks | None = None,
    lost: list[Lost] | None = None,
    need_logits: bool = True,
    cancel: CancelFlag | None = None,
    pause: Pause | None = None,
) -> PlanBlend:
    """Open ``plan``'s entries from ``segment_kv``'s store, then run the blend loop on ``adapter``.

    ``selector``: the prefill's own (`BlendConfig.selector`). ``read_whole`` and ``ranks``: how
    entries are read (see the module); ``lost``: where the entries read whole but not used are
    listed, and why, as they are found. The plan is left as planned. ``need_logits``,
    ``cancel`` and ``pause`` go to `run_blend`.
    """
    began = time.perf_counter()
    kinds = np.array(plan.kinds, dtype=np.int8)  # a copy: rows of a lost entry become COMPUTE
    spans: list[CachedSpan] = []
    computed = 0
    if selector.reads_cache:  # else the strategy computes every row
        device = adapter.device if read_whole else None
        spans, computed = open_spans(
            segment_kv,
            plan,
            kinds,
            device=device,
            ranks=ranks,
            lost=lost,
            cancel=cancel,
            pause=pause,
        )
    token_ids = torch.from_numpy(np.array(plan.token_ids, dtype=np.int64))
    opened = time.perf_counter()
    blend_input = BlendInput(token_ids, torch.from_numpy(kinds), spans, kinds)
    out = run_blend(
        adapter, blend_input, selector, need_logits=need_logits, cancel=cancel, pause=pause
    )
    # entries that failed while their layers were read, recomputed in place
    computed += sum(bool(getattr(span.source, "recomputed", False)) for span in spans)
    loop_s = time.perf_counter() - opened
    return PlanBlend(out, kinds, spans, computed, opened - began, loop_s)


def open_spans(
    segment_kv: SegmentKV,
    plan: PrefillPlan,
    kinds: np.ndarray | None = None,
    *,
    device: torch.device | None = None,
    ranks: Ranks | None = None,
    lost: list[Lost] | None = None,
    cancel: CancelFlag | None = None,
    pause: Pause | None = None,
) -> tuple[list[CachedSpan], int]:
    """Open each planned span's entry (`_open_entry`); return the loop's spans and entries computed.

    ``device=None`` (the engine): entries are opened where the store keeps them (host memory,
    pinned when CUDA is available, or a device), and the blend loop copies each layer group's
    rows straight into its buffer on the device, on a side stream while earlier layers compute;
    a missing or unreadable entry is computed (and stored) now.

    ``device`` given (vLLM): entries are read whole onto it; the rows of one that is missing or
    cannot be used (on any of the ``ranks``) become ``COMPUTE`` in ``kinds`` and the entry is
    listed in ``lost`` with the reason. Before each entry the prefill may ``pause`` and stops
    once ``cancel`` is set.
    """
    kinds = np.array(plan.kinds, dtype=np.int8) if kinds is None else kinds
    lost = [] if lost is None else lost
    opened, computed = _open_entries(segment_kv, plan, device, lost, cancel, pause)
    usable = [entry is not None for _, entry in opened]
    if ranks is not None and opened:  # an entry any rank could not read is used by none
        gathered = ranks.gather_ranks(torch.tensor(usable, dtype=torch.float32))
        usable = [bool(agreed) for agreed in gathered.min(dim=0).values.tolist()]
    spans = []
    for span, (key, entry), agreed in zip(plan.spans, opened, usable, strict=True):
        if entry is not None and not agreed:
            lost.append(Lost("unusable on another tensor-parallel rank", key=key))
            entry = None
        if entry is None:
            kinds[span.start : span.end] = int(COMPUTE)
            continue
        spans.append(_cached_span(segment_kv, span, key, entry, ranks))
    return spans, computed


def _open_entries(
    segment_kv: SegmentKV,
    plan: PrefillPlan,
    device: torch.device | None,
    lost: list[Lost],
    cancel: CancelFlag | None,
    pause: Pause | None,
) -> tuple[list[tuple[str, Mapping[str, torch.Tensor] | None]], int]:
    """Open every planned span's entry: each key and entry (None: not usable), entries computed.

    Without ``device`` a missing or unreadable entry is computed (and stored) now; with it, it
    is listed in ``lost``.
    """
    opened: list[tuple[str, Mapping[str, torch.Tensor] | None]] = []
    computed = 0
    for span in plan.spans:
        stop_if_cancelled(cancel, pause)
        key, entry, error = _open_entry(segment_kv, span, device)
        if entry is None and device is None:
            if error is not None:
                logger.warning("KV entry %s unreadable, recomputing it: %s", key, error)
            entry = segment_kv.compute(key, span.context_ids, span.cached_ids)
            computed += 1
        elif entry is None:
            lost.append(Lost(f"unusable ({error})" if error else "not in the store", key=key))
        opened.append((key, entry))
    return opened, computed


def _open_entry(
    segment_kv: SegmentKV, span: PlannedSpan, device: torch.device | None
) -> tuple[str, Mapping[str, torch.Tensor] | None, Exception | None]:
    """Open one span's entry: its key, the entry (None: not usable) and why not (None: a miss).

    With ``device``, the entry is read whole (and checked) now; without, where the store keeps
    it. An entry that cannot be opened or read is dropped from the store.
    """
    key = segment_kv.entry_key(span.context_ids, span.cached_ids)
    try:
        entry = segment_kv.open_entry(key, len(span.cached_ids), device)
        if entry is not None and device is not None:
            entry = {name: entry[name] for name in entry}  # read (and checked) now
        return key, entry, None
    except Exception as error:  # noqa: BLE001 - damaged or foreign: computed instead
        segment_kv.drop(key)
        return key, None, error


def _cached_span(
    segment_kv: SegmentKV,
    span: PlannedSpan,
    key: str,
    entry: Mapping[str, torch.Tensor],
    ranks: Ranks | None,
) -> CachedSpan:
    """Return the loop's span over an opened (or read) entry (its tensors by name).

    With ``ranks``, the rows of this rank's KV heads; an entry failing its check mid-prompt is
    recomputed (and stored again) unless several ranks read it.
    """
    dtype, shape = segment_kv.entry_shape(len(span.cached_ids))
    tensors = entry
    heads = ranks.kv_heads if ranks is not None else None  # this rank's heads (read whole)
    recompute: Callable[[], Any] = functools.partial(
        segment_kv.recompute, key, span.context_ids, span.cached_ids
    )
    if ranks is not None and ranks.tp_size > 1:
        recompute = _refuse_recompute
    rows = slice(span.cached_start, span.cached_start + span.end - span.start)
    source = StoredRows(tensors, rows, recompute, (dtype, shape), segment_kv.codec, heads)
    return CachedSpan(span.start, span.end, source, span.kind)


def _refuse_recompute() -> Any:
    raise RuntimeError("a tensor-parallel rank cannot recompute a whole entry")
