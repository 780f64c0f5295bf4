"""`Explanation`: what a prefill would reuse, recompute or compute in a prompt, and why."""

from __future__ import annotations

from dataclasses import dataclass

from .prompt import PrefillPlan, TokenKind

__all__ = ["Explanation"]


def _snippet(text: str, width: int = 48) -> str:
    """Return the text's repr, cut to about ``width`` characters."""
    if len(text) <= width:
        return repr(text)
    return repr(text[: width - 3]) + "..."


@dataclass(frozen=True)
class Explanation:
    """The plan of one prompt: per segment, the tokens reused and why; ``str()`` is a table.

    ``stored`` tells, per cached span (by its index in ``plan.spans``), whether the store holds
    its KV now (KV that is missing is computed and stored by the prefill that needs it).
    """

    text: str
    plan: PrefillPlan
    stored: dict[int, bool]
    known_documents: int

    @property
    def reused_tokens(self) -> int:
        """Prompt tokens whose KV would be read from a cache (before any recompute)."""
        return sum(1 for kind in self.plan.kinds if kind != TokenKind.COMPUTE)

    @property
    def documents_found(self) -> int:
        """Cached document segments in the prompt."""
        return sum(1 for row in self.plan.report if row.role == "document")

    def __str__(self) -> str:
        total = len(self.plan.token_ids)
        lines = [
            f"{total} prompt tokens; {self.reused_tokens} from caches, "
            f"{total - self.reused_tokens} computed; {self.documents_found} cached segment(s) "
            f"found ({self.known_documents} documents known)"
        ]
        covered = 0
        for row in sorted(self.plan.report, key=lambda row: row.char_start):
            if row.char_start > covered:
                gap = self.text[covered : row.char_start]
                lines.append(f"  text      {_snippet(gap)}: uncached, computed")
            missing = row.span is not None and not self.stored.get(row.span, True)
            note = "; not in the store yet: computed and stored on first use" if missing else ""
            lines.append(
                f"  {row.role:<9} {_snippet(self.text[row.char_start : row.char_end])}: "
                f"{row.reused}/{row.tokens} tokens reused; {row.reason}{note}"
            )
            covered = row.char_end
        if covered < len(self.text):
            lines.append(f"  text      {_snippet(self.text[covered:])}: uncached, computed")
        return "\n".join(lines)
