"""What the connector says of each request: its record, its log lines, and the metrics' counts.

A request's record is what its output carries (``kv_transfer_params["kvblend"]``): made from
its plan when vLLM allocates it (`planned_record`), completed by its blend's outcome
(`complete_record`: the rows really reused, the blend's time, entries lost, errors). The log
says one line per request the connector chose for, and each other reason vLLM prefilled a
prompt itself once a minute (`RequestLog`). `Counts` sums the records of finished requests for
vLLM's metrics (`metrics`): requests blended and left to vLLM by reason, and their tokens, which
add up: every prompt token is in vLLM's prefix cache, reused from the store, or computed
(recomputed ones included).
"""

from __future__ import annotations

import logging
from typing import Any

from kvblend.blend.forecast import FallbackLog
from kvblend.vllm.fallbacks import VLLM_FASTER
from kvblend.vllm.request_plan import RequestPlan
from kvblend.vllm.requests import BlendOutcome

logger = logging.getLogger("kvblend.vllm")

__all__ = [
    "COMMON_REASONS",
    "COUNTS",
    "Counts",
    "RequestLog",
    "complete_record",
    "empty_counts",
    "planned_record",
]

#: The metrics' counts over finished requests (`Counts`), besides ``vllm_reasons`` (requests
#: left to vLLM, by reason) and ``blend_seconds`` (each blend's own time).
COUNTS = (
    "requests",
    "blended",
    "vllm",
    "prompt_tokens",
    "prefix_cached_tokens",
    "reused_tokens",
    "recomputed_tokens",
    "computed_tokens",
    "escalated_tokens",
    "forecast_blend_ms",
    "forecast_vllm_ms",
)

#: Reasons a server meets every day: the metrics count them from 0 (any other from its first).
COMMON_REASONS = (
    "vllm_faster",
    "not_stored",
    "no_stored_document",
    "empty_store",
    "other_model",
    "store_unreachable",
    "kvblend_off",
    "refused",
    "preempted",
)


def planned_record(plan: RequestPlan) -> dict[str, Any]:
    """Return the record of a request as planned (`RequestPlan.summary`, its forecasts).

    A request left to vLLM carries its fallback's code as ``reason`` beside its words.
    """
    record = plan.summary()
    if plan.forecast is not None:
        record.update(plan.forecast.as_record())
    if plan.why is not None:
        record["reason"] = plan.why.code
    if plan.refused:
        record["refused"] = True
    return record


def complete_record(record: dict[str, Any], outcome: BlendOutcome) -> list[tuple[str, str]]:
    """Put a blend's outcome into its record; return the warnings it calls for (cause, line).

    A blend that reused fewer rows than planned (entries lost, a fallback to ``full``) counts
    what it really reused.
    """
    record["blend_s"] = round(outcome.compute_s, 4)
    record["load_wall_s"] = round(outcome.blend_s, 4)
    record.update({name: round(value, 4) for name, value in outcome.timings.items()})
    if outcome.escalated:
        record["escalated_tokens"] = outcome.escalated
    if outcome.cancelled:
        record["cancelled"] = True
        return []
    warnings = []
    if outcome.lost or outcome.error is not None:
        record["cached_tokens"] = record["vllm_prefix_tokens"] + outcome.reused
        record["recomputed_tokens"] = outcome.recomputed
    if outcome.lost:
        record["lost"] = outcome.lost
        warnings.append(
            ("lost", f"kvblend: stored KV not used, computed instead: {outcome.lost[0]}")
        )
    if outcome.error is not None:
        record["error"] = outcome.error
        warnings.append(("error", f"kvblend: blend failed, computed in full: {outcome.error}"))
    return warnings


class RequestLog:
    """The connector's log lines of requests (each other reason once a minute)."""

    def __init__(self, per_request: bool) -> None:
        self.per_request = per_request
        self.fallbacks = FallbackLog(logger)

    def planned(self, request_id: str, plan: RequestPlan, record: dict[str, Any]) -> None:
        """Say why vLLM prefills an allocated request itself, when it does."""
        if plan.why is None or plan.refused:
            return  # a refused option was said as it was refused
        if plan.why.code != VLLM_FASTER:
            line = f"kvblend: vLLM prefills a request itself: {plan.why}"
            self.fallbacks.warn(plan.why.code, line)
        elif self.per_request:
            logger.info(
                "kvblend: request %s: %d prompt tokens: vLLM prefills it (forecast %.2f s, "
                "a blend %.2f s; decided in %.1f ms)",
                request_id,
                plan.total,
                record["forecast_vllm_s"],
                record["forecast_blend_s"],
                1000 * plan.plan_s,
            )

    def blended(self, record: dict[str, Any], outcome: BlendOutcome) -> None:
        """Say what a blend did (its warnings, and one line when per-request lines are on)."""
        for cause, line in complete_record(record, outcome):
            self.fallbacks.warn(cause, line)
        if not self.per_request or outcome.cancelled:
            return
        forecast = ""
        if "forecast_blend_s" in record:
            forecast = (
                f" (forecast {record['forecast_blend_s']:.2f} s, vLLM's prefill "
                f"{record['forecast_vllm_s']:.2f} s)"
            )
        logger.info(
            "kvblend: request %s: %d prompt tokens: blended, %d reused (%d of them from vLLM's "
            "prefix cache), %d recomputed; blend %.2f s%s",
            outcome.request_id,
            record["prompt_tokens"],
            record["cached_tokens"],
            record["vllm_prefix_tokens"],
            record["recomputed_tokens"],
            outcome.compute_s,
            forecast,
        )

    def warn(self, cause: str, line: str) -> None:
        """Say ``line`` (at most once a minute per ``cause``)."""
        self.fallbacks.warn(cause, line)


def empty_counts() -> dict[str, Any]:
    """Return counts of no request."""
    counts: dict[str, Any] = dict.fromkeys(COUNTS, 0)
    counts["vllm_reasons"] = {}
    counts["blend_seconds"] = []
    return counts


class Counts:
    """Sums of the records of finished requests, for vLLM's metrics (taken each interval)."""

    def __init__(self) -> None:
        self.counts = empty_counts()

    def add(self, record: dict[str, Any]) -> None:
        """Count one finished request's record."""
        counts = self.counts
        counts["requests"] += 1
        if record.get("fallback") is None:
            counts["blended"] += 1
            if "blend_s" in record:
                counts["blend_seconds"].append(float(record["blend_s"]))
        else:
            counts["vllm"] += 1
            reason = record["reason"]  # its fallback's code (`planned_record`)
            counts["vllm_reasons"][reason] = counts["vllm_reasons"].get(reason, 0) + 1
        prompt, cached = int(record["prompt_tokens"]), int(record["cached_tokens"])
        prefix = int(record["vllm_prefix_tokens"])
        counts["prompt_tokens"] += prompt
        counts["prefix_cached_tokens"] += prefix
        counts["reused_tokens"] += cached - prefix
        counts["computed_tokens"] += prompt - cached
        counts["recomputed_tokens"] += int(record["recomputed_tokens"])
        counts["escalated_tokens"] += int(record.get("escalated_tokens", 0))
        if "forecast_blend_s" in record:
            counts["forecast_blend_ms"] += round(1000 * record["forecast_blend_s"])
            counts["forecast_vllm_ms"] += round(1000 * record["forecast_vllm_s"])

    def take(self) -> dict[str, Any]:
        """Return the counts since the last call, and start again."""
        counts, self.counts = self.counts, empty_counts()
        return counts
