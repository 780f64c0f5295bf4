"""What a prefill will do with a prompt, and why: `Explanation`; and `FallbackLog`.

`Explanation` shows a prompt's plan and its forecast (`kvblend.blend.forecast.forecast_blend`,
which `prefill` reports in its stats too, so the two agree by construction). `FallbackLog` warns
of the reasons a prefill gives for not reusing documents, each cause once a minute.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvblend.blend.forecast import NO_DOCUMENTS_CAUSE, BlendForecast, Lost
from kvblend.prompt.plan import PrefillPlan, TokenKind
from kvblend.validation import snippet

__all__ = ["Explanation", "FallbackLog"]


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

    def report(
        self,
        fallback: str | None,
        cause: str | None,
        lost: Sequence[Lost],
        near_miss: str | None = None,
        known: int | None = None,
    ) -> None:
        """Log each reason a prompt's documents were not reused, once per cause a minute.

        ``fallback`` and its ``cause``: why the prompt was computed in full (`BlendForecast`,
        or the guard); ``lost``: the documents found and not reused. A prompt without a known
        document (a greeting, a rephrasing step) is logged at INFO level, with the ``known``
        documents that could have been found in it; one that holds the start of a known
        document, not its whole text (``near_miss``), is a warning.
        """
        if cause == NO_DOCUMENTS_CAUSE:
            self.warn(
                "no_documents", f"no known document in the prompt ({known} known): computed in "
                "full (stats.fallback); a document is found only when its exact text occurs in "
                "the prompt; engine.explain(prompt) or `kvblend explain` shows what is reused",
                level=logging.INFO,
            )  # fmt: skip
        elif fallback is not None:
            self.warn(
                cause or fallback, f"blend ran as full prefill: {fallback} (stats.fallback; "
                "docs/configuration.md says when and how to change it)",
            )  # fmt: skip
        for item in lost:
            if not item.recomputed:  # a document recomputed whole: the fallback's line says it
                self.warn(f"lost: {item.reason}", f"found document not reused: {item}")
        if near_miss is not None:
            self.warn(
                "near_miss", f"no precomputed document reused there: {near_miss}; a "
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
    guard: float | None = None  # the config's guard tolerance (None: no guard)

    def _count(self, kind: TokenKind) -> int:
        return int(np.count_nonzero(self.plan.kinds == kind))

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens a cache holds (before any recompute)."""
        return len(self.plan.kinds) - self._count(TokenKind.COMPUTE)

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
        return self._count(TokenKind.COMPUTE)

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
            head = self.reused_tokens
            reused = f" ({head} tokens of the prompt head reused)" if head else ""
            lines.append(f"  runs as full prefill{reused}: {self.fallback}")
        elif self.guard is not None:
            lines.append(
                f"  guarded (tolerance {self.guard:g}): computed in full after the blend if it "
                "moves the next-token distribution further from the cached prompt's; "
                "stats.guard says whether it did"
            )
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
