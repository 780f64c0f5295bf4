"""What goes into and comes out of a blended prefill, shared by the loop and the selectors.

Every prompt token is one of three kinds (`TokenKind`):

- ``PREFIX``: reused from a cache computed at the same positions and context (exact, never
  recomputed unless the strategy is ``full``);
- ``MOVED``: reused from a segment cache computed elsewhere; a selector picks which of these are
  recomputed;
- ``COMPUTE``: not cached (question, template text, separators, new documents): computed in full
  at every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from .prompt import TokenKind

PREFIX, MOVED, COMPUTE = TokenKind.PREFIX, TokenKind.MOVED, TokenKind.COMPUTE


class LayerKV(Protocol):
    """A cached segment's KV, readable one layer at a time (read only: never written)."""

    def layer(self, index: int) -> torch.Tensor:
        """Un-rotated keys and values ``[2, kv_heads, tokens, head_dim]`` of layer ``index``."""
        ...

    def layers(self) -> torch.Tensor:
        """Un-rotated keys and values of every layer ``[layers, 2, kv_heads, tokens, head_dim]``."""
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
    #: ``kinds`` on the host (read from ``kinds`` when None: a sync if that is on a device)
    host_kinds: np.ndarray | None = None


@dataclass
class BlendOutput:
    """What a pass returns: logits, the fused KV cache and what it did."""

    logits: torch.Tensor | None  # [vocab] float32
    keys: list[torch.Tensor]  # per layer, rotated [kv_heads, tokens, head_dim]
    values: list[torch.Tensor]
    raw_keys: list[torch.Tensor] | None  # per layer, un-rotated (when asked for)
    stats: dict[str, float] = field(default_factory=dict)
    #: the pass's un-rotated KV of every layer ``[layers, 2, kv_heads, tokens, head_dim]``
    raw_kv: torch.Tensor | None = field(default=None, repr=False)
    #: the pass's copies of cached K/V into ``raw_kv`` (`LayerLoads`), some maybe under way
    #: on a side stream: a pass that starts from this one waits on them, layer by layer
    loads: Any = field(default=None, repr=False)


def read_back(tensor: torch.Tensor) -> np.ndarray:
    """Copy a device tensor of indices to the host: the blend's only way to read device values.

    Each call is a host sync on CUDA; the loop calls it at most once per pass (the rows a
    selector chose on the device), never inside a layer, except at a check layer.
    """
    return np.asarray(tensor.tolist(), dtype=np.int64)


def to_device(host: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a host array (or CPU tensor) to ``device`` without waiting for the device.

    On CUDA through pinned memory, asynchronously (a copy from pageable memory would
    synchronise the stream); on the CPU the same memory, no copy.
    """
    tensor = torch.from_numpy(host) if isinstance(host, np.ndarray) else host
    if device.type == "cpu":
        return tensor
    if tensor.device.type == "cpu" and torch.cuda.is_available():
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def host_rows(rows: torch.Tensor | np.ndarray) -> np.ndarray:
    """Sorted positions on the host: a host (CPU) tensor or array as is, a device one read back."""
    if isinstance(rows, np.ndarray):
        return rows.astype(np.int64, copy=False)
    if rows.device.type == "cpu":
        return rows.numpy().astype(np.int64, copy=False)
    return read_back(rows)


def moved_span_index(kinds: np.ndarray, spans: list[CachedSpan]) -> np.ndarray:
    """``[tokens]``: the index of the moved span each moved row belongs to, -1 elsewhere."""
    index = np.full(kinds.shape, -1, dtype=np.int64)
    for number, span in enumerate(s for s in spans if s.kind == MOVED):
        index[span.start : span.end] = number
    index[kinds != MOVED] = -1
    return index


def moved_spans_read(spans: list[CachedSpan], computed: np.ndarray, total: int) -> int:
    """How many moved spans kept some cached rows (were not recomputed whole)."""
    done = np.zeros(total, dtype=bool)
    done[computed] = True
    return sum(1 for s in spans if s.kind == MOVED and not done[s.start : s.end].all())


def on_host(blend_input: BlendInput) -> BlendInput:
    """``blend_input`` with its kinds on the host too (read back once if only on a device)."""
    if blend_input.host_kinds is not None:
        return blend_input
    kinds = blend_input.kinds
    host = kinds.numpy() if kinds.device.type == "cpu" else read_back(kinds).astype(np.int8)
    return BlendInput(blend_input.token_ids, kinds, blend_input.spans, host)
