"""What a prefill will do with a prompt, and why: `Explanation`.

`Explanation` shows a prompt's plan and its forecast (`kvblend.blend.forecast.forecast_blend`,
which `prefill` reports in its stats too, so the two agree by construction), in the words of
docs/glossary.md: every prompt token is reused, recomputed or computed, and each document says
which of these its stored tokens are.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvblend.blend.forecast import BlendForecast, documents
from kvblend.prompt.plan import PrefillPlan, TokenKind
from kvblend.validation import snippet

__all__ = ["Explanation"]


#: When the guard escalates, by its signal (`kvblend.blend.guard`).
_GUARD_WHEN = {
    "shift": "it moves the next-token distribution further from the cached prompt's",
    "kl": "it moves the next-token distribution further (KL) from the cached prompt's",
    "flip": "it changes the cached prompt's most likely next token",
    "margin": "its most likely next token leads the second by less",
    "stale_mass": "the tokens it leaves stale hold more of the question's probe scores",
}


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
    guard_signal: str = "shift"  # the signal the guard compares with it

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
            f"{total} prompt tokens; strategy {self.strategy}: {self.reused_tokens} reused, "
            f"{self.recomputed_tokens} recomputed, {self.computed_tokens} computed; "
            f"{self.documents_found} document(s) found ({self.known_documents} known)"
        ]
        if self.fallback is not None:
            head = self.reused_tokens
            where = f" after the cached prefix ({head} tokens reused there)" if head else ""
            lines.append(f"  runs as full prefill{where}: {self.fallback}")
        elif self.guard is not None:
            when = _GUARD_WHEN.get(self.guard_signal, f"its {self.guard_signal} is past it")
            lines.append(
                f"  guarded (tolerance {self.guard:g}): computed in full after the blend if "
                f"{when}; stats.guard says whether it did"
            )
        lines += [f"  not reused: {line}" for line in self.forecast.documents_lost]
        if self.near_miss is not None:
            lines.append(f"  near miss: {self.near_miss}")
        return lines

    def _reasons(self) -> dict[int, str]:
        """Say what happens to each document's stored tokens, by the id of its report row.

        The plan says where a document's stored KV would go (reused exactly, or moved); the
        forecast may recompute it instead: every moved document of a full prefill, and a
        document recomputed whole or not reused (`BlendForecast.lost`).
        """
        lost = {item.document: item for item in self.forecast.lost if item.document is not None}
        reasons = {}
        for number, row in documents(self.plan):
            item = lost.get(number)
            if self.strategy == "full":
                reasons[id(row)] = "computed (strategy full)"
            elif item is not None and item.recomputed:
                reasons[id(row)] = f"recomputed whole ({item.reason})"
            elif item is not None:
                reasons[id(row)] = f"not reused: {item.reason}"
            elif self.fallback is not None and row.reused and not row.exact:  # moved
                reasons[id(row)] = "moved: recomputed (the prompt runs as full prefill, above)"
        return reasons

    def __str__(self) -> str:
        lines = self._summary()
        reasons = self._reasons()
        covered = 0
        for row in sorted(self.plan.report, key=lambda row: row.char_start):
            if row.char_start > covered:
                gap = self.text[covered : row.char_start]
                lines.append(f"  text      {snippet(gap)}: computed")
            missing = row.span is not None and not self.stored.get(row.span, True)
            note = "; not in the store yet: computed and stored on first use" if missing else ""
            lines.append(
                f"  {row.role:<9} {snippet(self.text[row.char_start : row.char_end])}: "
                f"{row.reused} of {row.tokens} tokens stored; "
                f"{reasons.get(id(row), row.reason)}{note}"
            )
            covered = row.char_end
        if covered < len(self.text):
            lines.append(f"  text      {snippet(self.text[covered:])}: computed")
        return "\n".join(lines)
