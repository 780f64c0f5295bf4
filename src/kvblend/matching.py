"""Cut a finished prompt string into `Segment`s around given document texts or separators.

An engine finds its own known documents in a prompt string itself (`BlendEngine.segments_for`,
over the document registry that every engine sharing the store fills); the adapters call it
for every prompt. This module is for the two other ways a caller may mark documents:

- **given texts** (`split_prompt(prompt, documents)`, `find_documents`): every one of the
  ``documents`` the caller passes that occurs verbatim in the prompt becomes a cached
  `Segment`; the text around them (template, question, separators) becomes uncached segments
  computed in full. Longest documents first, never two overlapping matches, left to right; only
  documents whose first characters occur in the prompt are searched for, so the cost grows with
  the prompt length plus the number of texts, not their product.
- **separator mode** (``separator="..."``, like LMCache's ``blend_special_str``): the prompt is
  split on the separator string, which is removed; every piece between two separators is a
  cached document, the first and last pieces are uncached. The adapters' ``separator`` option
  uses it.

This module depends only on `kvblend.prompt.segments`; it imports no framework.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass

from kvblend.prompt.segments import Segment

__all__ = ["DocumentMatch", "find_documents", "split_prompt"]

# Length of the prompt substrings indexed to rule out documents cheaply before searching.
_ANCHOR_CHARS = 8


@dataclass(frozen=True)
class DocumentMatch:
    """A known document found in a prompt at characters ``[start, end)``."""

    start: int
    end: int
    text: str


def find_documents(prompt: str, documents: Iterable[str]) -> list[DocumentMatch]:
    """Locate known ``documents`` in ``prompt`` by exact match.

    Longer documents are placed first; an occurrence that overlaps an already placed one is
    skipped (so a document contained in a longer matched document is not matched inside it).
    A document that occurs several times is matched at every non-overlapping occurrence.

    Args:
        prompt: the final prompt text.
        documents: candidate document texts (duplicates and blank texts are ignored).

    Returns:
        The accepted matches, sorted by position.
    """
    candidates = _candidates(prompt, documents)
    # Longest first; among equal lengths, the earlier occurrence wins.
    occurrences = sorted(
        ((start, text) for text in candidates for start in _occurrences(prompt, text)),
        key=lambda item: (-len(item[1]), item[0]),
    )
    starts: list[int] = []  # accepted spans, sorted by start; they never overlap
    ends: list[int] = []
    matches: dict[int, DocumentMatch] = {}
    for start, text in occurrences:
        end = start + len(text)
        slot = bisect.bisect_right(starts, start)
        if slot > 0 and ends[slot - 1] > start:  # the span on the left reaches into this one
            continue
        if slot < len(starts) and starts[slot] < end:  # this one reaches into the next span
            continue
        starts.insert(slot, start)
        ends.insert(slot, end)
        matches[start] = DocumentMatch(start, end, text)
    return [matches[start] for start in starts]


def split_prompt(
    prompt: str,
    documents: Iterable[str] = (),
    separator: str | None = None,
    *,
    prefix_role: bool = False,
) -> list[Segment]:
    """Cut ``prompt`` into segments: cached documents and uncached text around them.

    The segments' texts concatenate back to ``prompt`` (minus the separators in separator
    mode), so a prefill over them sees the same text, tokenized piece by piece.

    Args:
        prompt: the final prompt text (after any chat template).
        documents: document texts the caller knows are (or may be) in the prompt; ignored in
            separator mode.
        separator: if given, split on this string instead of matching: each piece between two
            separators is a cached document; the first and last pieces are uncached.
        prefix_role: mark the text before the first document as ``role="prefix"`` (cached at its
            own position and reused exactly across prompts sharing it) instead of uncached.
            Only applies when at least one document follows it.

    Returns:
        A non-empty list of segments (a prompt without documents is one uncached segment).
    """
    if not prompt:
        raise ValueError("the prompt is empty")
    if separator is not None:
        pieces = _split_on_separator(prompt, separator)
    else:
        pieces = []
        cursor = 0
        for match in find_documents(prompt, documents):
            pieces.append((prompt[cursor : match.start], False))
            pieces.append((match.text, True))
            cursor = match.end
        pieces.append((prompt[cursor:], False))
    segments = [Segment(text, cache=cached) for text, cached in pieces if text]
    if not segments:
        raise ValueError("the prompt holds nothing but separators")
    has_document = any(segment.cache for segment in segments)
    if prefix_role and has_document and not segments[0].cache:
        segments[0] = Segment(segments[0].text, role="prefix")
    return segments


def _candidates(prompt: str, documents: Iterable[str]) -> list[str]:
    """Distinct non-empty documents that may occur in ``prompt`` (cheap anchor filter first)."""
    anchors: set[str] | None = None
    found: list[str] = []
    seen: set[str] = set()
    for text in documents:
        if not text.strip() or text in seen or len(text) > len(prompt):
            continue
        seen.add(text)
        if len(text) >= _ANCHOR_CHARS:
            if anchors is None:  # every substring of anchor length, built on first need
                last = len(prompt) - _ANCHOR_CHARS + 1
                anchors = {prompt[i : i + _ANCHOR_CHARS] for i in range(max(0, last))}
            if text[:_ANCHOR_CHARS] not in anchors:
                continue
        if text in prompt:
            found.append(text)
    return found


def _occurrences(prompt: str, text: str) -> Iterable[int]:
    """Start offsets of the non-overlapping occurrences of ``text``, left to right."""
    start = prompt.find(text)
    while start >= 0:
        yield start
        start = prompt.find(text, start + len(text))


def _split_on_separator(prompt: str, separator: str) -> list[tuple[str, bool]]:
    if not separator:
        raise ValueError("the separator must be a non-empty string")
    parts = prompt.split(separator)
    if len(parts) == 1:
        return [(prompt, False)]
    middle = [(text, True) for text in parts[1:-1]]
    return [(parts[0], False), *middle, (parts[-1], False)]
