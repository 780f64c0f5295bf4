"""Building the connector's two sides from vLLM's configuration, and the worker's step hooks.

The scheduler side needs the tokenizer, the model's sizes and the store; the worker side also
needs the model, which the plugin took from vLLM's loader (`plugin.loaded_model`), and the
attention layers' caches, which vLLM registers after loading. A worker side that cannot be
built (no model, an unsupported one, pipeline parallelism) reports a failed gate with its
reason, so the scheduler side claims nothing and vLLM prefills every request itself. Under
tensor parallelism each rank's worker side blends with its own heads (`VLLMAdapter`).
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

import torch
from torch import _C as torch_c  # set_num_threads: the builtin (vLLM's CPU worker replaces torch's)

from kvblend.vllm.documents import (
    ShapeOnly,
    StoreSummary,
    config_shape,
    folder_fingerprint,
    open_library,
    open_tokenizer,
    store_location,
)
from kvblend.vllm.pacing import ThreadChoice, layer_ops
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
    name = library.segment_kv.model_name
    summary = StoreSummary(library.store, fingerprint, name, store_location(settings))
    logger.info("%s", summary.describe())
    block_size = int(vllm_config.cache_config.block_size)
    return SchedulerSide(settings, library, block_size=block_size, store_summary=summary)


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
    """The worker side's state across vLLM's per-step hooks.

    Blends are queued as `pacing.Task` objects and run a slice at a time at the end of each
    step (``start_load_kv``, after the step's forward); a finished one is reported through
    ``get_finished`` (its request's KV has arrived) with its outcome in the worker metadata.
    Under tensor parallelism every rank runs each blend whole, in the engine thread (the
    ranks' collectives must pair up, which slices of a time budget would not).
    """

    def __init__(self, settings: ConnectorSettings, vllm_config: Any, kv_cache_config: Any) -> None:
        self.settings = settings
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.side: WorkerSide | None = None
        self._verdict: tuple[bool, str] | None = None
        self._calibration: dict[str, Any] | None = None
        self._reported = False
        self._outcomes: list[BlendOutcome] = []
        self._finished: set[str] = set()  # loads done since the last get_finished
        self._failed_loads: set[str] = set()  # of which nothing was written
        self._steps: list[tuple[list[float], float]] = []
        self._bound_at: float | None = None
        self._started: dict[str, float] = {}  # request -> when its job arrived
        self._runner: Any = None
        self._streams = _SideStream(None)
        self._threads: ThreadChoice | None = None  # the blends' thread count (CPU, no TP)

    def register(self, kv_caches: dict[str, Any]) -> None:
        """Build the worker side over the loaded model; run the parity gate and calibrate."""
        from kvblend.vllm.pacing import SliceRunner

        try:
            self.side = self._build()
        except Exception as error:  # noqa: BLE001 - no blending, said once
            self._verdict = (False, f"the worker side could not start: {error}")
            return
        self._runner = SliceRunner(whole=self.side.adapter.tp_size > 1)
        self._streams = _SideStream(self.side.adapter.device)
        own = int(torch.get_num_threads())
        if self.side.adapter.device.type == "cpu" and self.side.adapter.tp_size == 1 and own > 1:
            shape = self.side.adapter.shape
            measure = functools.partial(
                layer_ops, heads=shape.num_heads, kv_heads=shape.num_kv_heads,
                head_dim=shape.head_dim,
            )  # fmt: skip
            self._threads = ThreadChoice((own, 1), measure)
        from kvblend.vllm.reference import vllm_logits

        model = self.side.adapter.model

        def reference(ids: list[int]) -> Any:
            return vllm_logits(model, self.vllm_config, self.kv_cache_config, ids)

        if not self.settings.parity:
            self._verdict = (True, "parity gate off (kv_connector_extra_config parity=false)")
        else:
            self._verdict = self.side.gate(reference)
        if self._verdict[0] and self.settings.when == "faster":
            try:
                self._calibration = self.side.calibrate(
                    reference, self.settings.config, self._blend_threads
                )
            except Exception as error:  # noqa: BLE001 - no forecast: vLLM prefills everything
                self._verdict = (False, f"the cost model's calibration failed: {error}")

    def _blend_threads(self, blending: bool) -> None:
        """Set the thread count for a blend (the one `ThreadChoice` picks now) or vLLM's own."""
        choice = self._threads
        if choice is not None:
            count = choice.choose("kvblend-calibration")[0] if blending else choice.counts[0]
            torch_c.set_num_threads(count)

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
        # whole model's shape, and each rank reads its own heads (`blend_plan.open_spans`)
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

    def bind(self) -> None:
        """Note that the step's metadata is bound: its forward starts now."""
        self._bound_at = time.perf_counter()

    def start(self, meta: KVBlendMetadata) -> None:
        """After the step's forward: time it, queue new blends, run a slice of them."""
        from kvblend.vllm.costs import step_features
        from kvblend.vllm.pacing import Task

        now = time.perf_counter()
        if meta.step and self._bound_at is not None:
            self._steps.append((step_features(meta.step).tolist(), now - self._bound_at))
        self._bound_at = None
        for request_id in meta.cancel:
            if self._runner is not None:
                self._runner.cancel(request_id)
        for job in meta.jobs:
            if (
                self.side is None
                or self._runner is None
                or not (self._verdict and self._verdict[0])
            ):
                # claimed without a working worker side: nothing written, vLLM recomputes
                self._outcomes.append(
                    BlendOutcome(job.request_id, error="no worker side", failed=True)
                )
                self._finished.add(job.request_id)
                self._failed_loads.add(job.request_id)
                continue
            self._started[job.request_id] = now
            work = functools.partial(_run_job, self.side, job, self._streams)
            self._runner.submit(Task(job.request_id, work, self._streams.switch))
        if meta.fill and self.side is not None and self._verdict and self._verdict[0]:
            side, fill = self.side, list(meta.fill)
            store = functools.partial(_fill, side, fill, self._streams)
            self._runner.submit(Task("", store, self._streams.switch))
        if self._runner is not None and self._runner.busy:
            self._slice()
            self._collect()

    def _slice(self) -> None:
        """Run one slice, on the thread count `ThreadChoice` picks (on the CPU)."""
        choice = self._threads
        if choice is None:
            self._runner.run(self.settings.slice_s)
            return
        threads, changed = choice.choose(self._runner.current)
        if changed is not None:
            logger.info("%s", changed)
        torch_c.set_num_threads(threads)
        try:
            self._runner.run(self.settings.slice_s)
        finally:
            torch_c.set_num_threads(choice.counts[0])  # vLLM's own, for its forward

    def _collect(self) -> None:
        """Take the finished tasks: their outcomes, and their requests' loads as done."""
        for task in self._runner.take_done():
            if not task.key:  # storing documents
                continue
            began = self._started.pop(task.key, time.perf_counter())
            outcome = task.result
            if outcome is None:
                outcome = BlendOutcome(task.key)
                if task.cancelled:
                    outcome.cancelled = True
                else:  # an error the job did not catch: vLLM computes the claimed rows
                    outcome.error, outcome.failed = f"{task.error}", True
                    self._failed_loads.add(task.key)
            elif outcome.failed:
                self._failed_loads.add(task.key)
            if self.side is not None:
                self.side.take_failed_blocks()  # reported as the request's failed load instead
            outcome.compute_s = task.compute_s
            outcome.blend_s = time.perf_counter() - began
            self._outcomes.append(outcome)
            self._finished.add(task.key)

    def transfers(self, finished: set[str]) -> tuple[set[str], set[str]]:
        """Return the requests whose KV arrived since the last call, and those it failed for."""
        done, failed = self._finished, self._failed_loads
        self._finished, self._failed_loads = set(), set()
        return done, failed

    def report(self) -> KVBlendWorkerMeta | None:
        """Return the verdict and calibration (first report only), outcomes and step times."""
        verdict, calibration = None, None
        if not self._reported and self._verdict is not None:
            verdict, calibration, self._reported = self._verdict, self._calibration, True
        outcomes, self._outcomes = self._outcomes, []
        steps, self._steps = self._steps, []
        if verdict is None and not outcomes and not steps:
            return None
        return KVBlendWorkerMeta(verdict, outcomes, calibration, steps)


class _SideStream:
    """On a GPU, the stream the blends' kernels run on, set while a blend's slice runs.

    A slice only launches kernels there: they run while vLLM's next forward runs on its own
    stream, and a blend reports done once they have finished (`done`), so that vLLM's forward
    never reads a block before its KV is written. On the CPU: nothing.
    """

    def __init__(self, device: Any) -> None:
        self.stream: Any = None
        self._previous: Any = None
        if getattr(device, "type", "cpu") == "cuda":
            import torch

            self.stream = torch.cuda.Stream(device=device)

    def switch(self, running: bool) -> None:
        """Make the side stream current while a blend runs, vLLM's own otherwise."""
        if self.stream is None:
            return
        import torch

        if running:
            self._previous = torch.cuda.current_stream(self.stream.device)
            torch.cuda.set_stream(self.stream)
        elif self._previous is not None:
            torch.cuda.set_stream(self._previous)

    def done(self) -> None:
        """Wait for the kernels the blends launched."""
        if self.stream is not None:
            self.stream.synchronize()


def _run_job(side: WorkerSide, job: Any, streams: _SideStream, checkpoint: Any) -> BlendOutcome:
    checkpoint()
    outcome = side.run(job, checkpoint)
    streams.done()
    return outcome


def _fill(
    side: WorkerSide, documents: list[tuple[str, str]], streams: _SideStream, checkpoint: Any
) -> int:
    stored = side.fill(documents, checkpoint)
    streams.done()
    return stored
