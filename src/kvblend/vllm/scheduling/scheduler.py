"""The connector's scheduler side: which prompt tokens kvblend provides, request by request.

vLLM asks ``get_num_new_matched_tokens(request, num_computed)`` for each waiting request, with
its own prefix-cache hit (``num_computed``). The scheduler side plans the request (`request_plan`)
and asks its admission policy (`admission`) whether to blend it. When it blends, it answers "all
but the last prompt token, loaded asynchronously": the request waits while every other request
keeps stepping, the workers blend it a slice at a time between steps and report it done; vLLM
then computes the last prompt token over the blended cache. Otherwise it answers 0 and vLLM
prefills the prompt itself. This module is the mechanism: one `requests.BlendRequest` per request
in one map, moved through its lifecycle by vLLM's hooks; what is said of each request
(`request_records`) and the choice (`admission`) live elsewhere.

Exact stays exact: blocks holding blended KV that may differ from a full prefill's (from the
first moved document's block on, `request_plan.approximate_from`) get their prefix-cache hashes
salted for the request that wrote them (`compat.salt_hashes`), so no request computing in full
ever finds them in vLLM's prefix cache; the blocks before keep vLLM's own hashes.

Nothing is claimed before the workers' parity verdict (and, when the policy needs one, their
calibration) arrived (asked again step after step for up to `GATE_WAIT_S` seconds from the
first request's arrival), nor for a resumed preempted request or one vLLM must prefill itself
(`compat.view`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvblend.blend.config import BlendConfig
from kvblend.documents.library import DocumentLibrary
from kvblend.prompt.plan import PrefillPlan, TokenKind
from kvblend.vllm import compat
from kvblend.vllm.admission import Admission, Decision
from kvblend.vllm.fallbacks import NO_DOCUMENT, RequestFallback
from kvblend.vllm.request_plan import RequestPlan, plan_request
from kvblend.vllm.requests import BlendRequest, RequestStatus, StepMetadata, WorkerReport
from kvblend.vllm.scheduling.request_records import Counts, RequestLog, planned_record
from kvblend.vllm.settings import ConnectorSettings, RequestChoice, request_config

logger = logging.getLogger("kvblend.vllm")

__all__ = ["GATE_WAIT_S", "SchedulerSide"]

#: How long requests wait for the workers' parity verdict before vLLM prefills them itself.
GATE_WAIT_S = 180.0

Status = RequestStatus


class SchedulerSide:
    """Plans requests, asks the admission policy, tells the workers what to blend."""

    def __init__(
        self,
        settings: ConnectorSettings,
        library: DocumentLibrary,
        admission: Admission,
        *,
        block_size: int = 16,
        store_summary: Any = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.library = library
        self.admission = admission
        self.block_size = block_size
        self.store_summary = store_summary
        self.clock = clock
        #: Every request the side was asked about and has not forgotten yet.
        self.requests: dict[str, BlendRequest] = {}
        self.gate: tuple[bool, str] | None = None if settings.parity else (True, "gate off")
        #: when a request first waited for the workers' verdict (which comes with a step's
        #: output: no step runs before the first request, however long the server idles)
        self._waiting_since: float | None = None
        self.log = RequestLog(settings.log_requests)
        self.counts = Counts()

    @property
    def ready(self) -> bool:
        """Whether the workers' verdict (and, if it passed, what the policy needs) arrived."""
        if self.gate is None:
            return False
        return not self.gate[0] or self.admission.ready

    # ------------------------------------------------------------------ vLLM's hooks
    def matched(self, request: Any, num_computed: int) -> tuple[int | None, bool]:
        """``get_num_new_matched_tokens``: tokens provided after vLLM's own ``num_computed``.

        A positive answer is an asynchronous load: the request waits while the workers blend.
        """
        if not self.ready:
            now = self.clock()
            self._waiting_since = self._waiting_since or now
            if now - self._waiting_since < GATE_WAIT_S:
                return None, False  # asked again next step, once the workers have reported
        if self.gate is None:
            self._set_gate((False, f"no parity verdict from the workers in {GATE_WAIT_S:g} s"))
        blend = self._planned(compat.view(request), num_computed)
        if blend.decision.blend and blend.status in (Status.PLANNED, Status.CLAIMED):
            if blend.status is Status.PLANNED:
                blend.move(Status.CLAIMED)
            plan = blend.plan
            if blend.salt is None and plan.approximate_from < plan.total:
                blend.salt = compat.salt_hashes(request, plan.approximate_from // self.block_size)
            return plan.claimed, True
        if blend.salt is not None:  # vLLM prefills it after all: its own hashes back
            compat.unsalt_hashes(request, blend.salt)
            blend.salt = None
        return 0, False

    def _planned(self, view: compat.RequestView, start: int) -> BlendRequest:
        """Return the request's `BlendRequest`, planned from ``start`` (memoized)."""
        known = self.requests.get(view.request_id)
        if known is not None and known.record is not None:  # allocated: never claimed again
            if view.preemptions:  # resumed after a preemption: its first record kept
                known.record["preemptions"] = view.preemptions
                self.log.warn(
                    "preempted",
                    "kvblend: a preempted request resumes: vLLM "
                    "computes what its prefix cache no longer holds",
                )
            return known
        if known is not None and known.start == start and view.excluded is None:
            return known
        began = time.perf_counter()
        plan, decision = self._plan(view, start)
        plan.plan_s = time.perf_counter() - began
        blend = BlendRequest(view.request_id, plan, decision)
        if known is not None:  # planned again from another prefix hit: hashes as they are
            blend.salt = known.salt
        self.requests[view.request_id] = blend
        return blend

    def _plan(self, view: compat.RequestView, start: int) -> tuple[RequestPlan, Decision]:
        """Plan a request and decide on it; a plan it cannot have says why vLLM prefills it."""
        choice, reason, refused = self._choice(view)
        decision, plan = Decision(False, reason), None
        if choice is not None and choice.config is not None and reason is None:
            decision = self._screened(view, start, choice)
            if decision.reason is None:
                plan, decision = self._decided(view, start, choice)
        plan = plan or _no_plan(view.prompt_token_ids, start, decision)
        plan.refused = refused
        return plan, decision

    def _choice(
        self, view: compat.RequestView
    ) -> tuple[RequestChoice | None, RequestFallback | None, bool]:
        """Return the request's choice, why vLLM must prefill it (or None), and if refused."""
        reason = view.excluded
        if self.gate is not None and not self.gate[0]:
            reason = RequestFallback("parity_gate_failed", "the parity gate failed")
        try:
            choice = request_config(
                self.settings.config, view.kv_transfer_params, self.settings.when
            )
        except (TypeError, ValueError) as error:
            reason = reason or RequestFallback("refused", f"request option refused: {error}")
            logger.warning("kvblend: request %s: %s", view.request_id, reason)
            return None, reason, True
        if reason is None and choice.config is None:
            reason = RequestFallback("kvblend_off", "kvblend off for this request")
        return choice, reason, False

    def _screened(self, view: compat.RequestView, start: int, choice: RequestChoice) -> Decision:
        """Return the policy's decision before planning (no blend can win), else to plan."""
        screened = self.admission.screen(len(view.prompt_token_ids), start, choice.when)
        return screened if screened is not None else Decision(True)

    def _decided(
        self, view: compat.RequestView, start: int, choice: RequestChoice
    ) -> tuple[RequestPlan | None, Decision]:
        """Plan the request; the strategy's rules, then the policy, decide on the plan."""
        assert choice.config is not None
        try:
            plan = plan_request(self.library, view.prompt_token_ids, start, choice.config)
        except Exception as error:  # noqa: BLE001 - a failed plan is vLLM's own prefill
            words = f"planning failed: {type(error).__name__}: {error}"
            return None, Decision(False, RequestFallback("planning_failed", words))
        if plan.why == NO_DOCUMENT and self.store_summary is not None:
            plan.why = self.store_summary.no_document_reason()
        if plan.why is not None:
            return plan, Decision(False, plan.why)
        decision = self.admission.decide(plan, choice.when)
        plan.why, plan.forecast = decision.reason, decision.forecast
        return plan, decision

    def allocated(self, request: Any, blocks: Any, num_external: int) -> None:
        """``update_state_after_alloc``: the request's record; a claimed one's job goes out.

        Called again once its KV has arrived (with nothing external): nothing to do then.
        """
        blend = self.requests.get(request.request_id)
        if blend is None or blend.allocated:
            return
        plan = blend.plan
        blend.store, plan.missing = plan.missing, []  # to the workers with the next step
        if blend.status is Status.CLAIMED and num_external <= 0:  # vLLM took none of them
            plan.why = RequestFallback(
                "unclaimed", "unclaimed: vLLM allocated none of the tokens the connector claimed"
            )
            blend.move(Status.PLANNED)
            if blend.salt is not None:
                compat.unsalt_hashes(request, blend.salt)
        if blend.status is Status.CLAIMED:
            block_ids = list(blocks.get_block_ids()[0])
            blend.send(block_ids, min(plan.start + num_external, plan.stop))
            blend.stats = compat.prefill_stats(request)
            compat.report_cached(blend.stats, plan.reused)
        blend.record = planned_record(plan)
        self.log.planned(blend.request_id, plan, blend.record)

    def metadata(self, scheduler_output: Any) -> StepMetadata:
        """``build_connector_meta``: the blends to queue, those to stop, the step's work."""
        meta = StepMetadata(step=compat.scheduled_rows(scheduler_output))
        for blend in self.requests.values():
            meta.store += blend.store
            blend.store = []
            if blend.status is Status.SENT:
                assert blend.job is not None
                meta.jobs.append(blend.job)
                blend.move(Status.BLENDING)
            elif blend.status is Status.CANCELLED and not blend.stop_sent:
                meta.stop.append(blend.request_id)
                blend.stop_sent = True
        return meta

    def worker_output(self, report: WorkerReport | None) -> None:
        """``update_connector_output``: take the verdict, the observations and the outcomes."""
        if report is None:
            return
        if report.verdict is not None and self.gate is None:
            self._set_gate(report.verdict)
        for observation in report.observations():
            self.admission.observe(observation)
        for outcome in report.outcomes:
            blend = self.requests.get(outcome.request_id)
            if blend is None or blend.record is None:
                continue
            blend.complete(outcome)
            self.log.blended(blend.record, outcome)
            compat.report_cached(blend.stats, int(blend.record["cached_tokens"]))
            if blend.status is Status.CANCELLED:  # it finished while it blended
                self._forget(blend)

    def _set_gate(self, verdict: tuple[bool, str]) -> None:
        self.gate = verdict
        if verdict[0]:
            logger.info("kvblend: %s", verdict[1])
        else:
            logger.error("kvblend: %s; vLLM prefills every request itself", verdict[1])

    def finished(self, request: Any) -> dict[str, Any] | None:
        """``request_finished``: its record goes into its output; it is forgotten.

        A request cancelled while its blend runs: the workers are told to stop it (vLLM keeps
        its blocks until they report it done); it is forgotten once its outcome arrives, which
        completes the record its output holds.
        """
        blend = self.requests.get(request.request_id)
        if blend is None:
            return None
        record = blend.record
        if blend.status is Status.BLENDING:
            blend.move(Status.CANCELLED)
        else:
            self._forget(blend)
        return None if record is None else {"kvblend": record}

    def _forget(self, blend: BlendRequest) -> None:
        blend.move(Status.FINISHED)
        del self.requests[blend.request_id]
        if blend.record is not None:
            self.counts.add(blend.record)

    def take_counts(self) -> dict[str, Any]:
        """Return the counts of the requests finished since the last call (`Counts`)."""
        return self.counts.take()


def _no_plan(token_ids: list[int], start: int, decision: Decision) -> RequestPlan:
    """Return the plan of a request vLLM prefills itself, saying why."""
    ids = np.asarray(token_ids, dtype=np.int64)
    plan = PrefillPlan(ids, np.full(ids.size, TokenKind.COMPUTE, dtype=np.int8))
    return RequestPlan(
        plan,
        BlendConfig("full"),
        start,
        max(start, len(ids) - 1),
        why=decision.reason or RequestFallback("other", ""),
        approximate_from=len(ids),
        forecast=decision.forecast,
    )
