"""One `BlendRequest` per request the connector sees, and the messages its two sides exchange.

The scheduler side keeps one map of `BlendRequest` objects, one per request it was asked about,
each moving through an explicit lifecycle (`RequestStatus`, as vLLM's ``Request`` moves through
its ``RequestStatus``):

    PLANNED ----------------------------------------------------------------+
       | a blend is chosen: the connector claims its tokens                 |
    CLAIMED --(blocks allocated)--> SENT --(in a step's metadata)--> BLENDING
                                                                     |      |
                                          outcome: DONE or FAILED <--+      |
                         finished while it blends: CANCELLED (outcome next) |
                                                                            v
                                                           FINISHED (forgotten)

A request vLLM prefills itself stays PLANNED until it finishes. Each step the scheduler side
sends the workers one `StepMetadata` (as vLLM's example connector sends a list of ``ReqMeta``):
the `BlendJob` of every request SENT, the requests whose blend must stop, the documents to
store and the step's work (for the cost model). The workers answer with a `WorkerReport`: the
parity verdict and calibration once, every finished blend's `BlendOutcome` and the forwards
they timed; `WorkerReport.observations` is what the admission policy learns from.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from kvblend.blend.config import BlendConfig
from kvblend.prompt.plan import PrefillPlan
from kvblend.vllm.admission import BlendTimed, Calibrated, Decision, Observation, StepTimed
from kvblend.vllm.request_plan import RequestPlan

__all__ = [
    "BlendJob",
    "BlendOutcome",
    "BlendRequest",
    "RequestStatus",
    "StepMetadata",
    "WorkerReport",
]


class RequestStatus(enum.Enum):
    """Where a request stands with the connector."""

    PLANNED = "planned"  # planned and decided; vLLM prefills it unless it is claimed
    CLAIMED = "claimed"  # the connector answered with its tokens (an asynchronous load)
    SENT = "sent"  # blocks allocated: its job goes to the workers with the next step
    BLENDING = "blending"  # its job went out: the workers blend it between steps
    DONE = "done"  # its KV is written; vLLM computes the last prompt token
    FAILED = "failed"  # nothing written: a failed load, vLLM computes the claimed tokens
    CANCELLED = "cancelled"  # finished while it blends: stopped at its next checkpoint
    FINISHED = "finished"  # vLLM finished it; its record went into its output


_NEXT = {
    RequestStatus.PLANNED: {RequestStatus.CLAIMED, RequestStatus.FINISHED},
    RequestStatus.CLAIMED: {RequestStatus.SENT, RequestStatus.PLANNED, RequestStatus.FINISHED},
    RequestStatus.SENT: {RequestStatus.BLENDING, RequestStatus.FINISHED},
    RequestStatus.BLENDING: {RequestStatus.DONE, RequestStatus.FAILED, RequestStatus.CANCELLED},
    RequestStatus.DONE: {RequestStatus.FINISHED},
    RequestStatus.FAILED: {RequestStatus.FINISHED},
    RequestStatus.CANCELLED: {RequestStatus.FINISHED},
    RequestStatus.FINISHED: set(),
}


@dataclass
class BlendJob:
    """One claimed request, for the workers: its plan and where its KV goes.

    Rows ``[start, stop)`` are written into ``block_ids`` (vLLM's prefix-cache hit is below
    ``start``; vLLM computes the rows from ``stop`` on).
    """

    request_id: str
    plan: PrefillPlan
    config: BlendConfig
    start: int
    stop: int
    block_ids: list[int]


@dataclass
class StepMetadata:
    """What one step's workers do (vLLM's connector metadata).

    ``jobs``: blends to queue; ``stop``: requests whose blend stops; ``store``: documents
    (text, context) to compute and store; ``step``: ``(tokens, prefix)`` of each request the
    step's forward computes (the workers time it for the cost model).
    """

    jobs: list[BlendJob] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    store: list[tuple[str, str]] = field(default_factory=list)
    step: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class BlendOutcome:
    """What the workers did with one job (sent back to the scheduler side)."""

    request_id: str
    reused: int = 0  # rows read from the store and not recomputed
    recomputed: int = 0
    escalated: int = 0  # rows a quality guard had recomputed in full (none yet)
    lost: list[str] = field(default_factory=list)  # entries that could not be used, and why
    error: str | None = None  # why the blend ran as ``full`` (or failed)
    failed: bool = False  # nothing written: reported as a failed load
    cancelled: bool = False  # the request was cancelled while its blend was under way
    blend_s: float = 0.0  # from the job's arrival to its end (slices and the steps between)
    compute_s: float = 0.0  # the blend's own time (its slices only)
    rows: int = 0  # rows computed, summed over the passes (the cost model's input)
    total: int = 0  # prompt tokens
    #: where the time went: reading entries, the blend loop (its probe pass apart), writing KV
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def worse(self) -> tuple[bool, bool, int]:
        """How badly it went: failed, fell back, entries lost (ranks keep the worst)."""
        return self.failed, self.error is not None, len(self.lost)


@dataclass
class WorkerReport:
    """What the workers report (vLLM's connector worker metadata, aggregated over ranks)."""

    verdict: tuple[bool, str] | None = None  # the parity gate's, once
    outcomes: list[BlendOutcome] = field(default_factory=list)
    calibration: Calibrated | None = None  # once, when the gate passed
    steps: list[StepTimed] = field(default_factory=list)

    def aggregate(self, other: WorkerReport) -> WorkerReport:
        """Combine two ranks' reports: a gate passes when it passed on every rank.

        Tensor-parallel ranks each report every blended request: one outcome per request is
        kept, the worse; rank 0's timings.
        """
        verdict = self.verdict or other.verdict
        if self.verdict and other.verdict and not other.verdict[0]:
            verdict = other.verdict
        outcomes: dict[str, BlendOutcome] = {}
        for outcome in self.outcomes + other.outcomes:
            kept = outcomes.get(outcome.request_id)
            if kept is None or outcome.worse > kept.worse:
                outcomes[outcome.request_id] = outcome
        calibration = self.calibration or other.calibration
        return WorkerReport(verdict, list(outcomes.values()), calibration, self.steps)

    def observations(self) -> list[Observation]:
        """Return what the admission policy learns from: calibration, forwards, blends' time.

        A blend is observed by its own slices, not the steps between them nor its wait behind
        other blends (a burst of blends must not make the next one look slow).
        """
        seen: list[Observation] = [] if self.calibration is None else [self.calibration]
        seen += self.steps
        seen += [
            BlendTimed(outcome.rows, outcome.total, outcome.compute_s)
            for outcome in self.outcomes
            if outcome.rows and outcome.compute_s > 0 and not outcome.cancelled
        ]
        return seen


@dataclass(eq=False)
class BlendRequest:
    """The connector's state of one vLLM request, from its plan to its end (`RequestStatus`).

    ``record`` is what its output reports (``kv_transfer_params["kvblend"]``), made when vLLM
    allocates it; ``stats`` vLLM's prefill stats of it (what its usage reports), kept from
    then on; ``salt`` the handle that gives back its own block hashes (`compat.salt_hashes`);
    ``store`` its documents found but not stored yet, until they go to the workers.
    """

    request_id: str
    plan: RequestPlan
    decision: Decision
    status: RequestStatus = RequestStatus.PLANNED
    job: BlendJob | None = None
    outcome: BlendOutcome | None = None
    record: dict[str, Any] | None = None
    stats: Any = None
    salt: Any = None
    store: list[tuple[str, str]] = field(default_factory=list)
    stop_sent: bool = False  # the workers were told to stop its blend

    @property
    def start(self) -> int:
        """Return vLLM's prefix-cache hit the request was planned from."""
        return self.plan.start

    @property
    def allocated(self) -> bool:
        """Whether vLLM allocated it (its record exists)."""
        return self.record is not None

    def move(self, status: RequestStatus) -> None:
        """Move to ``status`` (ValueError: not a step of the lifecycle)."""
        if status not in _NEXT[self.status]:
            raise ValueError(
                f"request {self.request_id}: {self.status.value} cannot become {status.value}"
            )
        self.status = status

    def send(self, block_ids: list[int], stop: int) -> None:
        """Allocated: its job (rows up to ``stop`` into ``block_ids``) goes out next step."""
        plan = self.plan
        self.job = BlendJob(self.request_id, plan.plan, plan.config, plan.start, stop, block_ids)
        self.move(RequestStatus.SENT)

    def complete(self, outcome: BlendOutcome) -> None:
        """Take the workers' outcome (a request cancelled meanwhile stays cancelled)."""
        self.outcome = outcome
        if self.status is RequestStatus.BLENDING:
            self.move(RequestStatus.FAILED if outcome.failed else RequestStatus.DONE)
