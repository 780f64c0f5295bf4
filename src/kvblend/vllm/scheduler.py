"""The connector's scheduler side: which prompt tokens kvblend provides, request by request.

vLLM asks ``get_num_new_matched_tokens(request, num_computed)`` for each waiting request, with
its own prefix-cache hit (``num_computed``). The connector plans the request (`planning`), then
forecasts two times on this machine (`costs.CostModel`): the blend's, and vLLM's own prefill of
the tokens after its hit. When the blend is forecast faster it answers "all but the last prompt
token, loaded asynchronously": the request waits (vLLM's ``WAITING_FOR_REMOTE_KVS``) while every
other request keeps stepping, the worker side blends it a slice at a time between steps
(`pacing`) and reports it done (``get_finished``); vLLM then computes the last prompt token over
the blended cache. Otherwise it answers 0 and vLLM prefills the prompt itself. The choice, both
forecasts and the reason go into the request's record (``kv_transfer_params["kvblend"]``), the
log line of the request and vLLM's metrics.

Exact stays exact: blocks holding blended KV that may differ from a full prefill's (from the
first moved document's block on, `planning.approximate_from`) get their prefix-cache hashes
salted for the request that wrote them, so no later request finds them in vLLM's prefix cache;
the blocks before (the prompt head, documents reused in place) keep vLLM's own hashes and stay
shared. A request that computes in full (vLLM's prefill, a fallback, kvblend off) therefore only
ever reads KV that a full prefill computes.

What a response reports: vLLM's ``num_cached_tokens`` (``usage.prompt_tokens_details.
cached_tokens`` through the OpenAI server) counts the tokens a request did not compute. For a
blended request the connector sets it to its own count, the tokens nobody computed: vLLM's
prefix hit plus the rows read from the store and not recomputed.

Nothing is claimed before the worker's parity gate has passed and its calibration arrived (the
scheduler asks again, step after step, for up to `GATE_WAIT_S` seconds), nor for a resumed
preempted request, a request asking for prompt logprobs, LoRA or multimodal inputs.

Cancelled requests: a request cancelled while its blend is under way keeps its blocks (vLLM
frees a request waiting for its KV only once the worker reports it done); the worker stops the
blend at its next checkpoint and reports it, and the record is completed then.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvblend.documents.library import DocumentLibrary
from kvblend.engine.explain import FallbackLog
from kvblend.vllm.costs import CostModel, Forecast, blend_features
from kvblend.vllm.planning import NO_DOCUMENT, RequestPlan, plan_request
from kvblend.vllm.settings import ConnectorSettings, request_config
from kvblend.vllm.worker import BlendJob, BlendOutcome

logger = logging.getLogger("kvblend.vllm")

__all__ = ["COUNTS", "GATE_WAIT_S", "KVBlendMetadata", "KVBlendWorkerMeta", "SchedulerSide"]

#: What the scheduler side counts over finished requests (vLLM's metrics: `metrics.py`):
#: requests planned, then each once as blended, prefilled by vLLM itself, or refused (a request
#: option; vLLM prefills it too), their prompt tokens, the tokens nobody computed (the usage's
#: ``cached_tokens``), the recomputed tokens, and both forecasts (milliseconds) summed over the
#: requests that had both.
COUNTS = (
    "requests", "blended", "vllm", "refused", "prompt_tokens", "cached_tokens",
    "recomputed_tokens", "forecast_blend_ms", "forecast_vllm_ms",
)  # fmt: skip

#: How long requests wait for the workers' parity verdict before vLLM prefills them itself.
GATE_WAIT_S = 180.0


@dataclass
class KVBlendMetadata:
    """What one step's worker side does.

    ``jobs``: blends to queue; ``cancel``: requests whose blend stops; ``fill``: documents to
    store; ``step``: the step's ``(tokens, prefix)`` per scheduled request (the forward the
    worker times for the cost model).
    """

    jobs: list[BlendJob] = field(default_factory=list)
    fill: list[tuple[str, str]] = field(default_factory=list)
    cancel: list[str] = field(default_factory=list)
    step: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class KVBlendWorkerMeta:
    """What the workers report.

    The parity verdict and the start-up calibration (once), each finished blend's outcome, and
    the forward times of the steps since the last report (`costs`).
    """

    verdict: tuple[bool, str] | None = None
    outcomes: list[BlendOutcome] = field(default_factory=list)
    calibration: dict[str, list[tuple[list[float], float]]] | None = None
    steps: list[tuple[list[float], float]] = field(default_factory=list)

    def merge(self, other: KVBlendWorkerMeta) -> KVBlendWorkerMeta:
        """Combine two workers' reports: a gate passes when it passed on every rank.

        Tensor-parallel ranks each report every blended request: one outcome per request is
        kept, a failed one (or one that fell back) over one that did not; rank 0's timings.
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
        calibration = self.calibration or other.calibration
        return KVBlendWorkerMeta(verdict, list(outcomes.values()), calibration, self.steps)


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


