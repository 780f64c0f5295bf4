"""The connector's worker side: one `Worker` per vLLM worker process, across vLLM's step hooks.

When the KV caches are registered it builds what it blends with (`sides.worker_model`), runs
the parity gate (`blending.gate`) and, when the gate passed and the server chooses by forecast,
the start-up calibration (`calibration.CalibrationJob`). Each step (``start_load_kv``, after the
step's forward) it times the forward for the cost model, queues the step's jobs as `pacing.Task`
objects, stops those whose request finished, and runs the queue for one slice (`pacing`); a
finished job's request is reported through ``get_finished`` (its KV has arrived, or, failed,
vLLM computes it) and its outcome in the next `WorkerReport`. Under tensor parallelism every
rank runs each blend whole, in the engine thread (the ranks' collectives must pair up, which
slices of a time budget would not).

On a GPU the blends' kernels run on a stream of their own, set while a slice runs
(`SideStream`): a slice only launches them, and a blend reports done once they have finished,
so vLLM never reads a block before its KV is written. On the CPU the blends' slices run on the
thread count that runs the loop's ops faster now (`pacing.ThreadChoice`); vLLM's own count is
set back before its forward.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import _C as torch_c  # set_num_threads: the builtin (vLLM's CPU worker replaces torch's)

from kvblend.blend.loop import stop_if_cancelled
from kvblend.vllm.compat import reference_logits
from kvblend.vllm.costs import step_features
from kvblend.vllm.execution.blending import WorkerModel, gate, run_job, store
from kvblend.vllm.execution.calibration import CalibrationJob
from kvblend.vllm.execution.pacing import SliceRunner, Task, ThreadChoice, layer_ops
from kvblend.vllm.requests import BlendJob, BlendOutcome, StepMetadata, WorkerReport
from kvblend.vllm.settings import ConnectorSettings

logger = logging.getLogger("kvblend.vllm")

__all__ = ["SideStream", "Worker"]


class SideStream:
    """On a GPU, the stream the blends' kernels run on, set while a slice runs; else nothing."""

    def __init__(self, device: torch.device | None) -> None:
        self.stream: Any = None
        self._previous: Any = None
        if device is not None and device.type == "cuda":
            self.stream = torch.cuda.Stream(device=device)

    def switch(self, running: bool) -> None:
        """Make the side stream current while a blend runs, vLLM's own otherwise."""
        if self.stream is None:
            return
        if running:
            self._previous = torch.cuda.current_stream(self.stream.device)
            torch.cuda.set_stream(self.stream)
        elif self._previous is not None:
            torch.cuda.set_stream(self._previous)

    def done(self) -> None:
        """Wait for the kernels the blends launched."""
        if self.stream is not None:
            self.stream.synchronize()


