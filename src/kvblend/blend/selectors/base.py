"""The selector protocol: how a strategy picks the reused tokens a blended prefill recomputes.

A selector is one class that declares its settings (name, default, check) and answers two
questions: before the model runs, what it will recompute for a prompt of given token kinds
(`forecast`: what ``explain``, the stats' fallback and vLLM's cached-token count report), and
before the layer loop, which positions are computed from layer 0 on (`select`). It
may run a first pass over the prompt to decide (`SelectionContext.run_pass`, with a
`PassObserver` that sees every layer's queries and KV), and hand that pass's KV to the prefill
as a starting point. A selector that narrows the computed rows inside the loop, as CacheBlend
does at its check layers, lists those layers in ``refine_layers`` and implements `refine`.

Rows chosen by values on the device (a probe's scores, a check layer's deviations) stay there:
a fixed count known on the host is taken (``topk``), and the sorted rows are built with device
ops (`chosen_rows`), so nothing is read back before the logits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Protocol

import numpy as np
import torch

from kvblend.blend.adapter import DecoderShape, ModelAdapter
from kvblend.blend.types import COMPUTE, MOVED, BlendOutput, CachedSpan, RowSet, to_device


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


def flag(name: str, value: Any) -> bool:
    """Check a yes/no setting: a bool, or 0 / 1 (as ``--set NAME=1`` gives it)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ValueError(f"{name} must be True or False (or 1 / 0), got {value!r}")


def tolerance(name: str, value: Any) -> float | None:
    """Check a guard tolerance: a number >= 0 (``inf``: signals only), or None / "off"."""
    if value is None or (isinstance(value, str) and value.lower() in ("off", "none")):
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{name} must be a number >= 0 or None (off), got {value!r}")
    return float(value)


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


