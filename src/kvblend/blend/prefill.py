"""The blended prefill of one prompt: the selector's choice, the pass it asks for, the guard.

`run_blend` runs, in this order:

1. the prompt's RoPE tables, made once for every pass;
2. the selector's ``select`` over a `SelectionContext`: it may run first passes over the prompt
   (`FirstPass`, the default's probe) and returns the rows computed from layer 0 on, with the
   pass to start from;
3. the pass itself (`kvblend.blend.loop.run_pass`), its logits, and with a guard, the guard's
   signals, read back with the pass's rows;
4. the guard's verdict, and its escalation to full prefill from the blend's own buffer;
5. what every pass did, added up.

The selector is the prefill's own (`BlendConfig.selector`): the forecast before the model runs
and the blend ask the same one.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, replace

import numpy as np
import torch

from kvblend.blend.adapter import ModelAdapter
from kvblend.blend.guard import guard_report, guard_signals
from kvblend.blend.loop import CancelFlag, Pause, prompt_tables, run_pass, with_kv
from kvblend.blend.rope import RopeTables
from kvblend.blend.selectors import Selection, SelectionContext, Selector
from kvblend.blend.selectors.base import PassObserver
from kvblend.blend.types import (
    COMPUTE,
    PREFIX,
    BlendInput,
    BlendOutput,
    PassCounts,
    on_host,
    to_device,
)

__all__ = [
    "DeviceTimes",
    "FirstPass",
    "device_clock",
    "device_times",
    "escalate",
    "run_blend",
    "selection_context",
]


@dataclass(frozen=True)
class FirstPass:
    """A selector's first pass over the prompt: `SelectionContext.run_pass`.

    ``self(computed, observer, layers=None, logits=False)`` computes the rows ``computed``
    (host positions) over the first ``layers`` layers (every layer when None) and reads the
    rest from the cache; ``observer`` sees each layer. ``corrected``: whether the selector's
    prefill, which may continue from this pass's buffer, changes stale rows (a correction or a
    temperature: `Selector.corrects_stale`), reading every computed row's K/V.
    """

    adapter: ModelAdapter
    prompt: BlendInput  # its kinds on the host
    tables: RopeTables | None
    corrected: bool = False
    cancel: CancelFlag | None = None
    pause: Pause | None = None

    def __call__(
        self,
        computed: torch.Tensor,
        observer: PassObserver,
        layers: int | None = None,
        logits: bool = False,
    ) -> BlendOutput:
        """Run the pass; return its output (its buffer is where the prefill may start)."""
        assert self.prompt.host_kinds is not None
        uncached = np.flatnonzero(self.prompt.host_kinds == COMPUTE)
        # the uncached rows a first pass leaves out are read as zeros (masked by nothing, they
        # add nothing), and a correction reads every computed row's K/V: zeroed either way
        every_uncached = np.array_equal(computed.numpy(), uncached)
        return run_pass(
            self.adapter,
            self.prompt,
            Selection(computed),
            observer=observer,
            need_logits=logits,
            cancel=self.cancel,
            tables=self.tables,
            layers=layers,
            corrected=self.corrected or not every_uncached,
            pause=self.pause,
        )


def selection_context(
    adapter: ModelAdapter,
    blend_input: BlendInput,
    cancel: CancelFlag | None = None,
    tables: RopeTables | None = None,
    corrected: bool = False,
    pause: Pause | None = None,
) -> SelectionContext:
    """Return what a selector sees of a prompt (``blend_input`` on the adapter's device).

    Its kinds are on the host; its first passes (`FirstPass`) compute the rows a selector
    names and read the rest from the cache.
    """
    blend_input = on_host(blend_input)
    assert blend_input.host_kinds is not None
    first_pass = FirstPass(adapter, blend_input, tables, corrected, cancel, pause)
    kinds = torch.from_numpy(blend_input.host_kinds)
    return SelectionContext(adapter, kinds, blend_input.spans, first_pass)


@torch.inference_mode()
def run_blend(
    adapter: ModelAdapter,
    blend_input: BlendInput,
    selector: Selector,
    *,
    need_logits: bool = True,
    cancel: CancelFlag | None = None,
    pause: Pause | None = None,
) -> BlendOutput:
    """Run the blended prefill of one prompt and return logits and the fused KV cache.

    ``selector``: the prefill's own (`BlendConfig.selector`), which decides what is computed.
    ``pause``: called between layers, where the prefill may yield for a while; ``cancel``:
    checked there after it; once set, `BlendCancelledError` is raised.
    """
    blend_input = on_host(blend_input)
    device = adapter.device
    blend_input = replace(
        blend_input,
        token_ids=to_device(blend_input.token_ids, device),
        kinds=to_device(blend_input.kinds, device),
    )
    tables = prompt_tables(adapter, blend_input)  # step 1
    started = time.perf_counter()
    context = selection_context(
        adapter, blend_input, cancel, tables, selector.corrects_stale, pause
    )
    selection = selector.select(context)  # step 2
    select_s = time.perf_counter() - started
    guard = selector.guard_inputs if need_logits else None
    tolerance = selector.guard_tolerance
    after_logits = None
    if guard is not None:
        after_logits = functools.partial(_guard_signals, *guard)
    out = run_pass(  # step 3
        adapter,
        blend_input,
        selection,
        selector=selector,
        need_logits=need_logits,
        cancel=cancel,
        tables=tables,
        after_logits=after_logits,
        pause=pause,
    )
    passes = [selection.start] if selection.start is not None else []
    report = None
    if guard is not None and out.extra is not None and tolerance is not None:  # step 4
        report = guard_report(out.extra, tolerance, selector.guard_signal)
        if report.escalated:  # every row but the prompt head, from the blend's buffer
            passes.append(out)
            out = escalate(adapter, blend_input, out, cancel, tables, pause)
    out = with_kv(out, out.kv.copied())  # the compiled loop's static buffer: copied out
    # step 5: the first pass's (and an escalated blend's) work counts too
    probe = PassCounts(probe_s=select_s if selection.start is not None else 0.0)
    out.counts = sum((earlier.counts for earlier in passes), out.counts + probe)
    out.guard = report
    return out


def _guard_signals(
    probe_logits: torch.Tensor, stale_mass: torch.Tensor, logits: torch.Tensor
) -> torch.Tensor:
    return guard_signals(probe_logits, logits, stale_mass)


def escalate(
    adapter: ModelAdapter,
    blend_input: BlendInput,
    blend: BlendOutput,
    cancel: CancelFlag | None,
    tables: RopeTables,
    pause: Pause | None = None,
) -> BlendOutput:
    """Run the guard's escalation: every row but the prompt head, from ``blend``'s buffer.

    The rows are known on the host (no read); the prompt head's K/V, read in place, is what a
    full prefill computes, so the result is full prefill's.
    """
    assert blend_input.host_kinds is not None
    rows = np.flatnonzero(blend_input.host_kinds != PREFIX)
    return run_pass(
        adapter,
        blend_input,
        Selection(rows, start=blend),
        cancel=cancel,
        tables=tables,
        corrected=False,
        pause=pause,
    )


def device_clock(device: torch.device) -> torch.cuda.Event | None:
    """Return a timed event recorded now on ``device``'s compute stream (None off CUDA)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


@dataclass(frozen=True)
class DeviceTimes:
    """Device seconds of a blend on CUDA (`device_times`).

    ``blend_s``: the compute stream's, from the blend's start to its logits queued;
    ``load_s``: the copy stream's, from the first copy of cached K/V to the last (None: no
    copy was timed).
    """

    blend_s: float
    load_s: float | None = None


def device_times(start: torch.cuda.Event | None, out: BlendOutput) -> DeviceTimes | None:
    """Device seconds of a blend begun at ``start`` (`device_clock`): None off CUDA.

    Waits for the device to get to now (the logits queued): read once the logits are queued,
    for the statistics.
    """
    if start is None:
        return None
    end = torch.cuda.Event(enable_timing=True)
    end.record()
    end.synchronize()
    blend_s = float(start.elapsed_time(end)) / 1000
    load = out.loads.stream.seconds() if out.loads is not None else None
    return DeviceTimes(blend_s, load)
