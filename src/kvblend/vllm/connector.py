"""`KVBlendConnector`: kvblend's blended prefill inside vLLM, as an out-of-tree KV connector.

Selected with ``kv_transfer_config={"kv_connector": "KVBlendConnector",
"kv_connector_module_path": "kvblend.vllm", "kv_role": "kv_both"}`` (``--kv-transfer-config``
on ``vllm serve``). vLLM builds one connector per process and role: the scheduler side
(`scheduler.SchedulerSide`) decides which prompt tokens kvblend provides; the worker side
(`worker.Worker`) blends them into vLLM's paged KV cache between steps, with the model the
``vllm.general_plugins`` entry point (`plugin`) took from vLLM's loader. This class only routes
vLLM's hooks to them; the messages between them (`requests.StepMetadata`,
`requests.WorkerReport`) are vLLM's connector metadata types.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)

from kvblend.vllm import compat
from kvblend.vllm.execution.worker import Worker
from kvblend.vllm.metrics import KVBlendPromMetrics, KVBlendStats
from kvblend.vllm.requests import StepMetadata, WorkerReport
from kvblend.vllm.scheduling.scheduler import SchedulerSide
from kvblend.vllm.settings import ConnectorSettings
from kvblend.vllm.sides import scheduler_side, worker_model

logger = logging.getLogger("kvblend.vllm")

__all__ = ["KVBlendConnector"]

KVConnectorMetadata.register(StepMetadata)
KVConnectorWorkerMetadata.register(WorkerReport)


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


class KVBlendConnector(KVConnectorBase_V1):
    """Blended prefill of stored documents, wherever they land in a prompt (kvblend)."""

    def __init__(
        self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _log_like_vllm()
        self.vllm_config = vllm_config
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self.settings = ConnectorSettings.from_extra_config(extra)
        self.scheduler: SchedulerSide | None = None
        self.worker: Worker | None = None
        self.step = StepMetadata()  # the metadata bound for the step (worker side)
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = scheduler_side(self.settings, vllm_config)
        else:
            self.worker = Worker(self.settings, vllm_config, kv_cache_config)

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Return the tokens kvblend provides after vLLM's own prefix-cache hit (0: none)."""
        assert self.scheduler is not None
        return self.scheduler.matched(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Record the blocks of a request whose tokens kvblend provides."""
        assert self.scheduler is not None
        self.scheduler.allocated(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """Return the step's blends, for the worker side."""
        assert self.scheduler is not None
        return self.scheduler.metadata(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        """Take the workers' parity verdict, observations and blend outcomes."""
        assert self.scheduler is not None
        self.scheduler.worker_output(compat.worker_report(connector_output))

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Blocks are freed at once; the request's kvblend record goes into its output."""
        assert self.scheduler is not None
        return False, self.scheduler.finished(request)

    def get_kv_connector_stats(self) -> KVBlendStats | None:
        """Return the counts of the requests finished since the last call (vLLM's metrics)."""
        if self.scheduler is None:
            return None
        counts = self.scheduler.take_counts()
        return KVBlendStats(data=counts) if counts["requests"] else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVBlendStats:
        """Rebuild kvblend's counts from their dict (vLLM's stats loggers)."""
        return KVBlendStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVBlendPromMetrics:
        """Register kvblend's Prometheus metrics (``vllm:kvblend_*``)."""
        return KVBlendPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Build the worker side over the loaded model and run the parity gate."""
        assert self.worker is not None
        self.worker.register(functools.partial(worker_model, self.settings, self.vllm_config))

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Take the step's metadata; the step's forward starts now (timed for the cost model)."""
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, StepMetadata)
        self.step = connector_metadata
        if self.worker is not None:
            self.worker.bind()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """After the step's forward (every load is asynchronous): queue and slice the blends."""
        assert self.worker is not None
        self.worker.start(self.step)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: a request's forward starts only once its blend is done."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Return the requests whose blend ended (done, failed or stopped) since the last step."""
        if self.worker is None:
            return None, None
        done, _ = self.worker.transfers()
        return None, done or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Return the ended blends, and those that wrote nothing (vLLM computes them)."""
        if self.worker is None:
            return KVConnectorTransferResults()
        done, failed = self.worker.transfers()
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
        """Return the parity verdict and calibration (once), the outcomes and forwards timed."""
        return self.worker.report() if self.worker is not None else None
