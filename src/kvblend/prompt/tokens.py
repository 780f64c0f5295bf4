"""A prompt's token ids and character offsets, exactly the tokenizer's on the whole text.

The model must read exactly the prompt the user wrote: the token ids its own tokenizer gives
the whole text, as ``model.generate(**tokenizer(prompt))`` would. Tokenizing each piece of a
prompt on its own and concatenating the ids is not the same text to the model (a BPE tokenizer
glues a space to the next word, merges newlines across pieces; a SentencePiece tokenizer adds a
``▁`` at the start of every piece), so `encode_prompt` tokenizes the whole text, with each
token's character span, and `prompt_tokens` gives the same ids and spans without tokenizing the
prompt's documents again: their memoised tokens (`DocumentLayout`, with its cuts) are spliced
between the text around them, tokenized (`kvblend.prompt.splice` says when that is exact; when
it cannot be proven, the whole text is tokenized).

Ids and offsets are numpy arrays: nothing here loops over tokens in Python.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvblend.prompt.splice import (
    DocumentCut,
    SpliceRules,
    call_backend,
    document_cut,
    splice_rules,
    spliced_tokens,
)

__all__ = [
    "DocumentLayout",
    "PromptTokens",
    "document_layout",
    "encode_in_background",
    "encode_prompt",
    "prompt_tokens",
]


def _pairs(offsets: Any) -> np.ndarray:
    """Character spans as an int64 ``[tokens, 2]`` array."""
    return np.asarray(offsets, dtype=np.int64).reshape(-1, 2)


@dataclass(frozen=True)
class PromptTokens:
    """Token ids of a text with each token's character span ``[start, end)`` in that text.

    ``ids`` is an int64 array ``[tokens]``, ``offsets`` an int64 array ``[tokens, 2]`` (lists
    given are converted).
    """

    ids: np.ndarray
    offsets: np.ndarray

    def __post_init__(self) -> None:
        object.__setattr__(self, "ids", np.asarray(self.ids, dtype=np.int64).reshape(-1))
        object.__setattr__(self, "offsets", _pairs(self.offsets))

    @functools.cached_property
    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``ids``, span starts and span ends, each a contiguous int64 array (made once)."""
        spans = np.ascontiguousarray(self.offsets.T)
        return self.ids, spans[0], spans[1]


def _adds_specials(tokenizer: Any, text: str) -> bool:
    """Whether ``tokenizer(text)`` adds its special tokens: not to a text starting with BOS."""
    bos = getattr(tokenizer, "bos_token", None)
    return not (isinstance(bos, str) and bos and text.startswith(bos))


def _check_fast(tokenizer: Any) -> None:
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError(
            "kvblend needs a fast (Rust) tokenizer to locate documents in a prompt; load the "
            "tokenizer with use_fast=True"
        )


def encode_prompt(tokenizer: Any, text: str) -> PromptTokens:
    """Tokenize ``text`` as a whole, as transformers would before ``generate``.

    Special tokens are added the way ``tokenizer(text)`` adds them, except when the text already
    starts with the tokenizer's BOS token (a chat template wrote it): then none are added, as
    transformers' ``apply_chat_template(..., tokenize=True)`` and text-generation pipeline do,
    so the BOS is not doubled. Special tokens' text is read as ``tokenizer(text)`` reads it
    (as plain text only under the tokenizer's ``split_special_tokens``), whatever an earlier
    call left set in the Rust tokenizer (`kvblend.prompt.splice.call_backend`).
    """
    _check_fast(tokenizer)
    add_special = _adds_specials(tokenizer, text)
    backend = call_backend(tokenizer)
    if backend is not None:  # the Rust tokenizer ``tokenizer(text)`` calls, without its wrapping
        encoding = backend.encode(text, add_special_tokens=add_special)
        return PromptTokens(encoding.ids, encoding.offsets)
    encoded = tokenizer(text, add_special_tokens=add_special, return_offsets_mapping=True)
    return PromptTokens(encoded["input_ids"], encoded["offset_mapping"])


