"""What a prefill will do with a prompt, decided before the model runs: `forecast_blend`.

A pure function of the prefill plan and the strategy's selector, which says how many moved
tokens it recomputes, whether it computes every one of them instead of blending (and why)
(`kvblend.blend.selectors.base.Selector.forecast`); here that becomes the strategy that runs
and the documents found in the prompt that end up not reused. `BlendEngine.prefill` reports it
in its stats, `BlendEngine.explain` prints it and vLLM's scheduler counts the cached tokens from
it, so the three agree by construction, for a strategy registered from outside too.

What the forecast says in words is rendered from its records where a person reads it
(`describe_lost`, a `Fallback`'s `describe_fallback`), its fallback's rule kept beside the words
(`BlendForecast.cause`); `FallbackLog` logs the reasons a prefill was not blended as asked, each
cause once a minute (the engine's reports, the vLLM connector's own reasons).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvblend.blend.selectors import Fallback, Forecast, Selector
from kvblend.prompt.plan import PrefillPlan, SpanReport, TokenKind

__all__ = [
    "NO_DOCUMENTS",
    "NO_DOCUMENTS_CAUSE",
    "NO_DOCUMENTS_FALLBACK",
    "BlendForecast",
    "FallbackLog",
    "Lost",
    "describe_lost",
    "documents",
    "forecast_blend",
]

#: The cause of `NO_DOCUMENTS`.
NO_DOCUMENTS_CAUSE = "no_documents"
#: Why a prompt without a cached document is computed in full: nothing to blend.
NO_DOCUMENTS_FALLBACK = Fallback(
    NO_DOCUMENTS_CAUSE, "the prompt holds no known document, so it is computed in full"
)
#: `BlendStats.fallback` of a prompt without a cached document (`NO_DOCUMENTS_FALLBACK`).
NO_DOCUMENTS = str(NO_DOCUMENTS_FALLBACK)


@dataclass(frozen=True)
class Lost:
    """Something a blend found but does not read, and why: a document of the prompt, or an entry.

    ``document``: the document's number among the prompt's documents (from 1), None for a
    store entry named by ``key``; ``reason``: why, in words; ``recomputed``: the document's
    rows are recomputed whole (``reason`` names what decided it), rather than never cached.
    ``str()`` is the line a person reads (`describe_lost`).
    """

    reason: str
    document: int | None = None
    key: str | None = None
    recomputed: bool = False

    def __str__(self) -> str:
        return describe_lost(self)


def describe_lost(lost: Lost) -> str:
    """Return the line ``BlendStats.documents_lost``, ``explain`` and the logs show for ``lost``."""
    if lost.document is None:
        return f"entry {(lost.key or '')[:12]} {lost.reason}"
    reason = f"recomputed whole ({lost.reason})" if lost.recomputed else lost.reason
    return f"document {lost.document}: {reason}"


@dataclass(frozen=True)
class BlendForecast:
    """What a prefill of one plan with one strategy does, decided before the model runs."""

    strategy_run: str  # the selector's strategy, or "full" when every moved token is recomputed
    recomputed_tokens: int  # moved tokens recomputed at every layer
    fallback: str | None = None  # why the blend does not run as asked
    estimated_cost: float = 0.0  # the strategy's cost estimate, a share of full prefill's
    lost: list[Lost] = field(default_factory=list)  # documents found, not reused: why
    #: rows the prefill computes, summed over its passes, a pass through part of the layers
    #: counted by its share of them (`Selector.forecast`'s ``partial_rows``): what vLLM's
    #: connector forecasts a blend's time from
    computed_rows: float = 0.0
    #: the rule that made the blend fall back (``"full_above"``, ``"no_documents"``...: the
    #: `Fallback`'s rule, or the strategy's name when it gave its reason in words only)
    cause: str | None = None

    @property
    def documents_lost(self) -> list[str]:
        """One line per document found but not reused, saying why (`describe_lost`)."""
        return [str(lost) for lost in self.lost]


def _moved_rows(plan: PrefillPlan, row: SpanReport) -> int:
    if row.span is None:
        return 0
    span = plan.spans[row.span]
    return int(np.count_nonzero(plan.kinds[span.start : span.end] == TokenKind.MOVED))


def documents(plan: PrefillPlan) -> Iterator[tuple[int, SpanReport]]:
    """Return the plan's documents with their numbers in the prompt (from 1)."""
    return enumerate((row for row in plan.report if row.role == "document"), start=1)


def fallback_words(fallback: Fallback | str | None, strategy: str) -> tuple[str | None, str | None]:
    """Return a strategy's fallback in words, and its rule (both None: no fallback).

    A `Fallback` is rendered here, as the forecast enters the prefill; a reason given in words
    only (a strategy registered from outside) is kept as it is, with ``strategy`` as its rule.
    """
    if fallback is None:
        return None, None
    if isinstance(fallback, Fallback):
        return str(fallback), fallback.rule
    return fallback, strategy


