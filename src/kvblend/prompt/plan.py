"""The prefill plan: which prompt tokens come from which cache.

The prompt's tokens are the tokenizer's on the whole text (`kvblend.prompt.tokens`). A
document's KV is cached for the tokens it has when it follows its document context (the text
it is precomputed behind). In a prompt, the document's tokens whose ids and character offsets
(relative to the document's start) equal cached ones reuse the cached rows; tokens at its edges
that tokenize differently in context (a space glued to its first word, a word continuing past
its end) are computed. `plan_prefill` is a pure function of token ids and offsets, so every
tokenizer family follows the same rule and the plan can be tested without a model; it works on
numpy arrays (the plan's ``token_ids`` and ``kinds`` are arrays), never token by token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING

import numpy as np

from kvblend.prompt.tokens import (
    DocumentLayout,
    PromptTokens,
    token_keys,
)

if TYPE_CHECKING:
    from kvblend.prompt.segments import Segment

__all__ = [
    "CachedPiece",
    "PlannedSpan",
    "PrefillPlan",
    "SpanReport",
    "TokenKind",
    "cached_pieces",
    "plan_prefill",
]


class TokenKind(IntEnum):
    """Where a prompt token's KV comes from."""

    PREFIX = 0  # a cache computed over exactly the tokens before it: reused as is
    MOVED = 1  # a document cache computed behind other text: reused, may be recomputed
    COMPUTE = 2  # no cache: computed at every layer


@dataclass(frozen=True)
class PlannedSpan:
    """Prompt rows ``[start, end)`` that read cached rows ``[cached_start, ...)`` of one entry.

    The entry is the KV of ``cached_ids`` computed behind ``context_ids``.
    """

    start: int
    end: int
    cached_start: int
    kind: TokenKind
    context_ids: list[int]
    cached_ids: list[int]


@dataclass(frozen=True)
class SpanReport:
    """What the plan does with one segment of the prompt (for `BlendEngine.explain`)."""

    char_start: int
    char_end: int
    tokens: int
    role: str  # "prefix", "document" or "text"
    reused: int  # tokens read from a cache
    exact: bool  # reused at the position and context it was computed at
    reason: str
    span: int | None = None  # index of its `PlannedSpan` in the plan, if any


@dataclass
class PrefillPlan:
    """Token ids of the whole prompt, each token's kind, and the cached spans to read.

    ``token_ids`` is an int64 array ``[tokens]``, ``kinds`` an int8 array of `TokenKind` values.
    """

    token_ids: np.ndarray
    kinds: np.ndarray
    spans: list[PlannedSpan] = field(default_factory=list)
    report: list[SpanReport] = field(default_factory=list)


@dataclass(frozen=True)
class CachedPiece:
    """A cached segment of the prompt: characters ``[start, end)``, ``role`` prefix or document."""

    start: int
    end: int
    role: str


def cached_pieces(segments: Sequence[Segment]) -> list[CachedPiece]:
    """Return the cached ones of a prompt's segments, by their characters in the whole text."""
    pieces, cursor = [], 0
    for segment in segments:
        if segment.cache:
            pieces.append(CachedPiece(cursor, cursor + len(segment.text), segment.role))
        cursor += len(segment.text)
    return pieces


def _tokens_within(prompt: PromptTokens, start: int, end: int) -> range:
    """Return the indices of the tokens lying entirely inside characters ``[start, end)``.

    From the first token starting at or after ``start`` (zero-width, special, tokens skipped)
    up to the first one ending after ``end``.
    """
    _, starts, ends = prompt.arrays
    first = int(np.searchsorted(starts, start, side="left"))
    for stop in (first + 64, starts.size):  # zero-width (special) tokens belong to no document
        sized = np.flatnonzero(starts[first:stop] != ends[first:stop])
        if sized.size or stop == starts.size:
            first += int(sized[0]) if sized.size else stop - first
            break
    # No more tokens than characters end inside [start, end), zero-width ones aside: look at
    # that many first, the rest of the prompt only if they all do.
    nearby = ends[first : first + (end - start) + 64] > end
    if nearby.any():
        return range(first, first + int(np.argmax(nearby)))
    beyond = ends[first:] > end
    return range(first, first + (int(np.argmax(beyond)) if beyond.any() else len(beyond)))


def _straddling(offsets: np.ndarray, tokens: range, start: int, end: int) -> int:
    """How many tokens just outside ``tokens`` also hold characters of ``[start, end)``."""
    before = tokens.start > 0 and offsets[tokens.start - 1][1] > start
    after = tokens.stop < len(offsets) and offsets[tokens.stop][0] < end
    return int(before) + int(after)


