"""The connector's scheduler side: which prompt tokens kvblend provides, request by request.

vLLM asks ``get_num_new_matched_tokens(request, num_computed)`` for each waiting request, with
its own prefix-cache hit (``num_computed``). The answer is the number of tokens after that hit
the connector provides: all but the last prompt token when a blend pays (`planning.plan_request`
decides with the engine's planner and budget rule), 0 otherwise, with the reason logged (each
cause once a minute). vLLM then skips exactly those tokens: the worker side must write their KV
before the forward, which computes the last token over it.

What a response reports: vLLM's ``num_cached_tokens`` (``usage.prompt_tokens_details.
cached_tokens`` through the OpenAI server) counts the tokens a request did not compute. For a
blended request the connector sets it to its own count, the tokens nobody computed: vLLM's
prefix hit plus the rows read from the store and not recomputed. The same count, with the
recomputed tokens and any fallback reason, comes back in ``kv_transfer_params["kvblend"]``.

Nothing is claimed before the worker's parity gate has passed (the scheduler asks again, step
after step, for up to `GATE_WAIT_S` seconds), nor for a resumed preempted request, a request
asking for prompt logprobs, LoRA or multimodal inputs: vLLM prefills those itself.

Cancelled and preempted requests: a job is built in the same ``schedule()`` call that allocated
the request's blocks, and the worker writes it before that step's forward. vLLM aborts and
preempts requests between steps only (or, with async scheduling or pipeline parallelism,
defers freeing the blocks of a request whose step is in flight, since this connector is a KV
consumer), so a blend never writes into blocks handed to another request. A cancelled request's
state is dropped by ``request_finished`` (or, if its blend's outcome is still on its way, when
it arrives). A preempted request keeps the record of its first prefill (what vLLM's usage
reports), with ``preemptions`` counted; vLLM computes whatever its prefix cache no longer holds.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvblend.documents.library import DocumentLibrary
from kvblend.engine.explain import FallbackLog
from kvblend.vllm.planning import RequestPlan, plan_request
from kvblend.vllm.settings import ConnectorSettings, request_config
from kvblend.vllm.worker import BlendJob, BlendOutcome

logger = logging.getLogger("kvblend.vllm")

__all__ = ["COUNTS", "GATE_WAIT_S", "KVBlendMetadata", "KVBlendWorkerMeta", "SchedulerSide"]

#: What the scheduler side counts over finished requests (vLLM's metrics: `metrics.py`):
#: requests planned, blended, prefilled by vLLM itself, their prompt tokens, the tokens nobody
#: computed (the usage's ``cached_tokens``) and the recomputed tokens.
COUNTS = ("requests", "blended", "vllm", "prompt_tokens", "cached_tokens", "recomputed_tokens")

#: How long requests wait for the workers' parity verdict before vLLM prefills them itself.
GATE_WAIT_S = 120.0


@dataclass
class KVBlendMetadata:
    """What one step's worker side does: the claimed requests, then documents to store."""

    jobs: list[BlendJob] = field(default_factory=list)
    fill: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class KVBlendWorkerMeta:
    """What the workers report: the parity verdict (once) and each blended request's outcome."""

    verdict: tuple[bool, str] | None = None
    outcomes: list[BlendOutcome] = field(default_factory=list)

    def merge(self, other: KVBlendWorkerMeta) -> KVBlendWorkerMeta:
        """Combine two workers' reports: a gate passes when it passed on every rank.

        Tensor-parallel ranks each report every blended request: one outcome per request is
        kept, a failed one (or one that fell back) over one that did not.
        """
        verdict = self.verdict or other.verdict
        if self.verdict and other.verdict and not other.verdict[0]:
            verdict = other.verdict
        outcomes: dict[str, BlendOutcome] = {}
        for outcome in self.outcomes + other.outcomes:
            kept = outcomes.get(outcome.request_id)
            worse = (outcome.failed, outcome.error is not None, len(outcome.lost))
            if kept is None or worse > (kept.failed, kept.error is not None, len(kept.lost)):
                outcomes[outcome.request_id] = outcome
        return KVBlendWorkerMeta(verdict, list(outcomes.values()))


def _excluded(request: Any) -> str | None:
    """Why vLLM must prefill ``request`` itself, whatever its documents (None: it need not)."""
    if getattr(request, "num_preemptions", 0) > 0:
        return "resumed after preemption: vLLM recomputes it"
    params = getattr(request, "sampling_params", None)
    if params is None:
        return "not a generation request"
    if getattr(params, "prompt_logprobs", None):
        return "prompt logprobs need every prompt token's logits"
    if getattr(request, "lora_request", None) is not None:
        return "LoRA adapters are not blended"
    if getattr(request, "mm_features", None):
        return "multimodal inputs are not blended"
    return None