class Worker:
    """The worker side's state in one vLLM worker process (see the module)."""

    def __init__(self, settings: ConnectorSettings, vllm_config: Any, kv_cache_config: Any) -> None:
        self.settings = settings
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.model: WorkerModel | None = None
        self.verdict: tuple[bool, str] | None = None
        self.runner = SliceRunner()
        self.stream = SideStream(None)
        self.threads: ThreadChoice | None = None  # the blends' thread count (CPU, no TP)
        self._report = WorkerReport()  # what the next report says
        self._reported = False  # the verdict went out
        self._loaded: set[str] = set()  # requests whose load ended since the last call
        self._failed: set[str] = set()  # of which nothing was written
        self._arrived: dict[str, float] = {}  # request -> when its job arrived
        self._bound_at: float | None = None
        self._refused_store = False

    @property
    def working(self) -> bool:
        """Whether it blends (built, and its gate passed)."""
        return self.model is not None and self.verdict is not None and self.verdict[0]

    # ------------------------------------------------------------------ start-up
    def register(self, build: Callable[[], WorkerModel]) -> None:
        """Build what it blends with (``build()``); run the parity gate and the calibration."""
        try:
            self.model = model = build()
        except Exception as error:  # noqa: BLE001 - no blending, said once
            self.verdict = (False, f"the worker side could not start: {error}")
            return
        adapter = model.adapter
        self.runner = SliceRunner(whole=adapter.tp_size > 1)
        self.stream = SideStream(adapter.device)
        own = int(torch.get_num_threads())
        if adapter.device.type == "cpu" and adapter.tp_size == 1 and own > 1:
            shape = adapter.shape
            measure = functools.partial(
                layer_ops,
                heads=shape.num_heads,
                kv_heads=shape.num_kv_heads,
                head_dim=shape.head_dim,
            )
            self.threads = ThreadChoice((own, 1), measure)
        if not self.settings.parity:
            self.verdict = (True, "parity gate off (kv_connector_extra_config parity=false)")
        else:
            self.verdict = gate(model, self._reference)
        if self.verdict[0] and self.settings.when == "faster":
            try:
                job = CalibrationJob()
                calibration = job.run(
                    model, self._reference, self.settings.config, self._blend_threads
                )
                self._report.calibration = calibration
            except Exception as error:  # noqa: BLE001 - no forecast: vLLM prefills everything
                self.verdict = (False, f"the cost model's calibration failed: {error}")

    def _reference(self, token_ids: list[int]) -> torch.Tensor:
        """Return vLLM's own forward's last logits after ``token_ids`` (gate, calibration)."""
        assert self.model is not None
        vllm_model = self.model.adapter.model
        return reference_logits(vllm_model, self.vllm_config, self.kv_cache_config, token_ids)

    def _blend_threads(self, blending: bool) -> None:
        """Set the thread count for a blend (the one `ThreadChoice` picks now) or vLLM's own."""
        choice = self.threads
        if choice is not None:
            count = choice.choose("kvblend-calibration")[0] if blending else choice.counts[0]
            torch_c.set_num_threads(count)

    # ------------------------------------------------------------------ each step
    def bind(self) -> None:
        """Note that the step's metadata is bound: its forward starts now."""
        self._bound_at = time.perf_counter()

    def start(self, meta: StepMetadata) -> None:
        """After the step's forward: time it, stop, queue, then run a slice of the blends."""
        from kvblend.vllm.admission import StepTimed

        now = time.perf_counter()
        if meta.step and self._bound_at is not None:
            features = step_features(meta.step).tolist()
            self._report.steps.append(StepTimed(features, now - self._bound_at))
        self._bound_at = None
        for request_id in meta.stop:
            self.runner.cancel(request_id)
        for job in meta.jobs:
            self._queue(job, now)
        if meta.store:
            self._queue_store(meta.store)
        if self.runner.busy:
            self._slice()
            self._collect()

    def _queue(self, job: BlendJob, now: float) -> None:
        if self.model is None or not self.working:
            # claimed without a working worker side: nothing written, vLLM computes it
            self._ended(BlendOutcome(job.request_id, error="no worker side", failed=True))
            return
        self._arrived[job.request_id] = now
        work = functools.partial(self._run, job)
        self.runner.submit(Task(job.request_id, work, self.stream.switch))

    def _run(self, job: BlendJob, pause: Callable[[], None], cancel: threading.Event) -> Any:
        assert self.model is not None
        stop_if_cancelled(cancel, pause)  # its first slice may be the next step's
        outcome = run_job(self.model, job, pause, cancel)
        self.stream.done()
        return outcome

    def _queue_store(self, documents: list[tuple[str, str]]) -> None:
        """Store documents found but not stored, after the blends (not under TP: said once)."""
        if self.model is None or not self.working:
            return
        adapter = self.model.adapter
        if adapter.tp_size > 1:
            if not self._refused_store and adapter.tp_rank == 0:  # every rank would say it
                self._refused_store = True
                logger.warning(
                    "kvblend: documents not stored yet are not stored by a tensor-parallel "
                    "server (tensor_parallel_size=%d: each rank computes only its own KV heads); "
                    "store them with `kvblend precompute`",
                    adapter.tp_size,
                )
            return
        work = functools.partial(store, self.model, list(documents))
        self.runner.submit(Task("", work, self.stream.switch))

    def _slice(self) -> None:
        """Run one slice, on the thread count `ThreadChoice` picks (on the CPU)."""
        choice = self.threads
        if choice is None:
            self.runner.run(self.settings.slice_s)
            return
        threads, changed = choice.choose(self.runner.current)
        if changed is not None:
            logger.info("%s", changed)
        torch_c.set_num_threads(threads)
        try:
            self.runner.run(self.settings.slice_s)
        finally:
            torch_c.set_num_threads(choice.counts[0])  # vLLM's own, for its forward

    def _collect(self) -> None:
        """Take the finished tasks: their outcomes, and their requests' loads as ended."""
        for task in self.runner.take_done():
            if not task.key:  # storing documents
                continue
            outcome = task.result
            if outcome is None:  # cancelled, or an error the job did not catch
                outcome = BlendOutcome(task.key, cancelled=task.cancelled)
                if not task.cancelled:
                    outcome.error, outcome.failed = f"{task.error}", True
            outcome.compute_s = task.compute_s
            outcome.blend_s = time.perf_counter() - self._arrived.pop(task.key, time.perf_counter())
            self._ended(outcome)

    def _ended(self, outcome: BlendOutcome) -> None:
        self._report.outcomes.append(outcome)
        self._loaded.add(outcome.request_id)
        if outcome.failed:
            self._failed.add(outcome.request_id)

    def transfers(self) -> tuple[set[str], set[str]]:
        """Return the requests whose load ended since the last call, and those it failed for."""
        done, failed = self._loaded, self._failed
        self._loaded, self._failed = set(), set()
        return done, failed

    def report(self) -> WorkerReport | None:
        """Return the verdict and calibration (first report only), outcomes and step times."""
        report, self._report = self._report, WorkerReport()
        if not self._reported and self.verdict is not None:  # the calibration goes with it
            report.verdict, self._reported = self.verdict, True
        if report.verdict is None and not report.outcomes and not report.steps:
            return None
        return report