def _longest_run(
    prompt: PromptTokens, tokens: range, char_start: int, layout: DocumentLayout
) -> tuple[int, int, int]:
    """Longest run of prompt tokens equal (id and relative offsets) to consecutive cached ones.

    Returns ``(prompt_index, cached_index, length)``; length 0 when nothing matches. Each
    prompt token is looked up among the cached ones by (start, id), the first such cached
    token, as a run restarts there; a run goes on while the next prompt token is the next
    cached one; the first of the longest runs wins.
    """
    if not len(tokens) or not layout.ids:
        return (0, 0, 0)
    keys, order, cached_ends = layout.lookup
    ids, starts, ends = (array[tokens.start : tokens.stop] for array in prompt.arrays)
    starts, ends = starts - char_start, ends - char_start
    wanted = token_keys(starts, ids)
    slot = np.minimum(np.searchsorted(keys, wanted), len(keys) - 1)
    cached = order[slot]
    found = (keys[slot] == wanted) & (cached_ends[cached] == ends)
    follows = np.zeros_like(found)
    follows[1:] = found[1:] & found[:-1] & (cached[1:] == cached[:-1] + 1)
    if not found.any():
        return (0, 0, 0)
    run_starts = np.flatnonzero(found & ~follows)
    # lengths of the runs: from each start, the found tokens that follow without a break
    breaks = np.flatnonzero(~follows)
    stops = np.append(breaks, len(found))
    run_ends = stops[np.searchsorted(stops, run_starts, side="right")]
    lengths = run_ends - run_starts
    best = int(np.argmax(lengths))
    first = int(run_starts[best])
    return (tokens.start + first, int(cached[first]), int(lengths[best]))


def _plan_prefix(prompt: PromptTokens, plan: PrefillPlan, prefix_end: int) -> None:
    """Mark the tokens of the cached prompt head ``[0, prefix_end)`` as a prefix span."""
    _, _, ends = prompt.arrays
    beyond = ends > prefix_end
    count = int(np.argmax(beyond)) if beyond.any() else len(ends)
    if count:
        plan.kinds[:count] = TokenKind.PREFIX
        head = prompt.ids[:count].tolist()
        plan.spans.append(PlannedSpan(0, count, 0, TokenKind.PREFIX, [], head))
    plan.report.append(
        SpanReport(
            0,
            prefix_end,
            count,
            "prefix",
            count,
            True,
            "prompt head, reused exactly",
            0 if count else None,
        )
    )


def _plan_document(
    prompt: PromptTokens, plan: PrefillPlan, piece: CachedPiece, layout: DocumentLayout
) -> None:
    """Place one cached document: its longest run of tokens as cached, reported."""
    ids, kinds = prompt.ids, plan.kinds
    tokens = _tokens_within(prompt, piece.start, piece.end)
    first, cached, length = _longest_run(prompt, tokens, piece.start, layout)
    context = layout.context_ids
    exact = (
        length > 0
        and cached == 0
        and first == len(context)
        and np.array_equal(ids[: len(context)], context)
        and not np.any(kinds[first : first + length] == TokenKind.PREFIX)
    )
    kind = TokenKind.PREFIX if exact else TokenKind.MOVED
    span_index = len(plan.spans) if length else None
    if length:
        kinds[first : first + length] = kind
        plan.spans.append(PlannedSpan(first, first + length, cached, kind, context, layout.ids))
    overlapping = len(tokens) + _straddling(prompt.offsets, tokens, piece.start, piece.end)
    edge = overlapping - length
    if not length:
        reason = "no token tokenizes as in the cache: computed"
    elif exact:
        reason = "right after the text it was precomputed behind: reused exactly"
    else:
        reason = "moved: reused at its new position"
    if length and edge:
        reason += f"; {edge} edge token(s) tokenize differently here and are computed"
    plan.report.append(
        SpanReport(
            piece.start, piece.end, overlapping, "document", length, exact, reason, span_index
        )
    )


def plan_prefill(
    prompt: PromptTokens,
    pieces: Sequence[CachedPiece],
    layout_of: Callable[[int, int], DocumentLayout],
) -> PrefillPlan:
    """Decide, for every prompt token, where its KV comes from.

    ``pieces`` are the cached segments, in order, prefixes first; ``layout_of(start, end)``
    returns the cached layout of the document at characters ``[start, end)``. Text outside the
    pieces, and document tokens that tokenize differently in context, are computed; the last
    token is always computed (it gives the logits).
    """
    plan = PrefillPlan(prompt.ids, np.full(prompt.ids.size, TokenKind.COMPUTE, dtype=np.int8))
    prefix_end = max((piece.end for piece in pieces if piece.role == "prefix"), default=0)
    if prefix_end:
        _plan_prefix(prompt, plan, prefix_end)
    for piece in pieces:
        if piece.role != "prefix":
            _plan_document(prompt, plan, piece, layout_of(piece.start, piece.end))
    if plan.kinds.size:
        plan.kinds[-1] = TokenKind.COMPUTE
    return plan
