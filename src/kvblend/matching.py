"""Cut a finished prompt string into `Segment`s around given document texts or separators.

An engine finds its own known documents in a prompt string itself (`BlendEngine.segments_for`,
over the document registry that every engine sharing the store fills); the adapters call it
for every prompt. This module is for the two other ways a caller may mark documents:

- **given texts** (`split_prompt(prompt, documents)`): every one of the ``documents`` the
  caller passes that occurs verbatim in the prompt becomes a cached `Segment`; the text around
  them (template, question, separators) becomes uncached segments computed in full. They are
  found by the document registry's own matcher (`kvblend.documents.registry.DocumentRegistry`,
  here over the given texts alone, in memory): longest documents first, never two overlapping
  matches, every occurrence; its cost grows with the prompt length, not the number of texts.
  As in the registry, a text shorter than `kvblend.documents.registry_records.MIN_CHARS` (8)
  characters is never a document.
- **separator mode** (``separator="..."``, like LMCache's ``blend_special_str``): the prompt is
  split on the separator string, which is removed; every piece between two separators is a
  cached document, the first and last pieces are uncached. The adapters' ``separator`` option
  uses it.

This module imports no framework.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvblend.documents.registry import DocumentRegistry
from kvblend.documents.registry_records import MIN_CHARS
from kvblend.prompt.segments import Segment

__all__ = ["split_prompt"]


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
        documents: document texts the caller knows are (or may be) in the prompt (blank texts
            and texts under 8 characters are not documents); ignored in separator mode.
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
        for start, end in _found(prompt, documents):
            pieces.append((prompt[cursor:start], False))
            pieces.append((prompt[start:end], True))
            cursor = end
        pieces.append((prompt[cursor:], False))
    segments = [Segment(text, cache=cached) for text, cached in pieces if text]
    if not segments:
        raise ValueError("the prompt holds nothing but separators")
    has_document = any(segment.cache for segment in segments)
    if prefix_role and has_document and not segments[0].cache:
        segments[0] = Segment(segments[0].text, role="prefix")
    return segments


def _found(prompt: str, documents: Iterable[str]) -> list[tuple[int, int]]:
    """Character spans of the given ``documents`` in ``prompt`` (the registry's matcher)."""
    texts = [text for text in dict.fromkeys(documents) if text.strip() and len(text) >= MIN_CHARS]
    if not texts:
        return []
    registry = DocumentRegistry(None, "given-texts", capacity=len(texts))
    registry.add(texts)
    return [(match.start, match.end) for match in registry.find(prompt)]


def _split_on_separator(prompt: str, separator: str) -> list[tuple[str, bool]]:
    if not separator:
        raise ValueError("the separator must be a non-empty string")
    parts = prompt.split(separator)
    if len(parts) == 1:
        return [(prompt, False)]
    middle = [(text, True) for text in parts[1:-1]]
    return [(parts[0], False), *middle, (parts[-1], False)]
