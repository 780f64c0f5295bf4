"""What a prefill will do with a prompt, decided before the model runs: `forecast_blend`.

A pure function of the prefill plan and the strategy's selector, which says how many moved
tokens it recomputes, whether it computes every one of them instead of blending (and why)
(`kvblend.blend.selectors.base.Selector.forecast`); here that becomes the strategy that runs
and the documents found in the prompt that end up not reused. `BlendEngine.prefill` reports it
in its stats, `BlendEngine.explain` prints it and vLLM's scheduler counts the cached tokens from
it, so the three agree by construction, for a strategy registered from outside too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvblend.blend.selectors import Selector
from kvblend.prompt.plan import PrefillPlan, SpanReport, TokenKind

__all__ = ["NO_DOCUMENTS", "BlendForecast", "forecast_blend"]

#: `BlendStats.fallback` of a prompt without a cached document: nothing to blend.
NO_DOCUMENTS = "no_documents: the prompt holds no known document, so it is computed in full"


@dataclass(frozen=True)
class BlendForecast:
    """What a prefill of one plan with one strategy does, decided before the model runs."""

    strategy_run: str  # the selector's strategy, or "full" when every moved token is recomputed
    recomputed_tokens: int  # moved tokens recomputed at every layer
    fallback: str | None = None  # why the blend does not run as asked
    estimated_cost: float = 0.0  # the strategy's cost estimate, a share of full prefill's
    documents_lost: list[str] = field(default_factory=list)  # found, not reused: why
    #: rows the prefill computes, summed over its passes, a pass through part of the layers
    #: counted by its share of them (`Selector.forecast`'s ``partial_rows``): what vLLM's
    #: connector forecasts a blend's time from
    computed_rows: float = 0.0


def _moved_rows(plan: PrefillPlan, row: SpanReport) -> int:
    if row.span is None:
        return 0
    span = plan.spans[row.span]
    return int(np.count_nonzero(plan.kinds[span.start : span.end] == TokenKind.MOVED))


def forecast_blend(plan: PrefillPlan, selector: Selector) -> BlendForecast:
    """Forecast the prefill of ``plan`` with ``selector`` (a pure function: no model runs).

    ``selector``: the prefill's own (`BlendConfig.selector`).
    """
    total = len(plan.kinds)
    if not selector.reads_cache:
        return BlendForecast(selector.name, 0, computed_rows=total)
    if not any(row.role == "document" for row in plan.report):  # a prompt head at most
        return BlendForecast("full", 0, NO_DOCUMENTS, 1.0, computed_rows=total)
    moved = int(np.count_nonzero(plan.kinds == TokenKind.MOVED))
    uncached = int(np.count_nonzero(plan.kinds == TokenKind.COMPUTE))
    forecast = selector.forecast(plan.kinds, plan.spans)
    recomputed, fallback = forecast.recomputed, forecast.fallback
    lost = []
    for number, row in enumerate((row for row in plan.report if row.role == "document"), start=1):
        moved_rows = _moved_rows(plan, row)
        if not row.reused:
            lost.append(f"document {number}: {row.reason}")
        elif moved_rows and fallback is not None:
            lost.append(f"document {number}: recomputed whole ({fallback.split(':')[0]})")
        elif moved_rows and recomputed == moved:
            lost.append(f"document {number}: recomputed whole (every moved token is)")
        elif moved_rows and (
            moved_rows <= forecast.lead_rows or row.reused <= forecast.short_document
        ):
            lost.append(f"document {number}: recomputed whole ({row.reused} tokens, short)")
    strategy_run = "full" if fallback is not None else selector.name
    rows = uncached + (moved if fallback is not None else recomputed + forecast.partial_rows)
    return BlendForecast(strategy_run, recomputed, fallback, forecast.cost, lost, rows)
