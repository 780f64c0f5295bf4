"""kvblend's counts in vLLM's metrics: its periodic stats log line and Prometheus metrics.

The scheduler side counts each finished request it planned (`request_records.Counts`); vLLM collects
the counts through ``get_kv_connector_stats`` every step (`KVBlendStats`), logs their sum with
its other stats ("KV Transfer metrics: requests=..., blended=..., reused_tokens=...") and exports
them where its own metrics are: ``/metrics`` of the OpenAI server, ``LLM.get_metrics()`` offline
(with ``disable_log_stats=False``). The Prometheus metrics (`KVBlendPromMetrics`), per engine:

- ``vllm:kvblend_blended_requests_total``: requests blended;
- ``vllm:kvblend_vllm_requests_total`` (label ``reason``): requests left to vLLM's own prefill,
  by reason (`fallbacks.RequestFallback.code`: ``vllm_faster``, ``not_stored``, ``empty_store``,
  ``refused``...);
- ``vllm:kvblend_prompt_tokens_total``, and its parts: ``..._prefix_cached_tokens_total`` (held
  by vLLM's prefix cache), ``..._reused_tokens_total`` (read from the store and not recomputed)
  and ``..._computed_tokens_total`` (by the blend or vLLM); of the computed ones,
  ``..._recomputed_tokens_total`` (read from the store, recomputed) and
  ``..._escalated_tokens_total`` (recomputed in full by a quality guard);
- ``vllm:kvblend_blend_seconds`` (histogram): each blend's own time;
- ``vllm:kvblend_forecast_seconds_total`` (label ``path``: blend or vllm): both forecasts of the
  requests that had them, summed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvblend.vllm.scheduling.request_records import COMMON_REASONS, COUNTS, empty_counts

__all__ = ["BLEND_BUCKETS", "TOKENS", "KVBlendPromMetrics", "KVBlendStats"]

#: The token counts exported, each as ``vllm:kvblend_<name>_total``.
TOKENS = (
    "prompt_tokens",
    "prefix_cached_tokens",
    "reused_tokens",
    "computed_tokens",
    "recomputed_tokens",
    "escalated_tokens",
)
#: Buckets of the blend-time histogram, in seconds.
BLEND_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0)


@dataclass
class KVBlendStats(KVConnectorStats):
    """Sums of kvblend's per-request counts over an interval."""

    def __post_init__(self) -> None:
        for name, empty in empty_counts().items():
            self.data.setdefault(name, empty)

    def reset(self) -> None:
        """Zero every count."""
        self.data = empty_counts()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Add ``other``'s counts to these."""
        for name in COUNTS:
            self.data[name] = self.data.get(name, 0) + int(other.data.get(name, 0))
        reasons = self.data["vllm_reasons"]
        for reason, count in dict(other.data.get("vllm_reasons") or {}).items():
            reasons[reason] = reasons.get(reason, 0) + int(count)
        self.data["blend_seconds"] = [
            *self.data["blend_seconds"],
            *(other.data.get("blend_seconds") or []),
        ]
        return self

    def reduce(self) -> dict[str, int | float]:
        """Return the interval's counts, the requests left to vLLM by reason, the blend time."""
        counts: dict[str, int | float] = {name: int(self.data.get(name, 0)) for name in COUNTS}
        for reason, count in sorted(self.data["vllm_reasons"].items()):
            counts[f"vllm.{reason}"] = int(count)
        counts["blend_s"] = round(sum(self.data["blend_seconds"]), 3)
        prompt = counts["prompt_tokens"]
        cached = counts["prefix_cached_tokens"] + counts["reused_tokens"]
        counts["cached_share"] = round(cached / prompt, 3) if prompt else 0.0
        return counts

    def is_empty(self) -> bool:
        """Whether no request was counted."""
        return not self.data.get("requests")


class KVBlendPromMetrics(KVConnectorPromMetrics):
    """kvblend's Prometheus metrics, per engine (see the module)."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        kinds = {kind.__name__: made for kind, made in metric_types.items()}
        counter, histogram = kinds["Counter"], kinds["Histogram"]
        self._blended = counter(
            name="vllm:kvblend_blended_requests_total",
            documentation="Requests kvblend blended.",
            labelnames=labelnames,
        )
        self._left = counter(
            name="vllm:kvblend_vllm_requests_total",
            documentation="Requests kvblend planned and left to vLLM's own prefill, by reason.",
            labelnames=[*labelnames, "reason"],
        )
        self._tokens = {
            name: counter(
                name=f"vllm:kvblend_{name}_total",
                documentation=f"{name.replace('_', ' ').capitalize()} of the requests kvblend "
                "planned.",
                labelnames=labelnames,
            )
            for name in TOKENS
        }
        self._blend_seconds = histogram(
            name="vllm:kvblend_blend_seconds",
            documentation="Each blend's own time (its slices between engine steps), in seconds.",
            labelnames=labelnames,
            buckets=list(BLEND_BUCKETS),
        )
        self._forecasts = counter(
            name="vllm:kvblend_forecast_seconds_total",
            documentation="kvblend's forecasts of each request, by path (blend, or vLLM's "
            "prefill), summed over the requests that had both.",
            labelnames=[*labelnames, "path"],
        )
        for labels in per_engine_labelvalues.values():  # every count exists from the start
            for made in (self._blended, self._blend_seconds, *self._tokens.values()):
                made.labels(*labels)
            for reason in COMMON_REASONS:
                self._left.labels(*labels, reason)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Add one interval's counts to the metrics of engine ``engine_idx``."""
        labels = self.per_engine_labelvalues[engine_idx]
        data = transfer_stats_data
        if int(data.get("blended", 0)):
            self._blended.labels(*labels).inc(int(data["blended"]))
        for reason, count in dict(data.get("vllm_reasons") or {}).items():
            self._left.labels(*labels, reason).inc(int(count))
        for name, made in self._tokens.items():
            if int(data.get(name, 0)) > 0:
                made.labels(*labels).inc(int(data[name]))
        for seconds in data.get("blend_seconds") or ():
            self._blend_seconds.labels(*labels).observe(float(seconds))
        for path in ("blend", "vllm"):
            milliseconds = int(data.get(f"forecast_{path}_ms", 0))
            if milliseconds > 0:
                self._forecasts.labels(*labels, path).inc(milliseconds / 1000)
