"""What goes into and comes out of a blended prefill, shared by the loop and the selectors.

A pass's output (`BlendOutput`) carries what it did as records: `PassCounts` (its work, which
adds up over a prefill's passes) and `RowsRead` (what its computed rows were of the moved ones).

Every prompt token is one of three kinds (`TokenKind`):

- ``PREFIX``: reused from a cache computed at the same positions and context (exact, never
  recomputed unless the strategy is ``full``);
- ``MOVED``: reused from a segment cache computed elsewhere; a selector picks which of these are
  recomputed;
- ``COMPUTE``: not cached (question, template text, separators, new documents): computed in full
  at every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from kvblend.blend.rope import rotate_
from kvblend.prompt.plan import TokenKind

if TYPE_CHECKING:
    from kvblend.blend.guard import GuardReport

PREFIX, MOVED, COMPUTE = TokenKind.PREFIX, TokenKind.MOVED, TokenKind.COMPUTE


class LayerKV(Protocol):
    """A cached segment's KV, readable one layer at a time (read only: never written)."""

    def layer(self, index: int) -> torch.Tensor:
        """Un-rotated keys and values ``[2, kv_heads, tokens, head_dim]`` of layer ``index``."""
        ...

    def layers(self) -> Any:
        """Un-rotated keys and values of every layer ``[layers, 2, kv_heads, tokens, head_dim]``.

        A tensor, or the codes of a quantized entry (`kvblend.blend.kv_codec.EncodedKV`),
        decoded as they are placed.
        """
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
    #: How many sequences of equal length ``token_ids`` holds, one after another (right-padded
    #: documents computed together): each starts at position 0 and attends to its own rows
    #: only. More than one: every row computed, no cached span, no logits (a full pass).
    sequences: int = 1


@dataclass(frozen=True)
class PassCounts:
    """The work of a pass, counted on the host once its logits are queued; passes add up.

    ``token_layers``: computed rows times the layers each ran through; ``load_s``: host time
    issuing the copies of cached K/V; ``uncompiled_calls``: calls that ran uncompiled because
    dynamo refused another compile; ``probe_s``: the selector's time choosing the rows, its
    first passes included (0 when it ran none).
    """

    token_layers: int = 0
    load_s: float = 0.0
    uncompiled_calls: int = 0
    probe_s: float = 0.0

    def __add__(self, other: PassCounts) -> PassCounts:
        return PassCounts(
            *(getattr(self, f.name) + getattr(other, f.name) for f in fields(PassCounts))
        )


@dataclass(frozen=True)
class RowsRead:
    """What a pass's computed rows were of the prompt's moved rows (the last pass's counts).

    ``recomputed_tokens``: moved rows computed; ``moved_tokens``: moved rows in all;
    ``moved_spans_read``: moved spans that kept some cached rows (not recomputed whole).
    """

    recomputed_tokens: int = 0
    moved_tokens: int = 0
    moved_spans_read: int = 0


@dataclass
class BlendOutput:
    """What a pass returns: logits, the fused KV cache and what it did."""

    logits: torch.Tensor | None  # [vocab] float32
    keys: list[torch.Tensor]  # per layer, rotated [kv_heads, tokens, head_dim]
    values: list[torch.Tensor]
    #: the work of the pass (of every pass of a prefill, from `run_blend`)
    counts: PassCounts = field(default_factory=PassCounts)
    #: what its computed rows were of the moved rows
    read: RowsRead = field(default_factory=RowsRead)
    #: the pass's K/V buffer (`PromptKV`, keys rotated): a pass that starts from this one
    #: updates it in place
    kv: Any = field(default=None, repr=False)
    #: the pass's copies of cached K/V into ``kv`` (`LayerLoads`), some maybe under way on a
    #: side stream: a pass that starts from this one waits on them, layer by layer
    loads: Any = field(default=None, repr=False)
    #: the RoPE tables of the buffer's rows (``inverse``: what undoes the keys' RoPE)
    tables: Any = field(default=None, repr=False)
    #: values made from the logits and read back with the pass's rows (the guard's signals)
    extra: list[float] | None = None
    #: the guard's report, when a guard ran
    guard: GuardReport | None = None

    @property
    def raw_kv(self) -> torch.Tensor | None:
        """Every layer's K/V ``[layers, 2, kv_heads, tokens, head_dim]`` as the store keeps it.

        Keys before RoPE; a tensor of its own (made on each access), never the pass's buffer.
        """
        if self.kv is None or self.tables is None:
            return None
        return self.raw_rows(0, self.kv.total)

    def raw_rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of every layer's K/V as the store keeps it (see `raw_kv`)."""
        if self.kv is None or self.tables is None:
            raise ValueError("this pass kept no K/V buffer")
        kv = self.kv.prompt_rows()[:, :, :, start:stop].clone()
        rotate_(kv[:, 0], self.tables.inverse[start:stop])
        return kv


