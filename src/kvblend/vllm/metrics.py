"""kvblend's counts in vLLM's metrics: its periodic stats log line and Prometheus counters.

The scheduler side counts each finished request it planned (`scheduler.COUNTS`); vLLM collects
them through ``get_kv_connector_stats`` every step, logs their sum with its other stats ("KV
Transfer metrics: requests=..., blended=..., cached_tokens=...") and exports them on
``/metrics``: ``vllm:kvblend_requests_total`` (label ``outcome``: blended, vllm or refused),
``vllm:kvblend_prompt_tokens_total``, ``vllm:kvblend_cached_tokens_total``,
``vllm:kvblend_recomputed_tokens_total`` and ``vllm:kvblend_forecast_seconds_total`` (label
``path``: blend or vllm; the two forecasts of each request that had them, summed). vLLM
collects stats only when its stats logging is on (``vllm serve``'s default; ``LLM`` turns it
off unless ``disable_log_stats=False``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvblend.vllm.scheduler import COUNTS

__all__ = ["KVBlendPromMetrics", "KVBlendStats"]


@dataclass
class KVBlendStats(KVConnectorStats):
    """Sums of kvblend's per-request counts over an interval."""

    def __post_init__(self) -> None:
        for name in COUNTS:
            self.data.setdefault(name, 0)

    def reset(self) -> None:
        """Zero every count."""
        self.data = dict.fromkeys(COUNTS, 0)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Add ``other``'s counts to these."""
        for name in COUNTS:
            self.data[name] = self.data.get(name, 0) + int(other.data.get(name, 0))
        return self

    def reduce(self) -> dict[str, int | float]:
        """Return the interval's counts, with the share of prompt tokens nobody computed."""
        counts: dict[str, int | float] = {name: int(self.data.get(name, 0)) for name in COUNTS}
        prompt = counts["prompt_tokens"]
        counts["cached_share"] = round(counts["cached_tokens"] / prompt, 3) if prompt else 0.0
        return counts

    def is_empty(self) -> bool:
        """Whether no request was counted."""
        return not self.data.get("requests")


class KVBlendPromMetrics(KVConnectorPromMetrics):
    """Prometheus counters of kvblend's counts, per engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._requests = self._counter_cls(
            name="vllm:kvblend_requests_total",
            documentation="Requests kvblend planned, by outcome (blended, or vLLM's prefill).",
            labelnames=[*labelnames, "outcome"],
        )
        self._tokens = {
            name: self._counter_cls(
                name=f"vllm:kvblend_{name}_total",
                documentation=f"kvblend's {name.replace('_', ' ')} over the requests it planned.",
                labelnames=labelnames,
            )
            for name in ("prompt_tokens", "cached_tokens", "recomputed_tokens")
        }
        self._forecasts = self._counter_cls(
            name="vllm:kvblend_forecast_seconds_total",
            documentation="kvblend's forecasts of each request, by path (blend, or vLLM's "
            "prefill), summed over the requests that had both.",
            labelnames=[*labelnames, "path"],
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Add one interval's counts to the counters of engine ``engine_idx``."""
        labels = self.per_engine_labelvalues[engine_idx]
        for outcome in ("blended", "vllm", "refused"):
            value = int(transfer_stats_data.get(outcome, 0))
            if value:
                self._requests.labels(*labels, outcome).inc(value)
        for name, counter in self._tokens.items():
            value = int(transfer_stats_data.get(name, 0))
            if value > 0:
                counter.labels(*labels).inc(value)
        for path in ("blend", "vllm"):
            milliseconds = int(transfer_stats_data.get(f"forecast_{path}_ms", 0))
            if milliseconds > 0:
                self._forecasts.labels(*labels, path).inc(milliseconds / 1000)
