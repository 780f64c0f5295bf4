"""The blend loop's K/V buffer of a prompt, and cached K/V placed in it a group of layers a copy.

`PromptKV` holds the K/V of every layer of the prompt in one preallocated tensor, keys rotated
to their prompt positions. `LayerLoads` places the cached spans' K/V in it a group of layers at
a time: one multi-tensor copy per group (every span's rows of those layers, one copy per
document straight from the stored tensor, which may be in host memory: the copy is then the
transfer to the device; a document stored by a quantized codec is decoded into its rows as it
is placed, `kvblend.blend.kv_codec`), then the group's keys rotated once, in place
(`rotate_`: stored keys are un-rotated), and one event per group; a layer waits on its own
group's event before it reads the buffer. On CUDA the copies and rotations run on a side
stream (`CopyStream`), so the loading of later groups overlaps the compute of earlier layers,
and waiting is a stream wait, never a host sync. `CopyStream` is the only
CUDA-specific piece: off CUDA it is a null stream whose copies run at once and whose events are
None, so the same grouping runs (and is tested) on the CPU, where copies are synchronous anyway
and one group holds every layer (`GROUP_LAYERS`): more groups would only add ops there.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from kvblend.blend.adapter import ModelAdapter
from kvblend.blend.kv_codec import EncodedKV, move
from kvblend.blend.rope import rotate_
from kvblend.blend.types import CachedSpan

#: Layers per copy group, by device type; a device type not listed copies every layer at once.
GROUP_LAYERS: dict[str, int] = {"cuda": 4}


def group_layers(device: torch.device, num_layers: int) -> int:
    """Return how many layers one copy of cached K/V places on ``device``."""
    return max(1, min(GROUP_LAYERS.get(device.type, num_layers), num_layers))


class PromptKV:
    """The K/V of every layer of one prompt, in one preallocated buffer (keys rotated).

    ``data`` is ``[layers, 2, kv_heads, length, head_dim]`` (keys, then values) for a prompt of
    ``total`` tokens; rows from ``total`` on (a compiled loop's size bucket) are zeros, and no
    query reads them. Cached rows are placed and rotated once per
    group of layers (every span at once), the computed rows' fresh K/V written with one more
    op per layer. ``layers``: each layer's view, made once (a compiled step's inputs).
    """

    def __init__(self, data: torch.Tensor, total: int, static: bool = False) -> None:
        self.data = data
        self.total = total
        self.static = static  # from `STATIC_BUFFERS`: handed back once copied out
        self.layers = [data[layer] for layer in range(data.shape[0])]

    @classmethod
    def empty(
        cls,
        adapter: ModelAdapter,
        total: int,
        length: int,
        zeroed: torch.Tensor | None = None,
        static: bool = False,
        zero_to: int | None = None,
    ) -> PromptKV:
        """Return a buffer of ``length`` rows for ``total`` tokens, its rows from ``total`` zero.

        ``zeroed``: rows (on the device) that are read before they are written (the
        correction gathers every computed row's K/V), set to zero too. ``static``: a buffer at
        a fixed address (`StaticBuffers`), for a compiled loop's CUDA graphs. ``zero_to``:
        only the rows from ``total`` to this one are zeroed (the rest is never read).
        """
        shape = adapter.shape
        size = (shape.num_layers, 2, shape.num_kv_heads, length, shape.head_dim)
        if static:
            kv = STATIC_BUFFERS.take(size, adapter.dtype, adapter.device, total)
        else:
            kv = cls(torch.empty(size, device=adapter.device, dtype=adapter.dtype), total)
        end = length if zero_to is None else min(zero_to, length)
        if end > total:
            kv.data[:, :, :, total:end].zero_()
        if zeroed is not None and zeroed.numel():
            kv.data.index_fill_(3, zeroed, 0)
        return kv

    def copied(self) -> PromptKV:
        """Return a buffer of its own with this one's K/V, handing a static one back."""
        if not self.static:
            return self
        copy = PromptKV(self.data.clone(), self.total)
        STATIC_BUFFERS.give(self)
        return copy

    def release(self) -> None:
        """Hand a static buffer back unread (a pass that stopped): the next prompt reuses it.

        The caller first orders the compute stream after every copy into it (`LayerLoads.fence`).
        """
        if self.static:
            STATIC_BUFFERS.give(self)

    def load(
        self,
        layers: range,
        spans: list[CachedSpan],
        table: torch.Tensor,
        non_blocking: bool = False,
    ) -> None:
        """Place every span's cached K/V of ``layers`` (one multi-tensor copy, one per span).

        A span stored by a quantized codec (`EncodedKV`) is decoded into its rows instead: the
        group's codes and scales of every such span copied as bytes in one multi-tensor copy
        when they are elsewhere (`move`), then written as values by a few ops per span
        (`EncodedKV.place`), never a full-precision copy of the entry first. Then rotate
        the keys of ``layers`` to their positions (``table``: the `rope_table` of
        every row of the buffer). A span's source is read, never written: it may be the store's
        own tensor, on the host or on the device.
        """
        first, stop = layers.start, layers.stop
        targets = [self.data[first:stop, :, :, span.start : span.end] for span in spans]
        sources = [span.source.layers() for span in spans]
        plain = [
            (t, s[first:stop])
            for t, s in zip(targets, sources, strict=True)
            if isinstance(s, torch.Tensor)
        ]
        if plain:
            copied, read = zip(*plain, strict=True)
            torch._foreach_copy_(list(copied), list(read), non_blocking=non_blocking)
        encoded = [
            (t, s.layers(first, stop))
            for t, s in zip(targets, sources, strict=True)
            if isinstance(s, EncodedKV)
        ]
        if encoded:  # codes decoded into the buffer as they land (copied as bytes if elsewhere)
            codes = [item for _, item in encoded]
            if any(item.device != self.data.device for item in codes):
                codes = move(codes, self.data.device, non_blocking=non_blocking)
            for (target, _), item in zip(encoded, codes, strict=True):
                item.place(target)
        if targets:
            rotate_(self.data[first:stop, 0], table)

    def prompt_rows(self) -> torch.Tensor:
        """Return the prompt's rows ``[layers, 2, kv_heads, total, head_dim]`` (a view)."""
        return self.data[:, :, :, : self.total]


class StaticBuffers:
    """K/V buffers at fixed addresses for the compiled loop: one per size bucket in use.

    CUDA graphs replay on the addresses they were recorded with, so the compiled loop writes
    every prompt of a bucket into the same buffer (its layers' views made once and marked
    static for dynamo); a prefill's K/V is copied out (`PromptKV.copied`) before the buffer is
    handed back. At most `kept` shapes are kept, the least recently used dropped first.
    """

    def __init__(self, kept: int = 2) -> None:
        self.kept = kept
        self._free: OrderedDict[tuple[Any, ...], PromptKV] = OrderedDict()
        self._lock = threading.Lock()

    def take(
        self, size: tuple[int, ...], dtype: torch.dtype, device: torch.device, total: int
    ) -> PromptKV:
        """Return a static buffer of ``size`` (a kept one when free, else a new one)."""
        key = (size, dtype, device)
        with self._lock:
            kv = self._free.pop(key, None)
        if kv is None:
            kv = PromptKV(torch.empty(size, dtype=dtype, device=device), total, static=True)
            for view in kv.layers:
                torch._dynamo.mark_static_address(view, guard=False)
        kv.total = total
        return kv

    def give(self, kv: PromptKV) -> None:
        """Keep ``kv`` for the next prompt of its size."""
        key = (tuple(kv.data.shape), kv.data.dtype, kv.data.device)
        with self._lock:
            self._free[key] = kv
            self._free.move_to_end(key)
            while len(self._free) > self.kept:
                self._free.popitem(last=False)


#: The process's static buffers (the compiled loop's).
STATIC_BUFFERS = StaticBuffers()


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


class CopyStream:
    """Where cached K/V is copied: a side CUDA stream with events, or inline (the null stream).

    ``copy`` runs a placement and returns the event that marks its end (None inline); ``wait``
    orders the compute stream after such an event. Off CUDA both are plain calls.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = _side_stream(device) if device.type == "cuda" else None
        self.started: Any = None  # events (timed) of the first copy's start, the last's end
        self.ended: Any = None

    def copy(self, place: Callable[..., None], *args: Any) -> Any:
        """Run ``place(*args, non_blocking=...)`` on the copy stream; return its end event.

        The copy stream first waits for the compute stream's work queued so far (the buffer's
        allocation and earlier writes). A lazy store entry opened by ``place`` orders the copy
        stream, its current stream, after the entry's own transfer.
        """
        if self.stream is None:
            place(*args, non_blocking=False)
            return None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            if self.started is None:
                self.started = torch.cuda.Event(enable_timing=True)
                self.started.record(self.stream)
            place(*args, non_blocking=True)
            self.ended = event = torch.cuda.Event(enable_timing=True)
            event.record(self.stream)
        return event

    def seconds(self) -> float | None:
        """Device seconds from the first copy's start to the last copy's end (None: no events).

        Waits for the last copy (read after the logits, for the statistics).
        """
        if self.started is None or self.ended is None:
            return None
        self.ended.synchronize()
        return float(self.started.elapsed_time(self.ended)) / 1000

    def guard(self, kv: PromptKV, spans: list[CachedSpan], table: torch.Tensor) -> None:
        """Mark the buffer, the RoPE table and the spans' tensors on the device as in use.

        Their memory is then not handed out again before the copies end, even if the pass stops
        midway (a cancelled prefill) and drops them while copies are still queued.
        """
        if self.stream is None:
            return
        tensors = [kv.data, table]
        for span in spans:
            source = span.source.layers()
            tensors += source.tensors() if isinstance(source, EncodedKV) else [source]
        for tensor in tensors:
            if tensor.device.type == "cuda":
                tensor.record_stream(self.stream)

    def wait(self, event: Any) -> None:
        """Order the compute stream after ``event`` (a no-op for the null stream's None)."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)


class LayerLoads:
    """The cached K/V of one pass, placed a group of layers at a time, one event per group."""

    def __init__(
        self,
        kv: PromptKV,
        spans: list[CachedSpan],
        group: int,
        stream: CopyStream,
        table: torch.Tensor,
    ) -> None:
        self.kv = kv
        self.spans = spans
        self.group = group
        self.stream = stream
        self.table = table  # the `rope_table` of every row of the buffer
        self.events: dict[int, Any] = {}  # layer -> the event of the copy that placed it

    @classmethod
    def for_pass(
        cls, adapter: ModelAdapter, kv: PromptKV, spans: list[CachedSpan], table: torch.Tensor
    ) -> LayerLoads:
        """Return the loads of a pass over ``adapter``'s layers (none issued yet)."""
        group = group_layers(adapter.device, adapter.shape.num_layers)
        return cls(kv, spans, group, CopyStream(adapter.device), table)

    def issued(self, layer: int) -> bool:
        """Whether the copy of ``layer``'s cached K/V was issued."""
        return layer in self.events

    def issue(self, layers: range) -> None:
        """Queue the copies of ``layers``' cached K/V, ``group`` layers per copy."""
        if not self.spans:
            return
        for first in range(layers.start, layers.stop, self.group):
            group = range(first, min(first + self.group, layers.stop))
            event = self.stream.copy(self.kv.load, group, self.spans, self.table)
            self.events.update(dict.fromkeys(group, event))
        self.stream.guard(self.kv, self.spans, self.table)

    def wait(self, layer: int) -> None:
        """Order the compute stream after the copy of ``layer``'s group (when one was issued)."""
        if layer in self.events:
            self.stream.wait(self.events[layer])

    def fence(self) -> None:
        """Order the compute stream after every copy issued (none waited for may still run).

        A pass that stops midway calls it before its buffer is handed back: whatever the
        compute stream does with the buffer next (another prompt's writes; the copy stream
        waits for the compute stream before its own copies) comes after these copies.
        """
        for event in dict.fromkeys(self.events.values()):
            self.stream.wait(event)