_ENCODER: ThreadPoolExecutor | None = None
_ENCODER_LOCK = threading.Lock()


def encode_in_background(tokenizer: Any, text: str) -> Future[PromptTokens]:
    """`encode_prompt` in a worker thread, so a prompt is tokenized while its documents are found.

    The Rust tokenizer releases the GIL, so on two or more cores matching costs no latency.
    """
    global _ENCODER
    with _ENCODER_LOCK:
        if _ENCODER is None:
            workers = min(8, os.cpu_count() or 2)
            _ENCODER = ThreadPoolExecutor(workers, thread_name_prefix="kvblend-tokenize")
    return _ENCODER.submit(encode_prompt, tokenizer, text)


@dataclass(frozen=True)
class DocumentLayout:
    """A document's tokens as cached: behind ``context_ids``, with offsets relative to its start.

    ``ids`` / ``offsets`` are the tokens whose KV is stored (offsets may start below 0 for a
    token that straddles the end of the context text; an int64 ``[tokens, 2]`` array). ``cut``:
    the tokens a prompt holding the document may take as they are, without tokenizing them
    (`kvblend.prompt.splice.document_cut`; None: none).
    """

    context_ids: list[int]
    ids: list[int]
    offsets: np.ndarray
    cut: DocumentCut | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "offsets", _pairs(self.offsets))

    @functools.cached_property
    def tokens(self) -> PromptTokens:
        """The document's tokens as arrays (made once per layout)."""
        return PromptTokens(np.asarray(self.ids, dtype=np.int64), self.offsets)

    @functools.cached_property
    def lookup(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The cached tokens by (start, id), for `_longest_run` (made once per layout).

        Returns the sorted keys, the token index of each key (the first of equal keys) and
        every token's end offset.
        """
        ids, starts, ends = self.tokens.arrays
        keys = token_keys(starts, ids)
        order = np.argsort(keys, kind="stable")
        return keys[order], order, ends


def token_keys(starts: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """One int64 per (start offset, token id): equal keys for equal pairs."""
    return (starts + (1 << 30)) * (1 << 32) + ids


def document_layout(tokenizer: Any, context_text: str, text: str) -> DocumentLayout:
    """Tokenize ``context_text + text`` as a whole and split it where the document starts."""
    whole = encode_prompt(tokenizer, context_text + text)
    boundary = len(context_text)
    ids, _, ends = whole.arrays
    beyond = ends > boundary  # the document's tokens: from the first ending past the context
    split = int(np.argmax(beyond)) if beyond.any() else ids.size
    offsets = whole.offsets[split:] - boundary
    rules = splice_rules(tokenizer)
    cut = None
    if rules is not None:
        cut = document_cut(rules, text, offsets[:, 0], offsets[:, 1])
    return DocumentLayout(ids[:split].tolist(), ids[split:].tolist(), offsets, cut)


def prompt_tokens(
    tokenizer: Any,
    text: str,
    layouts: Mapping[tuple[int, int], DocumentLayout],
    rules: SpliceRules | None = None,
) -> PromptTokens:
    """`encode_prompt`'s tokens of ``text``, its documents' memoised tokens spliced in.

    ``layouts`` maps the character span ``[start, end)`` of each cached document in the text,
    in order, to its layout. The text between the documents' cuts is tokenized (with a few
    characters past each); when the tokenizer's rules do not prove the splice exact, or no
    document has cuts, the whole text is. ``rules``: the tokenizer's `splice_rules` as just
    read by the caller (None: read here; reading them checks the whole added vocabulary).
    """
    _check_fast(tokenizer)
    parts = [
        (start, layout.cut, layout.tokens.ids, layout.tokens.offsets)
        for (start, _), layout in layouts.items()
        if layout.cut is not None
    ]
    spliced = None
    if parts:
        adds = _adds_specials(tokenizer, text)
        spliced = spliced_tokens(tokenizer, text, parts, adds, rules)
    if spliced is None:
        return encode_prompt(tokenizer, text)
    return PromptTokens(*spliced)
