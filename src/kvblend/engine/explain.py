"""What a prefill will do with a prompt, and why: the forecast both `explain` and `prefill` use.

`forecast_blend` is a pure function of the prefill plan and the config: how many moved tokens
the strategy recomputes, whether it computes every one of them instead of blending (and why),
and which found documents end up not reused. `BlendEngine.prefill` reports it in its stats and
`BlendEngine.explain` prints it, so the two agree by construction; the attention strategy's
budget rule is `attention_budget`, which its selector runs too. `FallbackLog` warns of the
reasons a prefill gives for not reusing documents, each cause once a minute.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np

from kvblend.blend.config import BlendConfig
from kvblend.blend.selectors.attention import attention_budget
from kvblend.engine.results import BlendStats
from kvblend.prompt.plan import PrefillPlan, SpanReport, TokenKind
from kvblend.validation import snippet

__all__ = ["BlendForecast", "Explanation", "FallbackLog", "forecast_blend"]


@dataclass(frozen=True)
class BlendForecast:
    """What a prefill of one plan with one config does, decided before the model runs."""

    strategy_run: str  # the config's strategy, or "full" when every moved token is recomputed
    recomputed_tokens: int  # moved tokens recomputed at every layer
    fallback: str | None = None  # why the blend does not run as asked
    estimated_cost: float = 0.0  # attention: the budget rule's cost estimate (of full prefill)
    documents_lost: list[str] = field(default_factory=list)  # found, not reused: why


def _count(kinds: np.ndarray, kind: TokenKind) -> int:
    """How many of ``kinds`` are ``kind``."""
    return int(np.count_nonzero(kinds == kind))


def _moved_rows(plan: PrefillPlan, row: SpanReport) -> int:
    if row.span is None:
        return 0
    span = plan.spans[row.span]
    return _count(plan.kinds[span.start : span.end], TokenKind.MOVED)


def _lead_rows(config: BlendConfig) -> tuple[int, int]:
    """Leading rows of each moved document a strategy recomputes, and the 'short' length."""
    if config.strategy == "attention":
        return config.lead_tokens, config.short_document
    if config.strategy == "epic":
        return config.epic_tokens, 0
    return 0, 0


def _recomputed(
    plan: PrefillPlan, config: BlendConfig, moved: int
) -> tuple[int, float, str | None]:
    """Return the moved tokens recomputed, the cost estimate and the fallback reason."""
    if config.strategy == "attention":
        budget = attention_budget(plan.kinds, plan.spans, dict(config.settings))
        return (moved if budget.recompute_all else budget.recomputed), budget.cost, budget.fallback
    if config.strategy == "cacheblend":
        schedule = config.ratio_schedule or ((config.check_layer, config.recompute_ratio),)
        return min(moved, round(schedule[-1][1] * moved)), 0.0, None
    if config.strategy == "epic":
        lead, _ = _lead_rows(config)
        rows = sum(
            _count(plan.kinds[span.start : span.start + lead], TokenKind.MOVED)
            for span in plan.spans
            if span.kind == TokenKind.MOVED
        )
        return rows, 0.0, None
    return 0, 0.0, None  # reuse, and strategies this module does not know


#: `BlendStats.fallback` of a prompt without a cached document: nothing to blend.
NO_DOCUMENTS = "no_documents: the prompt holds no known document, so it is computed in full"


def forecast_blend(plan: PrefillPlan, config: BlendConfig) -> BlendForecast:
    """Forecast the prefill of ``plan`` with ``config`` (a pure function: no model runs)."""
    if not config.reads_cache:
        return BlendForecast(config.strategy, 0)
    if not any(row.role == "document" for row in plan.report):  # a prompt head at most
        return BlendForecast("full", 0, NO_DOCUMENTS, 1.0)
    moved = _count(plan.kinds, TokenKind.MOVED)
    recomputed, cost, fallback = _recomputed(plan, config, moved)
    lead, short = _lead_rows(config)
    lost = []
    for number, row in enumerate((row for row in plan.report if row.role == "document"), start=1):
        moved_rows = _moved_rows(plan, row)
        if not row.reused:
            lost.append(f"document {number}: {row.reason}")
        elif moved_rows and fallback is not None:
            lost.append(f"document {number}: recomputed whole ({fallback.split(':')[0]})")
        elif moved_rows and recomputed == moved:
            lost.append(f"document {number}: recomputed whole (every moved token is)")
        elif moved_rows and (moved_rows <= lead or row.reused <= short):
            lost.append(f"document {number}: recomputed whole ({row.reused} tokens, short)")
    strategy_run = "full" if fallback is not None else config.strategy
    return BlendForecast(strategy_run, recomputed, fallback, cost, lost)


class FallbackLog:
    """Warn once per cause and ``interval`` seconds (a busy server logs each cause once).

    `report` logs the reasons a prefill's stats give for not reusing the prompt's documents.
    """

    def __init__(self, logger: logging.Logger, interval: float = 60.0) -> None:
        self.logger = logger
        self.interval = interval
        self._last: dict[str, float] = {}

    def warn(self, cause: str, message: str, level: int = logging.WARNING) -> None:
        """Log ``message`` unless ``cause`` was logged less than ``interval`` seconds ago."""
        now = time.monotonic()
        if now - self._last.get(cause, -float("inf")) < self.interval:
            return
        self._last[cause] = now
        self.logger.log(level, "%s", message)

    def report(self, stats: BlendStats, known: int | None = None) -> None:
        """Log each reason a prompt's documents were not reused, once per cause a minute.

        A prompt without a known document (a greeting, a rephrasing step) is logged at INFO
        level, with the ``known`` documents that could have been found in it; one that holds
        the start of a known document, not its whole text, is a near miss (a warning).
        """
        if stats.fallback == NO_DOCUMENTS:
            self.warn(
                "no_documents", f"no known document in the prompt ({known} known): computed in "
                "full (stats.fallback); a document is found only when its exact text occurs in "
                "the prompt; engine.explain(prompt) or `kvblend explain` shows what is reused",
                level=logging.INFO,
            )  # fmt: skip
        elif stats.fallback is not None:
            cause = stats.fallback.split(":")[0]
            self.warn(
                cause, f"blend ran as full prefill: {stats.fallback} (stats.fallback; "
                "docs/configuration.md says when and how to change it)",
            )  # fmt: skip
        for line in stats.documents_lost:
            reason = line.split(": ", 1)[1]
            if "recomputed whole" not in reason:  # the fallback's line says it already
                self.warn(f"lost: {reason}", f"found document not reused: {line}")
        if stats.near_miss is not None:
            self.warn(
                "near_miss", f"no precomputed document reused there: {stats.near_miss}; a "
                "document is found only when its exact text occurs in the prompt; "
                "engine.explain(prompt) or `kvblend explain` shows what is reused",
            )  # fmt: skip


@dataclass(frozen=True)
class Explanation:
    """The plan of one prompt and its forecast: per segment, the tokens reused and why.

    ``str()`` is a table. ``stored`` tells, per cached span (by its index in ``plan.spans``),
    whether the store holds its KV now (KV that is missing is computed and stored by the
    prefill that needs it). The counts are the ones `BlendEngine.prefill` reports for the same
    prompt and config.
    """

    text: str
    plan: PrefillPlan
    stored: dict[int, bool]
    known_documents: int
    forecast: BlendForecast
    strategy: str = "attention"
    near_miss: str | None = None

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens a cache holds (before any recompute)."""
        return len(self.plan.kinds) - _count(self.plan.kinds, TokenKind.COMPUTE)

    @property
    def reused_tokens(self) -> int:
        """Prompt tokens whose KV the prefill reads from a cache (cached minus recomputed)."""
        if self.strategy == "full":
            return 0
        return self.cached_tokens - self.recomputed_tokens

    @property
    def recomputed_tokens(self) -> int:
        """Moved tokens the prefill recomputes."""
        return self.forecast.recomputed_tokens

    @property
    def computed_tokens(self) -> int:
        """Uncached prompt tokens, computed in full (every token for strategy ``full``)."""
        if self.strategy == "full":
            return len(self.plan.token_ids)
        return _count(self.plan.kinds, TokenKind.COMPUTE)

    @property
    def fallback(self) -> str | None:
        """Why the prefill would not blend as asked (None: it would)."""
        return self.forecast.fallback

    @property
    def documents_found(self) -> int:
        """Cached document segments in the prompt."""
        return sum(1 for row in self.plan.report if row.role == "document")

    def _summary(self) -> list[str]:
        total = len(self.plan.token_ids)
        lines = [
            f"{total} prompt tokens; strategy {self.strategy}: {self.reused_tokens} reused from "
            f"caches, {self.recomputed_tokens} recomputed, {self.computed_tokens} computed; "
            f"{self.documents_found} document(s) found ({self.known_documents} known)"
        ]
        if self.fallback is not None:
            lines.append(f"  runs as full prefill (prompt head reused): {self.fallback}")
        lines += [f"  not reused: {line}" for line in self.forecast.documents_lost]
        if self.near_miss is not None:
            lines.append(f"  near miss: {self.near_miss}")
        return lines

    def __str__(self) -> str:
        lines = self._summary()
        covered = 0
        for row in sorted(self.plan.report, key=lambda row: row.char_start):
            if row.char_start > covered:
                gap = self.text[covered : row.char_start]
                lines.append(f"  text      {snippet(gap)}: uncached, computed")
            missing = row.span is not None and not self.stored.get(row.span, True)
            note = "; not in the store yet: computed and stored on first use" if missing else ""
            lines.append(
                f"  {row.role:<9} {snippet(self.text[row.char_start : row.char_end])}: "
                f"{row.reused} of {row.tokens} tokens cached; {row.reason}{note}"
            )
            covered = row.char_end
        if covered < len(self.text):
            lines.append(f"  text      {snippet(self.text[covered:])}: uncached, computed")
        return "\n".join(lines)
