"""The selector protocol: how a strategy picks the reused tokens a blended prefill recomputes.

A selector is one class that declares its settings (name, default, check) and answers one
question before the layer loop: which positions are computed from layer 0 on (`select`). It
may run a first pass over the prompt to decide (`SelectionContext.run_pass`, with a
`PassObserver` that sees every layer's queries and KV), and hand that pass's KV to the prefill
as a starting point. A selector that narrows the computed rows inside the loop, as CacheBlend
does at its check layers, lists those layers in ``refine_layers`` and implements `refine`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Protocol

import numpy as np
import torch

from ..blend_io import COMPUTE, MOVED, BlendOutput, CachedSpan, to_device
from ..decoder import Decoder, DecoderShape


@dataclass(frozen=True)
class Setting:
    """One setting of a strategy: its default, its check and what it does.

    ``check(name, value)`` returns the value to use or raises ``ValueError`` naming it.
    """

    default: Any
    check: Callable[[str, Any], Any]
    doc: str


def ratio(name: str, value: Any) -> float:
    """Check that ``value`` is a number in [0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    return float(value) if isinstance(value, int) else value


def non_negative_int(name: str, value: Any) -> int:
    """Check that ``value`` is an int >= 0."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return value


RECOMPUTE_RATIO = Setting(0.2, ratio, "share of the moved tokens recomputed, in [0, 1]")
CORRECTION = Setting(
    0.5,
    ratio,
    "share of the mean K/V change of a document's recomputed tokens added to its other tokens",
)


class PassObserver(Protocol):
    """Sees each layer of a pass once its KV is final (used by probe passes)."""

    def observe(
        self, layer: int, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Look at one layer once its KV is final.

        ``queries``: the computed rows' rotated queries ``[heads, rows, head_dim]``;
        ``keys``/``values``: the layer's whole rotated KV ``[kv_heads, total, head_dim]``.
        """
        ...


class SelectionContext(NamedTuple):
    """What a selector may look at: the prompt and a way to run a first pass over it.

    ``kinds`` is on the host (a CPU tensor), so deciding on it costs no device sync; so are
    ``moved`` and ``uncached``. Only a first pass runs on the decoder's device.
    """

    decoder: Decoder
    kinds: torch.Tensor  # [tokens] on the host
    spans: list[CachedSpan]
    #: ``run_pass(computed rows, observer, layers=None)``: a pass over the first ``layers``
    #: layers (every layer when None)
    run_pass: Callable[..., BlendOutput]

    @property
    def moved(self) -> torch.Tensor:
        """Positions of the moved rows (host)."""
        return torch.from_numpy(np.flatnonzero(self.kinds.numpy() == MOVED))

    @property
    def uncached(self) -> torch.Tensor:
        """Boolean mask of the rows computed whatever the strategy (host)."""
        return torch.from_numpy(self.kinds.numpy() == COMPUTE)


@dataclass
class Selection:
    """The positions computed from layer 0 on, and optionally a pass to start from.

    ``computed``: sorted positions, on the host (a CPU tensor or array; a tensor on another
    device is read back once, a host sync). ``start``: a pass over the same prompt whose
    computed rows are a subset of ``computed``; the prefill updates its KV buffer in place
    instead of loading every cached row again.
    """

    computed: torch.Tensor | np.ndarray  # sorted positions
    start: BlendOutput | None = None


def top_scoring(
    score: torch.Tensor, candidates: torch.Tensor | np.ndarray, keep: int
) -> torch.Tensor:
    """Return the ``keep`` entries of ``candidates`` (indices into ``score``) scoring most.

    A fixed-size selection (``topk``) on ``score``'s device: no host sync.
    """
    if isinstance(candidates, np.ndarray):
        candidates = to_device(candidates, score.device)
    if keep >= candidates.numel():
        return candidates
    if keep <= 0:
        return candidates[:0]
    top = torch.topk(score[candidates], keep, sorted=False).indices
    return candidates[top].sort().values


class Selector:
    """Base class of the strategies: settings handling and the defaults of the hooks."""

    name: ClassVar[str]
    settings: ClassVar[Mapping[str, Setting]] = {}
    reads_cache: ClassVar[bool] = True  # False: the prefill needs no cached KV at all
    refine_layers: frozenset[int] = frozenset()
    refine_reads_cache: ClassVar[bool] = True  # False: `refine` ignores ``cached``

    def __init__(self, settings: Mapping[str, Any]) -> None:
        self.options = dict(settings)

    @property
    def correction(self) -> float:
        """The stale-KV correction share (0 for strategies without that setting)."""
        return float(self.options.get("correction", 0.0))

    @classmethod
    def resolve(cls, given: Mapping[str, Any]) -> dict[str, Any]:
        """Every setting's value: ``given`` checked, defaults filled in; unknown ones rejected."""
        unknown = [name for name in given if name not in cls.settings]
        if unknown:
            uses = ", ".join(cls.settings) or "no settings"
            raise ValueError(
                f"strategy {cls.name!r} does not use {', '.join(map(repr, unknown))} "
                f"(it uses {uses})"
            )
        values = {
            name: setting.check(name, given[name]) if name in given else setting.default
            for name, setting in cls.settings.items()
        }
        cls.check_together(values, given)
        return values

    @classmethod
    def check_together(cls, values: dict[str, Any], given: Mapping[str, Any]) -> None:
        """Check settings against each other (override); may normalize ``values``."""

    def check_model(self, shape: DecoderShape) -> None:
        """Raise ``ValueError`` if the settings do not fit the model (override)."""

    def select(self, context: SelectionContext) -> Selection:
        """Return the positions computed from layer 0 on (sorted)."""
        raise NotImplementedError

    def refine(
        self,
        decoder: Decoder,
        layer: int,
        hidden: torch.Tensor,
        computed: torch.Tensor,
        kinds: torch.Tensor,
        cached: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor | np.ndarray:
        """Return the indices into ``computed`` still computed from a refine layer on.

        On the device (read back once: a host sync) or, when known before the loop, on the
        host (no sync).

        ``hidden`` are the computed rows' hidden states entering ``layer``; ``cached`` the
        layer's un-rotated cached keys and values ``[kv_heads, total, head_dim]``.
        """
        raise NotImplementedError
