"""What a prefill returns: the logits, the fused KV cache and the statistics of what it did.

`count_tokens` fills a prefill's token and document counts from its plan and its blend's
records; `escalation` what the guard did; `record_device_times` the device's timings. The
blend's records (`PassCounts`, `RowsRead`, `Lost`, `GuardReport`, `DeviceTimes`) become the
public stats' numbers and lines here, and nowhere else.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvblend.blend.forecast import BlendForecast, Lost, documents
from kvblend.blend.selectors import Fallback
from kvblend.blend.types import COMPUTE, MOVED, PREFIX, BlendOutput

if TYPE_CHECKING:
    from kvblend.blend.guard import GuardReport
    from kvblend.blend.prefill import DeviceTimes
    from kvblend.prompt.plan import PrefillPlan

__all__ = ["BlendStats", "PrefillResult", "count_tokens", "escalation", "record_device_times"]


@dataclass
class BlendStats:
    """What a prefill did: token counts by origin and where the time went."""

    strategy: str
    prompt_tokens: int = 0
    reused_tokens: int = 0  # tokens whose KV came from a cache (prefix + moved - recomputed)
    prefix_tokens: int = 0
    moved_tokens: int = 0  # cached tokens placed at a new position
    recomputed_tokens: int = 0  # moved tokens recomputed through the last layer
    computed_tokens: int = 0  # uncached tokens, computed in full
    segments_cached: int = 0  # store entries read (documents and prefix)
    segments_precomputed: int = 0  # cache misses computed during this prefill
    documents_found: int = 0  # cached document segments in the prompt
    documents_reused: int = 0  # of those, how many had tokens read from their cache
    compute_fraction: float = 0.0  # token-layers computed / token-layers of a full prefill
    #: Calls that ran uncompiled because dynamo refused another compile (its recompile limit;
    #: logged once per process): FlexAttention by query chunks, a compiled loop's step eagerly.
    uncompiled_calls: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    #: The strategy that ran: ``strategy``, or ``"full"`` when every moved token was recomputed
    #: instead (the prompt head is still reused in place, which full prefill equals exactly).
    strategy_run: str = ""
    #: Why the blend did not run as asked (``"full_above: blend would cost 0.86 of full
    #: prefill (limit 0.8)"``, ``"min_recompute: ..."``, ``"short_document: ..."``); None when
    #: it did.
    fallback: str | None = None
    #: The rule that made the blend run as full prefill, the name ``fallback`` starts with
    #: (``"full_above"``, ``"min_recompute"``, ``"guard"``, ``"no_documents"``...; a strategy
    #: that gives its reason in words only: its own name), for a program to compare; None when
    #: it did not.
    fallback_cause: str | None = None
    #: The blend's estimated cost as a share of a full prefill's (what ``full_above`` is
    #: compared with; 0 for strategies without that rule).
    estimated_cost: float = 0.0
    #: One line per document found in the prompt but not reused, saying why.
    documents_lost: list[str] = field(default_factory=list)
    #: A known document that nearly occurs in the prompt (its start is there, its whole text
    #: is not: truncated or rewritten), described in one line; None when there is none.
    near_miss: str | None = None
    #: What the blend's guard saw and did (`kvblend.blend.guard.GuardReport` as a dict:
    #: ``escalated``, ``reason``, ``risk``, ``tolerance``, ``signals``); None when no guard ran
    #: (guard off, another strategy, or a prompt computed in full anyway).
    guard: dict[str, Any] | None = None

    @property
    def escalated(self) -> bool:
        """Whether the guard computed the prompt in full after blending it."""
        return bool(self.guard and self.guard.get("escalated"))

    @property
    def recompute_fraction(self) -> float:
        """Recomputed share of the moved tokens."""
        return self.recomputed_tokens / self.moved_tokens if self.moved_tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        """Every field as plain JSON-ready values (for result metadata)."""
        return asdict(self)


@dataclass
class PrefillResult:
    """Next-token logits after the prompt, the prompt's token ids and the fused KV cache."""

    logits: torch.Tensor  # [vocab] float32
    token_ids: list[int]
    stats: BlendStats
    keys: list[torch.Tensor] = field(repr=False)  # per layer [kv_heads, tokens, head_dim], rotated
    values: list[torch.Tensor] = field(repr=False)


def count_tokens(
    stats: BlendStats,
    plan: PrefillPlan,
    kinds: np.ndarray,
    blend: BlendOutput,
    layers: int,
    reads_cache: bool,
) -> None:
    """Fill the token and document counts of ``stats`` from the plan and the blend's records.

    ``kinds``: each token's kind as the blend ran it; ``layers``: the model's.
    """
    documents = [row for row in plan.report if row.role == "document"]
    stats.documents_found = len(documents)
    stats.prompt_tokens = len(plan.token_ids)
    if not reads_cache:  # found, but nothing is read from the store
        stats.computed_tokens = len(plan.token_ids)
    else:
        stats.prefix_tokens = int((kinds == PREFIX).sum())
        stats.moved_tokens = int((kinds == MOVED).sum())
        stats.recomputed_tokens = blend.read.recomputed_tokens
        stats.computed_tokens = int((kinds == COMPUTE).sum())
        stats.reused_tokens = stats.prefix_tokens + stats.moved_tokens - stats.recomputed_tokens
        # documents read in place, and moved ones the blend did not recompute whole
        in_place = sum(1 for row in documents if row.reused and row.exact)
        reused = sum(1 for row in documents if row.reused)
        stats.documents_reused = min(reused, in_place + blend.read.moved_spans_read)
    stats.compute_fraction = blend.counts.token_layers / (len(plan.token_ids) * layers)


def record_device_times(stats: BlendStats, times: DeviceTimes | None) -> None:
    """Put a blend's device seconds into ``stats.timings`` (nothing off CUDA).

    ``blend_device_s``: the compute stream's; ``load_device_s``: the copy stream's, when timed.
    """
    if times is None:
        return
    stats.timings["blend_device_s"] = times.blend_s
    if times.load_s is not None:
        stats.timings["load_device_s"] = times.load_s


def escalation(
    stats: BlendStats, plan: PrefillPlan, forecast: BlendForecast, guard: GuardReport | None
) -> list[Lost]:
    """Record the guard's report in ``stats``; return the documents lost.

    An escalated blend ran as full prefill too: then ``strategy_run`` is ``"full"``,
    ``fallback`` says why (``"guard: ..."``, ``fallback_cause`` ``"guard"``) and every moved
    document is lost, recomputed whole; otherwise the forecast's documents and cause stand.
    """
    stats.guard = guard.to_dict() if guard is not None else None
    if guard is None or not guard.escalated:
        return list(forecast.lost)
    escalated = Fallback("guard", str(guard.reason))
    stats.strategy_run, stats.fallback_cause = "full", escalated.rule
    stats.fallback = str(escalated)
    lost = {item.document: item for item in forecast.lost}
    for number, row in documents(plan):
        span = plan.spans[row.span] if row.span is not None else None
        if row.reused and span is not None and span.kind == MOVED:
            lost[number] = Lost("guard", number, recomputed=True)
    return [lost[number] for number in sorted(lost, key=lambda number: number or 0)]
