"""Building the connector's two sides from vLLM's configuration.

The scheduler side needs the tokenizer, the model's sizes and the store; the worker side also
needs the model, which the plugin took from vLLM's loader (`plugin.loaded_model`). A worker side
that cannot be built (no model, an unsupported one, pipeline parallelism) reports a failed gate
with its reason, so the scheduler side claims nothing and vLLM prefills every request itself.
Under tensor parallelism each rank's worker side blends with its own heads (`VLLMAdapter`),
reading its heads of entries that hold every one.
"""

from __future__ import annotations

import logging
from typing import Any

from kvblend.errors import UnsupportedModelError
from kvblend.vllm.admission import admission
from kvblend.vllm.compat import logits_on_every_rank
from kvblend.vllm.documents import (
    ShapeOnly,
    StoreSummary,
    config_shape,
    folder_fingerprint,
    open_library,
    open_tokenizer,
    store_location,
)
from kvblend.vllm.execution.blending import WorkerModel
from kvblend.vllm.scheduling.scheduler import SchedulerSide
from kvblend.vllm.settings import ConnectorSettings

logger = logging.getLogger("kvblend.vllm")

__all__ = ["failure_policy_warning", "scheduler_side", "unsupported", "worker_model"]


def scheduler_side(settings: ConnectorSettings, vllm_config: Any) -> SchedulerSide:
    """Build the scheduler side for the model vLLM serves, over the shared store."""
    model_config = vllm_config.model_config
    tokenizer = open_tokenizer(model_config)
    decoder = ShapeOnly(config_shape(model_config), model_config.dtype)
    fingerprint = folder_fingerprint(model_config, tokenizer, model_config.dtype)
    library = open_library(settings, model_config, decoder, tokenizer, fingerprint)
    if (warning := failure_policy_warning(vllm_config.kv_transfer_config)) is not None:
        logger.warning(warning)
    name = library.segment_kv.model_name
    summary = StoreSummary(library.store, fingerprint, name, store_location(settings))
    logger.info("%s", summary.describe())
    return SchedulerSide(
        settings,
        library,
        admission(settings.when),
        block_size=int(vllm_config.cache_config.block_size),
        store_summary=summary,
    )


def failure_policy_warning(kv_transfer_config: Any) -> str | None:
    """Return the warning for a policy that fails requests whose claimed rows were not written."""
    policy = kv_transfer_config.kv_load_failure_policy
    if policy == "recompute":
        return None
    return (
        f"kv_load_failure_policy is {policy!r}: a request whose blend fails even as full "
        'prefill ends with an error; add "kv_load_failure_policy": "recompute" to '
        "--kv-transfer-config so that vLLM computes those tokens itself"
    )


def unsupported(vllm_config: Any) -> str | None:
    """Why the worker side cannot blend with this vLLM configuration (None: it can)."""
    pipeline = vllm_config.parallel_config.pipeline_parallel_size
    if pipeline > 1:
        return (
            f"pipeline_parallel_size={pipeline} is not supported: the blend loop runs every "
            "layer in one process, a pipeline rank holds only some of them"
        )
    return None


def worker_model(settings: ConnectorSettings, vllm_config: Any) -> WorkerModel:
    """Build what a worker blends with: vLLM's loaded model and the documents over the store.

    Entries hold every KV head: under tensor parallelism they are checked against the whole
    model's shape, and each rank reads its own heads (`blend_plan.open_spans`).
    """
    from kvblend.vllm.execution.adapter import VLLMAdapter
    from kvblend.vllm.plugin import loaded_model

    reason = unsupported(vllm_config)
    if reason is not None:
        raise UnsupportedModelError(reason)
    model = loaded_model()
    if model is None:
        raise RuntimeError(
            "vLLM did not hand the model over: is kvblend installed in vLLM's environment "
            "(its vllm.general_plugins entry point)?"
        )
    adapter = VLLMAdapter(model)
    model_config = vllm_config.model_config
    tokenizer = open_tokenizer(model_config)
    fingerprint = folder_fingerprint(model_config, tokenizer, adapter.dtype)
    decoder: Any = adapter
    if adapter.tp_size > 1:
        if not logits_on_every_rank():
            raise UnsupportedModelError(
                "tensor parallelism is not supported on this platform: vLLM gathers the logits "
                "to the first rank only, and every rank's parity gate needs them"
            )
        full = config_shape(model_config)
        decoder = ShapeOnly(full, adapter.dtype)
        heads = adapter.kv_heads
        logger.info(
            "kvblend: tensor-parallel rank %d of %d blends %d query heads and KV heads "
            "[%d, %d) of %d",
            adapter.tp_rank,
            adapter.tp_size,
            adapter.shape.num_heads,
            heads.start,
            heads.stop,
            full.num_kv_heads,
        )
    library = open_library(settings, model_config, decoder, tokenizer, fingerprint)
    return WorkerModel(adapter, library, int(vllm_config.cache_config.block_size))
