"""Host-to-GPU copies of stored KV that overlap the prefill's compute.

Stores read an entry's tensors on prefetch threads while the blend loop computes earlier
layers. A plain ``tensor.to("cuda")`` there is issued on the device's default stream, which
every kernel of the prefill also uses, so the copy of layer ``i + 1`` waits behind the compute
of layer ``i`` and the compute of layer ``i + 1`` behind the copy: they serialize. `HostToDevice`
issues the copy on a side CUDA stream instead, from pinned (page-locked) host memory with
``non_blocking=True`` (pageable memory would make the copy synchronous), records a CUDA event
after it, and hands out a `PendingCopy`. `LazyTensors` turns that into the tensor when the
caller asks for it: the caller's current stream waits on that tensor's event only (a layer
waits for its own tensors, not for later layers still in flight), and the tensor is marked as
used on that stream (``record_stream``) so the caching allocator does not give its memory to
the side stream again while the prefill still reads it.

Any other copy (to the CPU, device to device, no CUDA) is the plain ``tensor.to(...)`` it was.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["HOST_TO_DEVICE", "HostToDevice", "PendingCopy"]


class PendingCopy:
    """A tensor whose copy was issued on a side stream, with the event recorded after it."""

    __slots__ = ("event", "tensor")

    def __init__(self, tensor: torch.Tensor, event: torch.cuda.Event) -> None:
        self.tensor = tensor
        self.event = event

    def ready(self) -> torch.Tensor:
        """Order the current stream after the copy and return the tensor."""
        stream = torch.cuda.current_stream(self.tensor.device)
        stream.wait_event(self.event)
        self.tensor.record_stream(stream)
        return self.tensor


class HostToDevice:
    """Copies a tensor to a device: host-to-CUDA on a side stream, everything else as `.to`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        with self._lock:
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device)
            return stream

    def copy(
        self, tensor: torch.Tensor, target: torch.device | None, *, copy: bool = True
    ) -> torch.Tensor | PendingCopy:
        """``tensor`` on ``target`` (None: where it is); ``copy``: never the same storage.

        A copy from the host to a CUDA device returns a `PendingCopy`; ``ready()`` gives the
        tensor to the stream that reads it.
        """
        if target is None or target.type != "cuda" or tensor.device.type != "cpu":
            return tensor.to(target if target is not None else tensor.device, copy=copy)
        if target.index is None:
            target = torch.device("cuda", torch.cuda.current_device())
        source = tensor if tensor.is_pinned() else tensor.pin_memory()
        stream = self._stream(target)
        with torch.cuda.stream(stream):
            # The pinned source stays valid until the copy is done: the CUDA host allocator
            # records the copy on this stream before reusing the block.
            moved = source.to(target, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return PendingCopy(moved, event)


#: The process's copier: one side stream per CUDA device, shared by every store.
HOST_TO_DEVICE = HostToDevice()