def _salted(block_hash: Any, salt: bytes) -> Any:
    """``block_hash`` salted: a hash no full prefill's block of the same tokens has."""
    digest = hashlib.sha256(b"kvblend-blended|" + salt + b"|" + bytes(block_hash)).digest()
    return type(block_hash)(digest) if isinstance(block_hash, bytes) else digest


class SchedulerSide:
    """Plans requests, chooses blend or vLLM's prefill, tells the worker side what to blend."""

    def __init__(
        self,
        settings: ConnectorSettings,
        library: DocumentLibrary,
        *,
        block_size: int = 16,
        store_summary: Any = None,
    ) -> None:
        self.settings = settings
        self.library = library
        self.block_size = block_size
        self.store_summary = store_summary
        self.costs = CostModel()
        self.gate: tuple[bool, str] | None = None if settings.parity else (True, "gate off")
        self._gate_since = time.monotonic()
        self._plans: dict[str, tuple[int, RequestPlan]] = {}  # request -> (start, plan)
        self._outgoing: list[BlendJob] = []  # allocated, not yet sent to the workers
        self._fill: list[tuple[str, str]] = []
        self._cancel: list[str] = []
        self._records: dict[str, dict[str, Any]] = {}
        #: the prefill stats vLLM reports a claimed request's cached tokens from, kept until
        #: the worker's outcome sets them to what the blend really reused
        self._stats: dict[str, Any] = {}
        self._pending: set[str] = set()  # jobs sent to the workers, outcome not back yet
        #: records of requests that finished before their blend's outcome came back (cancelled
        #: while blending): the outcome completes them
        self._done: dict[str, dict[str, Any]] = {}
        #: requests whose block hashes are salted, with their own hashes and hasher (restored if
        #: vLLM prefills the request after all)
        self._salted: dict[str, tuple[list[Any], Any]] = {}
        self._fallbacks = FallbackLog(logger)
        self._counts = dict.fromkeys(COUNTS, 0)

    @property
    def ready(self) -> bool:
        """Whether the workers' verdict (and, if it passed, their calibration) has arrived."""
        if self.gate is None:
            return False
        return not self.gate[0] or self.costs.calibrated or self.settings.when == "always"

    # ------------------------------------------------------------------ vLLM's hooks
    def matched(self, request: Any, num_computed: int) -> tuple[int | None, bool]:
        """``get_num_new_matched_tokens``: tokens provided after vLLM's own ``num_computed``.

        A positive answer is an asynchronous load: the request waits while the worker blends.
        """
        if not self.ready and time.monotonic() - self._gate_since < GATE_WAIT_S:
            return None, False  # asked again next step, once the workers have reported
        if self.gate is None:
            self._set_gate((False, f"no parity verdict from the workers in {GATE_WAIT_S:g} s"))
        plan = self._plan(request, num_computed)
        if plan.claimed:
            self._salt(request, plan)
            return plan.claimed, True
        self._unsalt(request)
        return 0, False

    def _plan(self, request: Any, start: int) -> RequestPlan:
        """Plan ``request`` from ``start`` on (memoized: vLLM may ask again before scheduling)."""
        request_id = request.request_id
        assert self.gate is not None
        reason = None if self.gate[0] else "the parity gate failed"
        reason = reason or _excluded(request)  # first: a resumed request was planned before
        known = self._plans.get(request_id)
        if reason is None and known is not None and known[0] == start:
            return known[1]
        began = time.perf_counter()
        plan, refused, when = None, False, self.settings.when
        bound: Forecast | None = None
        try:
            choice = request_config(
                self.settings.config, getattr(request, "kv_transfer_params", None), when
            )
        except (TypeError, ValueError) as error:
            refused, choice = True, None
            reason = reason or f"request option refused: {error}"
            logger.warning("kvblend: request %s: %s", request_id, reason)
        try:
            if choice is not None and choice.config is None:
                reason = reason or "kvblend off for this request"
            if reason is None and choice is not None and choice.config is not None:
                when = choice.when
                bound = self._bound(request, start, when)
                if bound is not None:
                    reason = (
                        f"vllm_faster: vLLM's prefill is forecast at {bound.vllm_s:.2f} s, any "
                        f"blend at {bound.blend_s:.2f} s or more (not planned)"
                    )
                else:
                    plan = plan_request(
                        self.library, list(request.prompt_token_ids), start, choice.config
                    )
        except Exception as error:  # noqa: BLE001 - a failed plan is vLLM's own prefill
            reason = f"planning failed: {type(error).__name__}: {error}"
            plan = None
        if plan is None:
            plan = _no_plan(request, start, reason)
            plan.forecast = bound
        plan.refused = refused
        if plan.fallback == NO_DOCUMENT and self.store_summary is not None:
            plan.fallback = self.store_summary.no_document_reason()
        if plan.fallback is None:
            self._choose(plan, when, request_id)
        plan.plan_s = time.perf_counter() - began
        self._plans[request_id] = (start, plan)
        return plan

    def _bound(self, request: Any, start: int, when: str) -> Forecast | None:
        """Return the forecasts of a prompt no blend can win (None: plan it).

        Planning decodes and tokenizes the whole prompt and finds its documents (a few
        milliseconds of the engine's scheduling step); a prompt whose uncached tail is short
        enough for vLLM's prefill to beat even a blend that computes no row skips it (vLLM's
        prefix cache holds most of it, a short prompt). Its documents not stored yet are not
        stored then: a later prompt that can blend finds them.
        """
        if when != "faster" or not self.costs.calibrated:
            return None
        total = len(getattr(request, "prompt_token_ids", None) or ())
        if total - 1 <= start:
            return None  # planning says why in a word
        bound = self.costs.bound(total, start)
        return None if bound.blend_wins else bound

    def _choose(self, plan: RequestPlan, when: str, request_id: str) -> None:
        """Blend ``plan`` only when forecast faster than vLLM's prefill (unless ``always``)."""
        if not self.costs.calibrated:
            return
        forecast = self.costs.forecast(plan.total, plan.start, plan.rows)
        plan.forecast = forecast
        if when != "faster":
            return
        if not forecast.blend_wins:
            plan.fallback = (
                f"vllm_faster: vLLM's prefill is forecast at {forecast.vllm_s:.2f} s, a blend "
                f"at {forecast.blend_s:.2f} s (a blend must be forecast under "
                f"{forecast.margin:g} of vLLM's)"
            )
        elif self.costs.check_vllm(forecast, idle=not self._in_flight(request_id)):
            plan.fallback = (
                f"vllm_check: vLLM's prefill has not been timed for a while and no other "
                f"request is in flight: it prefills this one (forecast {forecast.vllm_s:.2f} s, "
                f"a blend {forecast.blend_s:.2f} s)"
            )

    def _in_flight(self, request_id: str) -> bool:
        """Whether a request other than ``request_id`` is admitted and not finished, or blending."""
        others = set(self._records) | self._pending | {job.request_id for job in self._outgoing}
        return bool(others - {request_id})

    def _salt(self, request: Any, plan: RequestPlan) -> None:
        """Salt the hashes of the request's blocks from its first approximate row's block on.

        The blocks hashed already are salted here; vLLM's hasher of the request (which hashes
        each block as it fills, prompt and generated tokens alike) is wrapped so that those it
        hashes later from that block on are salted too, even when the first approximate row is
        in the prompt's last, partial block.
        """
        hashes = getattr(request, "block_hashes", None)
        if hashes is None or request.request_id in self._salted:
            return
        if plan.approximate_from >= plan.total:
            return  # every row exact: vLLM's own hashes
        first = plan.approximate_from // self.block_size
        self._salted[request.request_id] = (list(hashes), getattr(request, "_block_hasher", None))
        salt = request.request_id.encode()
        for index in range(first, len(hashes)):
            hashes[index] = _salted(hashes[index], salt)
        hasher = getattr(request, "_block_hasher", None)
        if hasher is not None:

            def salted_hasher(owner: Any) -> list[Any]:
                start = len(owner.block_hashes)
                new = hasher(owner)
                return [_salted(h, salt) if start + i >= first else h for i, h in enumerate(new)]

            request._block_hasher = salted_hasher

    def _unsalt(self, request: Any) -> None:
        """Give back the request's own block hashes (vLLM prefills it after all)."""
        own = self._salted.pop(request.request_id, None)
        hashes = getattr(request, "block_hashes", None)
        if own is not None and hashes is not None:
            hashes[: len(own[0])] = own[0]
            if own[1] is not None:
                request._block_hasher = own[1]

    def allocated(self, request: Any, blocks: Any, num_external: int) -> None:
        """``update_state_after_alloc``: queue the claimed request's blend for the workers.

        Called again once its KV has arrived (with nothing external): nothing to do then.
        """
        request_id = request.request_id
        known = self._plans.get(request_id)
        if known is None or request_id in self._pending:
            return
        if num_external <= 0 and request_id in self._records and not self._resumed(request):
            return  # its KV has arrived (or it was recorded when vLLM took it)
        if any(job.request_id == request_id for job in self._outgoing):
            return
        plan = known[1]
        self._fill.extend(plan.missing)
        plan.missing = []
        if self._resumed(request):
            return
        if num_external <= 0 or plan.fallback is not None:
            self._record(request_id, plan)
            return
        block_ids = list(blocks.get_block_ids()[0])
        stop = min(plan.start + num_external, plan.stop)
        self._outgoing.append(
            BlendJob(request_id, plan.plan, plan.config, plan.start, stop, block_ids)
        )
        self._record(request_id, plan)
        stats = getattr(request, "prefill_stats", None)
        if stats is not None and stats.num_prompt_tokens:
            self._stats[request_id] = stats
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
        if plan.forecast is not None:
            record.update(plan.forecast.as_record())
        if plan.refused:
            record["refused"] = True
        self._records[request_id] = record
        if plan.fallback is None:
            return
        cause = plan.fallback.split(":")[0]
        if cause in ("vllm_faster", "vllm_check"):
            if self.settings.log_requests:
                logger.info(
                    "kvblend: request %s: %d prompt tokens: vLLM prefills it (forecast %.2f s, "
                    "a blend %.2f s%s; decided in %.1f ms)", request_id, plan.total,
                    record["forecast_vllm_s"], record["forecast_blend_s"],
                    "; timing vLLM" if cause == "vllm_check" else "", 1000 * plan.plan_s,
                )  # fmt: skip
        elif not plan.refused:
            self._fallbacks.warn(cause, f"kvblend: vLLM prefills a request itself: {plan.fallback}")

    def metadata(self, scheduler_output: Any) -> KVBlendMetadata:
        """``build_connector_meta``: the blends to queue, the cancelled ones, the step's work."""
        meta = KVBlendMetadata(jobs=self._outgoing, fill=self._fill, cancel=self._cancel)
        self._outgoing, self._fill, self._cancel = [], [], []
        for job in meta.jobs:
            self._pending.add(job.request_id)
        meta.step = _step_rows(scheduler_output)
        return meta

    def worker_output(self, meta: KVBlendWorkerMeta | None) -> None:
        """``update_connector_output``: take the verdict, calibration, timings and outcomes."""
        if meta is None:
            return
        if meta.calibration is not None and not self.costs.calibrated:
            self._calibrate(meta.calibration)
        if meta.verdict is not None and self.gate is None:
            self._set_gate(meta.verdict)
        for features, seconds in meta.steps:
            self.costs.observe(self.costs.vllm, np.asarray(features), seconds)
        for outcome in meta.outcomes:
            self._outcome(outcome)

    def _calibrate(self, calibration: dict[str, list[tuple[list[float], float]]]) -> None:
        points = {
            name: [(np.asarray(x, dtype=float), float(y)) for x, y in calibration.get(name, [])]
            for name in ("vllm", "blend")
        }
        if not points["vllm"] or not points["blend"]:
            return
        self.costs.calibrate(points["vllm"], points["blend"])
        example = self.costs.forecast(4096, 0, 1100)
        measured = "; ".join(
            f"{name} " + ", ".join(f"{int(x[1])} rows {y:.2f} s" for x, y in points[name])
            for name in ("vllm", "blend")
        )
        logger.info(
            "kvblend: cost model calibrated on this machine (%s): a 4096-token prompt, vLLM's "
            "prefill %.2f s, a blend computing 1100 rows %.2f s",
            measured, example.vllm_s, example.blend_s,
        )  # fmt: skip

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
        if outcome.rows and outcome.compute_s > 0 and not outcome.cancelled:
            # its own slices: not the steps between them, nor its wait behind other blends
            # (forecasts compare the two paths' compute; a burst of blends must not make the
            # next one look slow)
            features = blend_features(outcome.rows, outcome.total)
            self.costs.observe(self.costs.blend, features, outcome.compute_s)
        stats = self._stats.pop(request_id, None)
        done = self._done.pop(request_id, None)
        record = done if done is not None else self._records.get(request_id)
        if record is None:
            return
        self._complete(record, outcome, stats)
        if done is not None:
            self._count(done)

    def _complete(self, record: dict[str, Any], outcome: BlendOutcome, stats: Any) -> None:
        record["blend_s"] = round(outcome.compute_s, 4)
        record["load_wall_s"] = round(outcome.blend_s, 4)
        record.update({name: round(value, 4) for name, value in outcome.timings.items()})
        if outcome.cancelled:
            record["cancelled"] = True
            return
        if outcome.lost or outcome.error is not None:
            # fewer rows reused than planned: the usage vLLM is about to send says so too
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
            forecast = ""
            if "forecast_blend_s" in record:
                forecast = (
                    f" (forecast {record['forecast_blend_s']:.2f} s, vLLM's prefill "
                    f"{record['forecast_vllm_s']:.2f} s)"
                )
            logger.info(
                "kvblend: request %s: %d prompt tokens: blended, %d cached (%d from vLLM's "
                "prefix cache), %d recomputed; blend %.2f s%s",
                outcome.request_id, record["prompt_tokens"], record["cached_tokens"],
                record["vllm_prefix_tokens"], record["recomputed_tokens"], outcome.compute_s,
                forecast,
            )  # fmt: skip

    def finished(self, request: Any) -> dict[str, Any] | None:
        """``request_finished``: forget the request; its record goes into its output.

        A request cancelled while its blend runs: the worker is told to stop it (vLLM keeps
        its blocks until the worker reports it done); the outcome completes the record.
        """
        request_id = request.request_id
        self._plans.pop(request_id, None)
        self._salted.pop(request_id, None)
        before = len(self._outgoing)
        self._outgoing = [job for job in self._outgoing if job.request_id != request_id]
        record = self._records.pop(request_id, None)
        if len(self._outgoing) < before:  # never sent: nothing to stop (cannot happen in vLLM)
            self._stats.pop(request_id, None)
        if request_id in self._pending:
            self._cancel.append(request_id)
        if record is None:
            return None
        if request_id in self._pending:  # completed by its outcome, later
            self._done[request_id] = record
        else:
            self._stats.pop(request_id, None)
            self._count(record)
        return {"kvblend": record}

    def tracked(self) -> set[str]:
        """Return the requests the scheduler side holds any state of (none once all finished)."""
        held = set(self._plans) | set(self._records) | set(self._stats) | set(self._salted)
        held |= {job.request_id for job in self._outgoing}
        return held | self._pending | set(self._done)

    def _count(self, record: dict[str, Any]) -> None:
        counts = self._counts
        counts["requests"] += 1
        outcome = "blended" if not record.get("fallback") else "vllm"
        counts["refused" if record.get("refused") else outcome] += 1
        for name in ("prompt_tokens", "cached_tokens", "recomputed_tokens"):
            counts[name] += int(record.get(name, 0))
        if "forecast_blend_s" in record:
            counts["forecast_blend_ms"] += round(1000 * record["forecast_blend_s"])
            counts["forecast_vllm_ms"] += round(1000 * record["forecast_vllm_s"])

    def take_counts(self) -> dict[str, int]:
        """Return the counts of the requests finished since the last call (`COUNTS`)."""
        counts, self._counts = self._counts, dict.fromkeys(COUNTS, 0)
        return counts


def _step_rows(scheduler_output: Any) -> list[tuple[int, int]]:
    """Return ``(tokens, prefix)`` of each request a step computes (for the cost model)."""
    scheduled: dict[str, int] = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
    if not scheduled:
        return []
    prefix: dict[str, int] = {}
    for new in getattr(scheduler_output, "scheduled_new_reqs", ()) or ():
        prefix[new.req_id] = int(new.num_computed_tokens)
    cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
    if cached is not None:
        for request_id, computed in zip(cached.req_ids, cached.num_computed_tokens, strict=False):
            prefix[request_id] = int(computed)
    return [(int(tokens), prefix.get(rid, 0)) for rid, tokens in scheduled.items()]


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
        plan, BlendConfig("full"), start, max(start, len(ids) - 1), fallback=reason or "",
        approximate_from=len(ids),
    )  # fmt: skip