def read_back(tensor: torch.Tensor) -> np.ndarray:
    """Copy a device tensor of indices to the host: the blend's only way to read device values.

    Each call is a host sync on CUDA. Before the logits the loop calls it only where a pass's
    rows were chosen on the device and the attention it runs needs their positions on the host
    (`RowSet.host_positions`: the eager query chunks of a row set with no host bounds, i.e.
    CacheBlend's check layer); after the logits once more, for the statistics.
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


@dataclass(frozen=True)
class RowSet:
    """A pass's computed rows: sorted prompt positions on the device, and what the host knows.

    The count is always known on the host (the tensor's size). ``host``: the positions on the
    host, when the host chose them. Rows chosen on the device (a probe's top rows) are not read
    back; the host may instead know bounds of each sorted row's position (``lower[i] <=
    positions[i] <= upper[i]``), enough to size attention calls without reading the rows.
    """

    positions: torch.Tensor  # [count] long, sorted, on the decoder's device
    host: np.ndarray | None = None
    lower: np.ndarray | None = None
    upper: np.ndarray | None = None

    @classmethod
    def from_host(cls, host: np.ndarray, device: torch.device) -> RowSet:
        """Rows chosen on the host (sorted positions), copied to ``device`` without waiting."""
        host = host.astype(np.int64, copy=False)
        return cls(to_device(host, device), host)

    @property
    def count(self) -> int:
        """How many rows (known on the host: no sync)."""
        return int(self.positions.shape[0])

    def bounds(self) -> tuple[np.ndarray, np.ndarray] | None:
        """Host bounds ``(lower, upper)`` of each sorted row's position (exact when known)."""
        if self.host is not None:
            return self.host, self.host
        if self.lower is not None and self.upper is not None:
            return self.lower, self.upper
        return None

    def host_positions(self) -> np.ndarray:
        """Return the positions on the host: as known, else read back (a host sync on CUDA)."""
        return self.host if self.host is not None else read_back(self.positions)


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


def rows_read(kinds: np.ndarray, spans: list[CachedSpan], computed: np.ndarray) -> RowsRead:
    """Return what a pass computing ``computed`` (host positions) read of the moved rows."""
    moved = kinds == MOVED
    return RowsRead(
        recomputed_tokens=int(moved[computed].sum()),
        moved_tokens=int(moved.sum()),
        moved_spans_read=moved_spans_read(spans, computed, kinds.size),
    )


def on_host(blend_input: BlendInput) -> BlendInput:
    """``blend_input`` with its kinds on the host too (read back once if only on a device)."""
    if blend_input.host_kinds is not None:
        return blend_input
    kinds = blend_input.kinds
    host = kinds.numpy() if kinds.device.type == "cpu" else read_back(kinds).astype(np.int8)
    return replace(blend_input, host_kinds=host)


def as_rows(computed: torch.Tensor | np.ndarray | RowSet, device: torch.device) -> RowSet:
    """Return a selection's computed rows as a `RowSet` (a device tensor is read back)."""
    if isinstance(computed, RowSet):
        return computed
    if isinstance(computed, torch.Tensor):
        host = computed.numpy() if computed.device.type == "cpu" else read_back(computed)
        return RowSet.from_host(host, device)
    return RowSet.from_host(computed, device)