class SchedulerSide:
    """Plans requests, claims their tokens and tells the worker side what to blend."""

    def __init__(self, settings: ConnectorSettings, library: DocumentLibrary) -> None:
        self.settings = settings
        self.library = library
        self.gate: tuple[bool, str] | None = None if settings.parity else (True, "gate off")
        self._gate_since = time.monotonic()
        self._plans: dict[str, tuple[int, RequestPlan]] = {}  # request -> (start, plan)
        self._jobs: dict[str, BlendJob] = {}  # allocated, not yet sent to the workers
        self._fill: list[tuple[str, str]] = []
        self._records: dict[str, dict[str, Any]] = {}
        #: the prefill stats vLLM reports a claimed request's cached tokens from, kept until
        #: the worker's outcome sets them to what the blend really reused
        self._stats: dict[str, Any] = {}
        self._pending: set[str] = set()  # jobs sent to the workers, outcome not back yet
        #: records of requests that finished before their blend's outcome came back (a request
        #: whose first token is its last): the outcome completes them, in the step's output
        self._done: dict[str, dict[str, Any]] = {}
        self._fallbacks = FallbackLog(logger)
        self._counts = dict.fromkeys(COUNTS, 0)

    def matched(self, request: Any, num_computed: int) -> tuple[int | None, bool]:
        """``get_num_new_matched_tokens``: tokens provided after vLLM's own ``num_computed``."""
        if self.gate is None and time.monotonic() - self._gate_since < GATE_WAIT_S:
            return None, False  # asked again next step, once the workers have reported
        if self.gate is None:
            self._set_gate((False, f"no parity verdict from the workers in {GATE_WAIT_S:g} s"))
        return self._plan(request, num_computed).claimed, False

    def _plan(self, request: Any, start: int) -> RequestPlan:
        """Plan ``request`` from ``start`` on (memoized: vLLM may ask again before scheduling)."""
        request_id = request.request_id
        assert self.gate is not None
        reason = None if self.gate[0] else "the parity gate failed"
        reason = reason or _excluded(request)  # first: a resumed request was planned before
        known = self._plans.get(request_id)
        if reason is None and known is not None and known[0] == start:
            return known[1]
        plan = None
        try:
            config = request_config(
                self.settings.config, getattr(request, "kv_transfer_params", None)
            )
            if config is None:
                reason = reason or "kvblend off for this request"
            if reason is None and config is not None:
                plan = plan_request(self.library, list(request.prompt_token_ids), start, config)
        except Exception as error:  # noqa: BLE001 - a failed plan is vLLM's own prefill
            reason = f"planning failed: {type(error).__name__}: {error}"
            plan = None
        if plan is None:
            plan = _no_plan(request, start, reason)
        self._plans[request_id] = (start, plan)
        return plan

    def allocated(self, request: Any, blocks: Any, num_external: int) -> None:
        """``update_state_after_alloc``: record the claimed request's blocks and its count."""
        known = self._plans.get(request.request_id)
        if known is None:
            return
        plan = known[1]
        self._fill.extend(plan.missing)
        plan.missing = []
        if self._resumed(request):
            return
        if num_external <= 0 or plan.fallback is not None:
            self._record(request.request_id, plan)
            return
        block_ids = list(blocks.get_block_ids()[0])
        stop = min(plan.start + num_external, plan.stop)
        self._jobs[request.request_id] = BlendJob(
            request.request_id, plan.plan, plan.config, plan.start, stop, block_ids
        )
        self._record(request.request_id, plan)
        stats = getattr(request, "prefill_stats", None)
        if stats is not None and stats.num_prompt_tokens:
            self._stats[request.request_id] = stats
            _set_cached(stats, plan.reused)

    def _resumed(self, request: Any) -> bool:
        """Whether ``request`` resumes after a preemption (its first record is kept, counted)."""
        preemptions = int(getattr(request, "num_preemptions", 0) or 0)
        record = self._records.get(request.request_id)
        if preemptions <= 0 or record is None:
            return False
        record["preemptions"] = preemptions
        self._fallbacks.warn(
            "preempted",
            "kvblend: a preempted request resumes: vLLM computes what its prefix cache no "
            "longer holds",
        )
        return True

    def _record(self, request_id: str, plan: RequestPlan) -> None:
        record = plan.summary()
        self._records[request_id] = record
        if plan.fallback is not None:
            cause = plan.fallback.split(":")[0]
            self._fallbacks.warn(cause, f"kvblend: vLLM prefills a request itself: {plan.fallback}")

    def metadata(self, scheduler_output: Any) -> KVBlendMetadata:
        """``build_connector_meta``: the jobs of the requests scheduled in this step."""
        meta = KVBlendMetadata(fill=self._fill)
        self._fill = []
        for new in scheduler_output.scheduled_new_reqs:
            job = self._jobs.pop(new.req_id, None)
            if job is not None:
                meta.jobs.append(job)
                self._pending.add(job.request_id)
        return meta

    def worker_output(self, meta: KVBlendWorkerMeta | None) -> None:
        """``update_connector_output``: take the parity verdict and each blend's outcome."""
        if meta is None:
            return
        if meta.verdict is not None and self.gate is None:
            self._set_gate(meta.verdict)
        for outcome in meta.outcomes:
            self._outcome(outcome)

    def _set_gate(self, verdict: tuple[bool, str]) -> None:
        self.gate = verdict
        if verdict[0]:
            logger.info("kvblend: %s", verdict[1])
        else:
            logger.error("kvblend: %s; vLLM prefills every request itself", verdict[1])

    def _outcome(self, outcome: BlendOutcome) -> None:
        """Take one blend's outcome: its true counts go into the record and vLLM's usage.

        The record and the stats are the objects the step's outputs hold (vLLM sends them
        after this hook), so a request that finished in this very step reports them too.
        """
        request_id = outcome.request_id
        self._pending.discard(request_id)
        stats = self._stats.pop(request_id, None)
        done = self._done.pop(request_id, None)
        record = done if done is not None else self._records.get(request_id)
        if record is None:
            return
        self._complete(record, outcome, stats)
        if done is not None:
            self._count(done)

    def _complete(self, record: dict[str, Any], outcome: BlendOutcome, stats: Any) -> None:
        record["blend_s"] = round(outcome.blend_s, 4)
        record.update({name: round(value, 4) for name, value in outcome.timings.items()})
        if outcome.lost or outcome.error is not None:
            # fewer rows reused than planned: the usage vLLM is about to send says so too (the
            # step's outputs are sent after this hook, holding the same stats object)
            record["cached_tokens"] = record["vllm_prefix_tokens"] + outcome.reused
            record["recomputed_tokens"] = outcome.recomputed
            if stats is not None:
                _set_cached(stats, record["cached_tokens"])
        if outcome.lost:
            record["lost"] = outcome.lost
            message = f"kvblend: stored KV not used, computed instead: {outcome.lost[0]}"
            self._fallbacks.warn("lost", message)
        if outcome.error is not None:
            record["error"] = outcome.error
            message = f"kvblend: blend failed, computed in full: {outcome.error}"
            self._fallbacks.warn("error", message)
        if self.settings.log_requests:
            logger.info(
                "kvblend: request %s: %d prompt tokens, %d cached (%d from vLLM's prefix cache), "
                "%d recomputed; blend %.3f s",
                outcome.request_id, record["prompt_tokens"], record["cached_tokens"],
                record["vllm_prefix_tokens"], record["recomputed_tokens"], outcome.blend_s,
            )  # fmt: skip

    def finished(self, request: Any) -> dict[str, Any] | None:
        """``request_finished``: forget the request; its record goes into its output."""
        self._plans.pop(request.request_id, None)
        self._jobs.pop(request.request_id, None)
        record = self._records.pop(request.request_id, None)
        if record is None:
            return None
        if request.request_id in self._pending:  # completed by its outcome, later this step
            self._done[request.request_id] = record
        else:
            self._stats.pop(request.request_id, None)
            self._count(record)
        return {"kvblend": record}

    def tracked(self) -> set[str]:
        """Return the requests the scheduler side holds any state of (none once all finished)."""
        held = set(self._plans) | set(self._jobs) | set(self._records) | set(self._stats)
        return held | self._pending | set(self._done)

    def _count(self, record: dict[str, Any]) -> None:
        counts = self._counts
        counts["requests"] += 1
        counts["vllm" if record.get("fallback") else "blended"] += 1
        for name in ("prompt_tokens", "cached_tokens", "recomputed_tokens"):
            counts[name] += int(record.get(name, 0))

    def take_counts(self) -> dict[str, int]:
        """Return the counts of the requests finished since the last call (`COUNTS`)."""
        counts, self._counts = self._counts, dict.fromkeys(COUNTS, 0)
        return counts


def _set_cached(stats: Any, cached: int) -> None:
    """Make vLLM's prefill stats of a request report ``cached`` tokens not computed."""
    stats.num_cached_tokens = cached
    stats.num_computed_tokens = stats.num_prompt_tokens - cached
    stats.num_external_cached_tokens = max(0, cached - stats.num_local_cached_tokens)


def _no_plan(request: Any, start: int, reason: str | None) -> RequestPlan:
    """Return the plan of a request vLLM prefills itself, saying why."""
    from kvblend.blend.config import BlendConfig
    from kvblend.prompt.plan import PrefillPlan, TokenKind

    ids = np.asarray(list(getattr(request, "prompt_token_ids", None) or []), dtype=np.int64)
    plan = PrefillPlan(ids, np.full(ids.size, TokenKind.COMPUTE, dtype=np.int8))
    return RequestPlan(
        plan, BlendConfig("full"), start, max(start, len(ids) - 1), fallback=reason or ""
    )