def temperature(name: str, value: Any) -> float:
    """Check an attention temperature: a number in [0.25, 4]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.25 <= value <= 4:
        raise ValueError(f"{name} must be a number in [0.25, 4], got {value!r}")
    return float(value)


STALE_TEMPERATURE = Setting(
    1.0,
    temperature,
    "attention temperature on the moved tokens that are not recomputed: their keys are divided "
    "by it (above 1 every later token attends to them less sharply; 1: off)",
)


class SpanRows(Protocol):
    """A planned or cached span: prompt rows ``[start, end)`` and their kind."""

    @property
    def start(self) -> int:
        """First prompt row."""
        ...

    @property
    def end(self) -> int:
        """Prompt row past the last."""
        ...

    @property
    def kind(self) -> int:
        """`MOVED` or `PREFIX`."""
        ...


@dataclass(frozen=True)
class Fallback:
    """Why a prefill recomputes every moved row instead of blending: the rule and why, in words.

    ``rule``: the rule that decided it, a short name (a setting's, such as ``"full_above"``, or
    ``"guard"``, ``"no_documents"``): what logs count once a minute and a program compares;
    ``detail``: what a person reads after it. ``str()`` is the public line, ``"rule: detail"``
    (`describe_fallback`), rendered where a person reads it; nothing reads the rule back from it.
    """

    rule: str
    detail: str

    def __str__(self) -> str:
        return describe_fallback(self)


def describe_fallback(fallback: Fallback) -> str:
    """Return the line ``BlendStats.fallback``, ``explain`` and the logs show for ``fallback``."""
    return f"{fallback.rule}: {fallback.detail}"


class Forecast(NamedTuple):
    """What a strategy will recompute for one prompt, decided from its token kinds alone.

    ``recomputed``: moved rows recomputed at every layer (every moved row when the blend falls
    back); ``cost``: the blend's estimated cost as a share of a full prefill's (0: the strategy
    makes no estimate); ``fallback``: why every moved row is recomputed instead of blending
    (a `Fallback`; a strategy that gives only words has its own name as the rule), None when
    the blend runs as asked; ``lead_rows``: leading rows of each moved document the
    strategy recomputes, and ``short_document``: the reused length at or below which a document
    counts as recomputed whole (both only to say which documents end up not reused);
    ``partial_rows``: rows computed through part of the layers only (a probe pass, the early
    layers of a funnel), each counted by the share of the layers it runs through, so that the
    rows a blend computes are the uncached ones, ``recomputed`` and these (what vLLM's
    connector forecasts a blend's time from).
    """

    recomputed: int
    cost: float = 0.0
    fallback: Fallback | str | None = None
    lead_rows: int = 0
    short_document: int = 0
    partial_rows: float = 0.0


def moved_count(kinds: np.ndarray) -> int:
    """How many of ``kinds`` are moved rows."""
    return int(np.count_nonzero(np.asarray(kinds) == MOVED))


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

    decoder: ModelAdapter
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

    ``computed``: sorted positions. On the host (a CPU tensor or array; a tensor on another
    device is read back once, a host sync), or a `RowSet` of rows chosen on the device.
    ``start``: a pass over the same prompt whose computed rows are a subset of ``computed``;
    the prefill updates its KV buffer in place instead of loading every cached row again.
    """

    computed: torch.Tensor | np.ndarray | RowSet  # sorted positions
    start: BlendOutput | None = None


class Narrowing(NamedTuple):
    """A refine step's result: which computed rows stay computed, and their positions.

    ``keep``: sorted indices into the computed rows (on the device, or a host array);
    ``rows``: the positions they stand for.
    """

    keep: torch.Tensor | np.ndarray
    rows: RowSet


def chosen_rows(
    base: np.ndarray, chosen: torch.Tensor, candidates: np.ndarray, device: torch.device
) -> RowSet:
    """Rows ``base`` (host) and ``chosen`` (device: distinct ``candidates``), sorted on the device.

    Nothing is read back: the host bounds each sorted row's position by the rows it would be
    if the chosen ones were the first or the last ``chosen.numel()`` candidates (sorted, as
    ``base``): the i-th smallest of a set only grows when members are replaced by larger ones.
    """
    count = chosen.numel()
    positions = torch.cat((to_device(base, device), chosen)).sort().values
    lower = np.sort(np.concatenate((base, candidates[:count])))
    upper = np.sort(np.concatenate((base, candidates[candidates.size - count :])))
    return RowSet(positions, lower=lower, upper=upper)


class Selector:
    """Base class of the strategies: settings handling and the defaults of the hooks."""

    name: ClassVar[str]
    settings: ClassVar[Mapping[str, Setting]] = {}
    reads_cache: ClassVar[bool] = True  # False: the prefill needs no cached KV at all
    refine_layers: frozenset[int] = frozenset()
    refine_reads_cache: ClassVar[bool] = True  # False: `refine` ignores ``cached``
    #: What the guard compares the blend with, set by `select` when the guard is on (device
    #: tensors: the probe's next-token logits and the share of its scores on stale rows).
    guard_inputs: tuple[torch.Tensor, torch.Tensor] | None = None

    def __init__(self, settings: Mapping[str, Any]) -> None:
        self.options = dict(settings)

    @property
    def guard_tolerance(self) -> float | None:
        """The guard's tolerance (None: no guard, or a strategy without one)."""
        value = self.options.get("guard")
        return None if value is None else float(value)

    @property
    def guard_signal(self) -> str:
        """The signal the guard compares with its tolerance (`kvblend.blend.guard`)."""
        return str(self.options.get("guard_signal", "shift"))

    @property
    def correction(self) -> float:
        """The stale-KV correction share (0 for strategies without that setting)."""
        return float(self.options.get("correction", 0.0))

    @property
    def stale_temperature(self) -> float:
        """The attention temperature on stale moved rows (1 for strategies without it)."""
        return float(self.options.get("stale_temperature", 1.0))

    @property
    def corrects_stale(self) -> bool:
        """Whether the blend changes the stale moved rows' K/V (a correction or a temperature)."""
        return self.correction > 0 or self.stale_temperature != 1.0

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

    def forecast(self, kinds: np.ndarray, spans: Iterable[SpanRows]) -> Forecast:
        """Return what `select` (and `refine`) will recompute for a prompt, without a model.

        ``kinds``: the prompt's token kinds (host); ``spans``: its cached spans. A pure
        function of its inputs: ``explain`` and vLLM's scheduler report it, and the prefill's
        stats must agree with it. Every strategy implements it (`register` checks).
        """
        raise NotImplementedError(f"strategy {self.name!r} does not implement forecast()")

    def select(self, context: SelectionContext) -> Selection:
        """Return the positions computed from layer 0 on (sorted)."""
        raise NotImplementedError

    def refine(
        self,
        decoder: ModelAdapter,
        layer: int,
        hidden: torch.Tensor,
        rows: RowSet,
        kinds: torch.Tensor,
        cached: tuple[torch.Tensor, torch.Tensor],
    ) -> Narrowing:
        """Return the computed rows still computed from a refine layer on.

        ``hidden`` are the computed rows' hidden states entering ``layer``; ``kinds`` the
        prompt's kinds on the device; ``cached`` the computed rows' cached keys (before RoPE)
        and values ``[kv_heads, rows, head_dim]`` at ``layer``.
        """
        raise NotImplementedError
