"""`KVBlendConnector`: kvblend's blended prefill inside vLLM, as an out-of-tree KV connector.

Selected with ``kv_transfer_config={"kv_connector": "KVBlendConnector",
"kv_connector_module_path": "kvblend.vllm", "kv_role": "kv_both"}`` (``--kv-transfer-config``
on ``vllm serve``). vLLM builds one connector per process and role: the scheduler side
(`scheduler.SchedulerSide`) decides which prompt tokens kvblend provides; the worker side
(`worker.WorkerSide`) blends them into vLLM's paged KV cache before each forward, with the
model the ``vllm.general_plugins`` entry point (`plugin`) took from vLLM's loader. This class
only routes vLLM's hooks to them.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from kvblend.vllm.scheduler import KVBlendMetadata, KVBlendWorkerMeta, SchedulerSide
from kvblend.vllm.settings import ConnectorSettings

logger = logging.getLogger("kvblend.vllm")

__all__ = ["KVBlendConnector"]


def _log_like_vllm() -> None:
    """Send kvblend's log records (INFO and up) through vLLM's handlers, once per process.

    vLLM configures its own ``vllm`` logger only; without this, kvblend's per-request lines and
    fallback reasons would go nowhere (or, for warnings, to a bare stderr line).
    """
    ours, theirs = logging.getLogger("kvblend"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(logging.INFO)
    ours.propagate = False


class _Metadata(KVBlendMetadata, KVConnectorMetadata):
    """`KVBlendMetadata` as vLLM's connector metadata type."""


class _WorkerMeta(KVBlendWorkerMeta, KVConnectorWorkerMetadata):
    """`KVBlendWorkerMeta` as vLLM's worker metadata type (aggregated across ranks)."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Combine two ranks' reports."""
        merged = self.merge(other)
        return _WorkerMeta(merged.verdict, merged.outcomes, merged.calibration, merged.steps)


class KVBlendConnector(KVConnectorBase_V1):
    """Blended prefill of stored documents, wherever they land in a prompt (kvblend)."""

    def __init__(
        self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _log_like_vllm()
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.settings = ConnectorSettings.from_extra_config(extra)
        self._scheduler: SchedulerSide | None = None
        self._worker: Any = None
        if role == KVConnectorRole.SCHEDULER:
            from kvblend.vllm.sides import scheduler_side

            self._scheduler = scheduler_side(self.settings, vllm_config)
        else:
            from kvblend.vllm.sides import WorkerHooks

            self._worker = WorkerHooks(self.settings, vllm_config, kv_cache_config)

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Return the tokens kvblend provides after vLLM's own prefix-cache hit (0: none)."""
        assert self._scheduler is not None
        return self._scheduler.matched(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Record the blocks of a request whose tokens kvblend provides."""
        assert self._scheduler is not None
        self._scheduler.allocated(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """Return the step's blends, for the worker side."""
        assert self._scheduler is not None
        meta = self._scheduler.metadata(scheduler_output)
        return _Metadata(meta.jobs, meta.fill, meta.cancel, meta.step)

    def update_connector_output(self, connector_output: Any) -> None:
        """Take the workers' parity verdict and blend outcomes."""
        assert self._scheduler is not None
        self._scheduler.worker_output(getattr(connector_output, "kv_connector_worker_meta", None))

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Blocks are freed at once; the request's kvblend record goes into its output."""
        assert self._scheduler is not None
        return False, self._scheduler.finished(request)

    def get_kv_connector_stats(self) -> Any:
        """Return the counts of the requests finished since the last call (vLLM's metrics)."""
        if self._scheduler is None:
            return None
        from kvblend.vllm.metrics import KVBlendStats

        counts = self._scheduler.take_counts()
        return KVBlendStats(data=dict(counts)) if counts["requests"] else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        """Rebuild kvblend's counts from their dict (vLLM's stats loggers)."""
        from kvblend.vllm.metrics import KVBlendStats

        return KVBlendStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> Any:
        """Register kvblend's Prometheus counters (``vllm:kvblend_*``)."""
        from kvblend.vllm.metrics import KVBlendPromMetrics

        return KVBlendPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Build the worker side over the loaded model and run the parity gate."""
        self._worker.register(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Take the step's metadata; the step's forward starts now (timed for the cost model)."""
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.bind()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """After the step's forward (every load is asynchronous): queue and slice the blends."""
        self._worker.start(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: a request's forward starts only once its blend is done."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Return the requests whose blend finished (or stopped) since the last step."""
        if self._worker is None:
            return None, None
        done, _ = self._worker.transfers(finished_req_ids)
        return None, done or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """Return the finished blends, and those that wrote nothing (vLLM computes them)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

        if self._worker is None:
            return KVConnectorTransferResults()
        done, failed = self._worker.transfers(finished_req_ids)
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Nothing is saved from vLLM's cache (documents are stored from their own KV)."""

    def wait_for_save(self) -> None:
        """Nothing is saved (documents not stored yet are stored in the blends' slices)."""

    def get_block_ids_with_load_errors(self) -> set[int]:
        """None: a blend that wrote nothing is reported as a failed load of its request."""
        return set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """Return the parity verdict (once) and this step's blend outcomes."""
        report = self._worker.report() if self._worker is not None else None
        if report is None:
            return None
        return _WorkerMeta(report.verdict, report.outcomes, report.calibration, report.steps)