def lost_documents(
    plan: PrefillPlan, forecast: Forecast, cause: str | None, every_moved: bool
) -> list[Lost]:
    """Return the plan's documents that a blend with ``forecast`` does not read, and why.

    ``cause``: the forecast's fallback rule (every moved document recomputed whole);
    ``every_moved``: the strategy recomputes every moved row anyway.
    """
    lost = []
    for number, row in documents(plan):
        moved_rows = _moved_rows(plan, row)
        if not row.reused:
            lost.append(Lost(row.reason, number))
        elif moved_rows and cause is not None:
            lost.append(Lost(cause, number, recomputed=True))
        elif moved_rows and every_moved:
            lost.append(Lost("every moved token is", number, recomputed=True))
        elif moved_rows and (
            moved_rows <= forecast.lead_rows or row.reused <= forecast.short_document
        ):
            lost.append(Lost(f"{row.reused} tokens, short", number, recomputed=True))
    return lost


def forecast_blend(plan: PrefillPlan, selector: Selector) -> BlendForecast:
    """Forecast the prefill of ``plan`` with ``selector`` (a pure function: no model runs).

    ``selector``: the prefill's own (`BlendConfig.selector`).
    """
    total = len(plan.kinds)
    if not selector.reads_cache:
        return BlendForecast(selector.name, 0, computed_rows=total)
    if not any(row.role == "document" for row in plan.report):  # a prompt head at most
        return BlendForecast(
            "full",
            0,
            str(NO_DOCUMENTS_FALLBACK),
            1.0,
            computed_rows=total,
            cause=NO_DOCUMENTS_FALLBACK.rule,
        )
    moved = int(np.count_nonzero(plan.kinds == TokenKind.MOVED))
    uncached = int(np.count_nonzero(plan.kinds == TokenKind.COMPUTE))
    forecast = selector.forecast(plan.kinds, plan.spans)
    recomputed = forecast.recomputed
    fallback, cause = fallback_words(forecast.fallback, selector.name)
    lost = lost_documents(plan, forecast, cause, recomputed == moved)
    strategy_run = "full" if fallback is not None else selector.name
    rows = uncached + (moved if fallback is not None else recomputed + forecast.partial_rows)
    return BlendForecast(strategy_run, recomputed, fallback, forecast.cost, lost, rows, cause)


class FallbackLog:
    """Warn once per cause and ``interval`` seconds (a busy server logs each cause once).

    `report` logs the reasons a prefill gives for not reusing the prompt's documents.
    """

    def __init__(self, logger: logging.Logger, interval: float = 60.0) -> None:
        self.logger = logger
        self.interval = interval
        self._last: dict[str, float] = {}

    def warn(self, cause: str, message: str, level: int = logging.WARNING) -> None:
        """Log ``message`` unless ``cause`` was logged less than ``interval`` seconds ago."""
        now = time.monotonic()
        if now - self._last.get(cause, -float("inf")) < self.interval:
            return
        self._last[cause] = now
        self.logger.log(level, "%s", message)

    def report(
        self,
        fallback: str | None,
        cause: str | None,
        lost: Sequence[Lost],
        near_miss: str | None = None,
        known: int | None = None,
    ) -> None:
        """Log each reason a prompt's documents were not reused, once per cause a minute.

        ``fallback`` and its ``cause``: why the prompt was computed in full (`BlendForecast`,
        or the guard); ``lost``: the documents found and not reused. A prompt without a known
        document (a greeting, a rephrasing step) is logged at INFO level, with the ``known``
        documents that could have been found in it; one that holds the start of a known
        document, not its whole text (``near_miss``), is a warning.
        """
        if cause == NO_DOCUMENTS_CAUSE:
            self.warn(
                "no_documents",
                f"no known document in the prompt ({known} known): computed in "
                "full (stats.fallback); a document is found only when its exact text occurs in "
                "the prompt; engine.explain(prompt) or `kvblend explain` shows what is reused",
                level=logging.INFO,
            )
        elif fallback is not None:
            self.warn(
                cause or fallback,
                f"blend ran as full prefill: {fallback} (stats.fallback; "
                "docs/configuration.md says when and how to change it)",
            )
        for item in lost:
            if not item.recomputed:  # a document recomputed whole: the fallback's line says it
                self.warn(f"lost: {item.reason}", f"found document not reused: {item}")
        if near_miss is not None:
            self.warn(
                "near_miss",
                f"no precomputed document reused there: {near_miss}; a "
                "document is found only when its exact text occurs in the prompt; "
                "engine.explain(prompt) or `kvblend explain` shows what is reused",
            )
