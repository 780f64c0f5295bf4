"""Building the connector's two sides from vLLM's configuration, and the worker's step hooks.

The scheduler side needs the tokenizer, the model's sizes and the store; the worker side also
needs the model, which the plugin took from vLLM's loader (`plugin.loaded_model`), and the
attention layers' caches, which vLLM registers after loading. A worker side that cannot be
built (no model, an unsupported one, pipeline parallelism) reports a failed gate with its
reason, so the scheduler side claims nothing and vLLM prefills every request itself. Under
tensor parallelism each rank's worker side blends with its own heads (`VLLMAdapter`).
"""

from __future__ import annotations

import logging
from typing import Any

from kvblend.vllm.documents import (
    ShapeOnly,
    config_shape,
    folder_fingerprint,
    open_library,
    open_tokenizer,
)
from kvblend.vllm.scheduler import KVBlendMetadata, KVBlendWorkerMeta, SchedulerSide
from kvblend.vllm.settings import ConnectorSettings
from kvblend.vllm.worker import BlendOutcome, WorkerSide

logger = logging.getLogger("kvblend.vllm")

__all__ = ["WorkerHooks", "scheduler_side"]


def scheduler_side(settings: ConnectorSettings, vllm_config: Any) -> SchedulerSide:
    """Build the scheduler side for the model vLLM serves, over the shared store."""
    model_config = vllm_config.model_config
    tokenizer = open_tokenizer(model_config)
    shape = config_shape(model_config, vllm_config.parallel_config)
    decoder = ShapeOnly(shape, model_config.dtype)
    fingerprint = folder_fingerprint(model_config, tokenizer, model_config.dtype)
    library = open_library(settings, model_config, decoder, tokenizer, fingerprint)
    if (warning := failure_policy_warning(vllm_config.kv_transfer_config)) is not None:
        logger.warning(warning)
    return SchedulerSide(settings, library)


def failure_policy_warning(kv_transfer_config: Any) -> str | None:
    """Return the warning for a policy that fails requests whose claimed rows were not written."""
    policy = getattr(kv_transfer_config, "kv_load_failure_policy", "recompute")
    if policy == "recompute":
        return None
    return (
        f"kv_load_failure_policy is {policy!r}: a request whose blend fails even as full "
        'prefill ends with an error; add "kv_load_failure_policy": "recompute" to '
        "--kv-transfer-config so that vLLM computes those tokens itself"
    )


def _unsupported(vllm_config: Any) -> str | None:
    """Why the worker side cannot blend with this vLLM configuration (None: it can)."""
    pipeline = vllm_config.parallel_config.pipeline_parallel_size
    if pipeline > 1:
        return (
            f"pipeline_parallel_size={pipeline} is not supported: the blend loop runs every "
            "layer in one process, a pipeline rank holds only some of them"
        )
    return None


def _logits_on_every_rank() -> None:
    """Refuse tensor parallelism where vLLM gathers the logits to the first rank only.

    The parity gate compares logits on every rank (each runs the same collectives); a rank
    without them would leave the others waiting.
    """
    from vllm.platforms import current_platform

    from kvblend.errors import UnsupportedModelError

    if not current_platform.use_all_gather():
        raise UnsupportedModelError(
            "tensor parallelism is not supported on this platform: vLLM gathers the logits "
            "to the first rank only, and every rank's parity gate needs them"
        )


class WorkerHooks:
    """The worker side's state across vLLM's per-step hooks."""

    def __init__(self, settings: ConnectorSettings, vllm_config: Any, kv_cache_config: Any) -> None:
        self.settings = settings
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.side: WorkerSide | None = None
        self._verdict: tuple[bool, str] | None = None
        self._reported = False
        self._outcomes: list[BlendOutcome] = []
        self._failed: set[int] = set()

    def register(self, kv_caches: dict[str, Any]) -> None:
        """Build the worker side over the loaded model; run the parity gate."""
        try:
            self.side = self._build()
        except Exception as error:  # noqa: BLE001 - no blending, said once
            self._verdict = (False, f"the worker side could not start: {error}")
            return
        if not self.settings.parity:
            self._verdict = (True, "parity gate off (kv_connector_extra_config parity=false)")
            return
        from kvblend.vllm.reference import vllm_logits

        model = self.side.adapter.model

        def reference(ids: list[int]) -> Any:
            return vllm_logits(model, self.vllm_config, self.kv_cache_config, ids)

        self._verdict = self.side.gate(reference)

    def _build(self) -> WorkerSide:
        from kvblend.errors import UnsupportedModelError
        from kvblend.vllm.adapter import VLLMAdapter
        from kvblend.vllm.plugin import loaded_model

        reason = _unsupported(self.vllm_config)
        if reason is not None:
            raise UnsupportedModelError(reason)
        model = loaded_model()
        if model is None:
            raise RuntimeError(
                "vLLM did not hand the model over: is kvblend installed in vLLM's environment "
                "(its vllm.general_plugins entry point)?"
            )
        adapter = VLLMAdapter(model)
        model_config = self.vllm_config.model_config
        tokenizer = open_tokenizer(model_config)
        fingerprint = folder_fingerprint(model_config, tokenizer, adapter.dtype)
        # entries hold every KV head: under tensor parallelism they are checked against the
        # whole model's shape, and each rank reads its own heads (`blend_plan.read_spans`)
        decoder: Any = adapter
        if adapter.tp_size > 1:
            _logits_on_every_rank()
            full = config_shape(model_config, self.vllm_config.parallel_config)
            decoder = ShapeOnly(full, adapter.dtype)
            heads = adapter.kv_heads
            logger.info(
                "kvblend: tensor-parallel rank %d of %d blends %d query heads and KV heads "
                "[%d, %d) of %d",
                adapter.tp_rank, adapter.tp_size, adapter.shape.num_heads, heads.start,
                heads.stop, full.num_kv_heads,
            )  # fmt: skip
        library = open_library(self.settings, model_config, decoder, tokenizer, fingerprint)
        return WorkerSide(adapter, library, int(self.vllm_config.cache_config.block_size))

    def start(self, meta: KVBlendMetadata) -> None:
        """Before the forward: blend every claimed request of the step."""
        if not meta.jobs:
            return
        for job in meta.jobs:
            if self.side is not None and self._verdict and self._verdict[0]:
                self._outcomes.append(self.side.run(job))
                continue
            # claimed without a working worker side: nothing written, vLLM recomputes the blocks
            size = int(self.vllm_config.cache_config.block_size)
            blocks = job.block_ids[job.start // size : (job.stop - 1) // size + 1]
            self._failed.update(blocks)
            self._outcomes.append(BlendOutcome(job.request_id, error="no worker side", failed=True))

    def finish(self, meta: KVBlendMetadata) -> None:
        """After the forward: store documents found but not stored yet."""
        if meta.fill and self.side is not None and self._verdict and self._verdict[0]:
            self.side.fill(meta.fill)

    def take_failed_blocks(self) -> set[int]:
        """Return the blocks of claimed rows not written since the last call."""
        failed, self._failed = self._failed, set()
        return failed | (self.side.take_failed_blocks() if self.side is not None else set())

    def report(self) -> KVBlendWorkerMeta | None:
        """Return the verdict (first report only) and the outcomes since the last report."""
        verdict = None
        if not self._reported and self._verdict is not None:
            verdict, self._reported = self._verdict, True
        outcomes, self._outcomes = self._outcomes, []
        if verdict is None and not outcomes:
            return None
        return KVBlendWorkerMeta(verdict, outcomes)
