"""Prompt segments and content-hash segment ids."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from kvblend.validation import check_text

Role = Literal["document", "prefix"]

#: Version of the stored KV layout (one tensor `KV_NAME` of un-rotated keys and values,
#: ``[layers, 2, kv_heads, tokens, head_dim]``, whole-text token ids); part of every segment
#: key, so entries of another layout are never found, let alone read.
KV_LAYOUT = "kvblend-segment-kv/3"

#: The name of a segment entry's one tensor.
KV_NAME = "kv"


@dataclass(frozen=True)
class Segment:
    """One piece of a prompt.

    Attributes:
        text: the exact text of the piece. The prompt is the concatenation of every segment's
            text, tokenized as a whole (the model reads exactly that text); a cached segment's
            tokens that tokenize differently there than in its cache are computed.
        role: ``"document"`` (default) for a cached piece that may land anywhere in the prompt;
            ``"prefix"`` for a leading piece (system prompt, template head) that is cached at its
            own position and reused exactly. Prefix segments must come first.
        cache: False for text computed in full every time (the question, template text).
    """

    text: str
    role: Role = "document"
    cache: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.text, str):
            raise TypeError(f"Segment text must be a str, got {type(self.text).__name__}")
        if self.text == "":
            raise ValueError("Segment text is empty; drop the segment instead")
        check_text(self.text, "Segment text")
        if self.role not in ("document", "prefix"):
            raise ValueError(f"Segment role must be 'document' or 'prefix', got {self.role!r}")
        if self.role == "prefix" and not self.cache:
            raise ValueError("a prefix segment is cached by definition; use cache=True")


#: A prompt: a string (known documents are found in it) or a list of segments.
PromptLike = str | Sequence[Segment | str]


def check_segments(segments: Sequence[Segment | str]) -> list[Segment]:
    """Validate a segment list: non-empty, Segments (strings become uncached), prefixes first."""
    if isinstance(segments, (str, Segment)):
        raise TypeError("pass a list of segments, not a single segment")
    items = [s if isinstance(s, Segment) else Segment(s, cache=False) for s in segments]
    if not items:
        raise ValueError("the segment list is empty: a prompt needs at least one segment")
    seen_other = False
    for segment in items:
        if segment.role == "prefix" and seen_other:
            raise ValueError("prefix segments must come before every other segment")
        seen_other |= segment.role != "prefix"
    return items


def segment_key(fingerprint: str, context_ids: Sequence[int], token_ids: Sequence[int]) -> str:
    """Stable content id of a segment's KV: model+tokenizer fingerprint, context and tokens."""
    digest = hashlib.sha256()
    digest.update(KV_LAYOUT.encode())
    digest.update(b"|")
    digest.update(fingerprint.encode())
    digest.update(b"|ctx|")
    digest.update(np.asarray(context_ids, dtype="<i8").tobytes())
    digest.update(b"|seg|")
    digest.update(np.asarray(token_ids, dtype="<i8").tobytes())
    return digest.hexdigest()[:48]
