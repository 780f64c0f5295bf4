"""A prompt's token ids without tokenizing its documents again: the tokenizer's, spliced.

The model reads the ids its tokenizer gives the whole prompt text (`kvblend.prompt.tokens`), but
most of a RAG prompt is documents whose tokens are already known: their memoised layouts. This
module tokenizes only the text between documents (with a few characters of each document on
either side) and splices in each document's known tokens between two *cuts*, when the
tokenizer's rules prove the result is exactly what tokenizing the whole text gives.

A cut is a space between two ASCII letters (``"word word"``) inside a document, further from its
edges than any added token is long. For the pipelines `splice_rules` accepts, the tokenizer
ends a token right before such a space, and the tokens on each side of it depend on that side's
text alone:

- byte-level BPE split by GPT-2's, Qwen2's, Llama-3's or Mistral tekken's pre-tokenizer rule
  (optionally after a Unicode normalization): the rule's match covering the letter before the
  space is a run of letters, so it ends at the space; the next match starts there and reads
  nothing before it (no rule looks behind); the BPE model works on each match alone;
- SentencePiece-style BPE (spaces replaced by ``▁``, split or not) whose vocabulary has no token
  with a ``▁`` after another character: no merge can ever join the letter before the ``▁`` to
  it, and BPE over a word no merge crosses is BPE over each side.

Added (special) tokens are split out of the text before all that; a document holding one gets no
cuts. Start-of-text effects (a prepended ``▁`` or space, BOS) touch only a window's first
characters, which lie before its first cut; every splice is checked to fall on token
boundaries, and any tokenizer or document this cannot be proven for (other pre-tokenizers or
normalizers, BPE dropout, truncation, a Unigram or WordPiece model) gets None: the caller then
tokenizes the whole text.
"""

from __future__ import annotations

import json
import re
import string
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "DocumentCut",
    "SpliceRules",
    "call_backend",
    "document_cut",
    "splice_rules",
    "spliced_tokens",
]

#: Pre-tokenizer rules of Qwen2, of Llama-3 (also OpenAI's cl100k) and of Mistral's tekken
#: (Mistral NeMo and later: letter runs split by case), as their tokenizer.json ``Split``
#: patterns write them; GPT-2's is the ``ByteLevel`` pre-tokenizer's own.
KNOWN_SPLITS = frozenset(
    {
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}|"
        r" ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+",
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
        r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    }
)
UNICODE_FORMS = frozenset({"NFC", "NFD", "NFKC", "NFKD"})
POST_PROCESSORS = frozenset({"TemplateProcessing", "ByteLevel"})
SPACE = "\u2581"  # SentencePiece's "▁"
#: A cut: a space with an ASCII letter on each side.
CUT = re.compile(r"(?<=[A-Za-z]) (?=[A-Za-z])")
#: Characters a window reads past each cut (the cut's neighbours, and some to spare).
WINDOW_PAD = 8


@dataclass(frozen=True)
class SpliceRules:
    """What splicing needs of one tokenizer: how far cuts stay from edges, its specials."""

    margin: int  # characters between a document's edge and its cuts
    added: re.Pattern[str] | None  # finds any added token's text
    prefix: tuple[list[int], list[list[int]]]  # special tokens added before the text, offsets
    suffix: tuple[list[int], list[list[int]]]  # and after it


@dataclass(frozen=True)
class DocumentCut:
    """A document's tokens ``[first, last)`` span its characters ``[start, end)`` (cut to cut).

    ``rules``: the tokenizer's rules they were found under (a changed tokenizer splices none).
    """

    start: int
    end: int
    first: int
    last: int
    rules: SpliceRules = field(repr=False, compare=False)


def _component(component: Any) -> Any:
    """Return a component's settings as tokenizer.json writes them (None: no component)."""
    return None if component is None else json.loads(component.__getstate__())


def _parts(settings: Any, key: str) -> list[Any]:
    """Return a ``Sequence`` component's members (else the component alone; [] for None)."""
    if settings is None:
        return []
    return list(settings[key]) if settings["type"] == "Sequence" else [settings]


def _literal_alternation(pattern: str) -> bool:
    """Whether a regex only matches literal texts holding no space (escaped or plain)."""
    return all(re.fullmatch(r"(?:\\[^\w\s]|[\w<>/-])+", option) for option in pattern.split("|"))


def _byte_level(normalizer: Any, pre: Any) -> bool:
    """Byte-level BPE pre-tokenized by a known rule, after at most Unicode normalization."""
    if any(part["type"] not in UNICODE_FORMS for part in _parts(normalizer, "normalizers")):
        return False
    steps = _parts(pre, "pretokenizers")
    if len(steps) == 1:
        return steps[0]["type"] == "ByteLevel" and bool(steps[0].get("use_regex", True))
    return (
        len(steps) == 2
        and steps[0]["type"] == "Split"
        and steps[0]["pattern"].get("Regex") in KNOWN_SPLITS
        and steps[0]["behavior"] == "Isolated"
        and not steps[0]["invert"]
        and steps[1]["type"] == "ByteLevel"
        and not steps[1].get("use_regex", True)
    )


def _sentencepiece(normalizer: Any, pre: Any, vocab: dict[str, int]) -> bool:
    """SentencePiece-style BPE: spaces become ``▁``, and no token has ``▁`` after another char."""
    normalized = _spaces_normalized(normalizer)
    if normalized is None:
        return False
    split = _spaces_split(pre)
    if split is None or not (normalized or split):
        return False
    letters = all(letter in vocab for letter in string.ascii_letters + SPACE)
    joined = re.compile(f"[^{SPACE}]{SPACE}")
    return letters and not any(joined.search(token) for token in vocab)


def _spaces_normalized(normalizer: Any) -> bool | None:
    """Whether the normalizer writes spaces as ``▁`` (None: it rewrites text in other ways)."""
    replaces = False
    for part in _parts(normalizer, "normalizers"):
        kind, pattern = part["type"], part.get("pattern", {})
        if kind == "Replace" and pattern.get("String") == " " and part["content"] == SPACE:
            replaces = True
        elif kind == "Replace" and re.fullmatch(r"\\A[ \u2581]+", pattern.get("Regex", "")):
            continue  # rewrites a piece's first characters only
        elif kind != "Prepend":  # Prepend writes a piece's first characters only
            return None
    return replaces


def _spaces_split(pre: Any) -> bool | None:
    """Whether the pre-tokenizer writes spaces as ``▁`` (None: it splits in other ways)."""
    replaces = False
    for step in _parts(pre, "pretokenizers"):
        if step["type"] == "Metaspace" and step["replacement"] == SPACE:
            replaces = True
        elif not (
            step["type"] == "Split"
            and _literal_alternation(step["pattern"].get("Regex", step["pattern"].get("String")))
            and not step["invert"]
        ):
            return None
    return replaces


def _specials(backend: Any) -> tuple[Any, Any] | None:
    """Return the special tokens ``add_special_tokens`` puts before and after a text."""
    probe = "kv blend"
    plain = backend.encode(probe, add_special_tokens=False)
    full = backend.encode(probe, add_special_tokens=True)
    ids, count = list(full.ids), len(plain.ids)
    for at in range(len(ids) - count + 1):
        if ids[at : at + count] == list(plain.ids):
            offsets = [list(pair) for pair in full.offsets]
            outside = offsets[:at] + offsets[at + count :]
            if any(pair != [0, 0] for pair in outside):
                return None
            return (ids[:at], offsets[:at]), (ids[at + count :], offsets[at + count :])
    return None


def _rules(backend: Any) -> SpliceRules | None:
    """`SpliceRules` of a Rust tokenizer, or None when its pipeline is not one known here."""
    if not _known_pipeline(backend):
        return None
    specials = _specials(backend)
    if specials is None:
        return None
    added = [token for token in backend.get_added_tokens_decoder().values() if token.content]
    contents = sorted({token.content for token in added}, key=len, reverse=True)
    pattern = re.compile("|".join(map(re.escape, contents))) if contents else None
    margin = max((len(text) for text in contents), default=0) + 2 * WINDOW_PAD
    return SpliceRules(margin, pattern, *specials)


def _known_pipeline(backend: Any) -> bool:
    """Whether a Rust tokenizer's pipeline is one whose cuts `SpliceRules` can prove exact.

    BPE without dropout, no truncation or padding, known post-processors, added tokens not
    normalized, and byte-level or SentencePiece-style pre-tokenization.
    """
    model = backend.model
    if type(model).__name__ != "BPE" or model.dropout not in (None, 0.0):
        return False
    if backend.truncation is not None or backend.padding is not None:
        return False
    normalizer, pre = _component(backend.normalizer), _component(backend.pre_tokenizer)
    post = _component(backend.post_processor)
    if any(part["type"] not in POST_PROCESSORS for part in _parts(post, "processors")):
        return False
    added = [token for token in backend.get_added_tokens_decoder().values() if token.content]
    if normalizer is not None and any(token.normalized for token in added):
        return False
    return _byte_level(normalizer, pre) or _sentencepiece(
        normalizer, pre, backend.get_vocab(with_added_tokens=False)
    )


_RULES: weakref.WeakKeyDictionary[Any, tuple[Any, SpliceRules | None]] = weakref.WeakKeyDictionary()
_RULES_LOCK = threading.Lock()


def call_backend(tokenizer: Any) -> Any:
    """Return the Rust tokenizer of ``tokenizer``, set as ``tokenizer(text)`` sets it to encode.

    transformers sets the backend's ``encode_special_tokens`` from each call's
    ``split_special_tokens`` (default: the tokenizer's own) and leaves it so: after one
    ``tokenizer(text, split_special_tokens=True)`` the backend reads special tokens' text as
    plain text, where ``tokenizer(prompt)`` would not. None for a tokenizer without one.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    split = bool(getattr(tokenizer, "split_special_tokens", False))
    if backend is not None and backend.encode_special_tokens != split:
        backend.encode_special_tokens = split
    return backend


def splice_rules(tokenizer: Any) -> SpliceRules | None:
    """`SpliceRules` of ``tokenizer`` (read once, again if its pipeline changes), or None.

    A change is any to its normalizer, pre-tokenizer, post-processor, model type, vocabulary
    size or added tokens (one added with the id of a token already in the vocabulary, or one
    made ``normalized``, changes no size).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not getattr(tokenizer, "is_fast", False):
        return None
    added = backend.get_added_tokens_decoder()
    key = tuple(
        None if part is None else part.__getstate__()
        for part in (backend.normalizer, backend.pre_tokenizer, backend.post_processor)
    ) + (
        backend.get_vocab_size(True),
        type(backend.model).__name__,
        tuple(added),
        tuple(token.normalized for token in added.values()),
    )
    with _RULES_LOCK:
        known = _RULES.get(backend)
    if known is not None and known[0] == key:
        return known[1]
    try:
        rules = _rules(backend)
    except (KeyError, TypeError, AttributeError, ValueError):  # a pipeline written otherwise
        rules = None
    with _RULES_LOCK:
        _RULES[backend] = (key, rules)
    return rules


def document_cut(
    rules: SpliceRules, text: str, starts: np.ndarray, ends: np.ndarray
) -> DocumentCut | None:
    """Return the cuts of a document and the tokens between them, or None (no splice for it).

    ``starts`` / ``ends`` are the document's token offsets (relative to its start) as tokenized
    in its context. The cuts are the first and the last space between two ASCII letters at
    least ``rules.margin`` characters from either edge.
    """
    if rules.added is not None and rules.added.search(text):
        return None  # its added tokens split the text where no cut can be proven
    if np.any(starts[1:] < starts[:-1]):
        return None
    size, margin = len(text), rules.margin
    first = CUT.search(text, margin, max(margin, size - margin))
    last = CUT.search(text[::-1], margin, max(margin, size - margin))
    if first is None or last is None:
        return None
    start, end = first.start(), size - 1 - last.start()
    low, high = (int(np.searchsorted(starts, cut, side="left")) for cut in (start, end))
    if not 0 < low < high < starts.size or ends[low - 1] > start or ends[high - 1] > end:
        return None
    return DocumentCut(start, end, low, high, rules)


def _window(backend: Any, text: str, low: int, high: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Tokens of ``text[low:high]`` as tokenized in the whole text: ids and ``[n, 2]`` offsets.

    ``low`` (unless 0) and ``high`` (unless the end) are cuts; the window tokenized reaches
    `WINDOW_PAD` characters past each, and the tokens kept must fall exactly between them.
    """
    begin = max(0, low - WINDOW_PAD)
    stop = min(len(text), high + WINDOW_PAD)
    encoding = backend.encode(text[begin:stop], add_special_tokens=False)
    ids = np.asarray(encoding.ids, dtype=np.int64)
    offsets = _pairs(encoding.offsets) + begin
    starts, ends = offsets[:, 0], offsets[:, 1]
    if np.any(starts[1:] < starts[:-1]):
        return None
    first = int(np.searchsorted(starts, low, side="left")) if low else 0
    last = int(np.searchsorted(starts, high, side="left")) if stop > high else ids.size
    if low and (first == 0 or ends[first - 1] > low):
        return None  # a token crosses the left cut
    if stop > high and (last == ids.size or (last > first and ends[last - 1] > high)):
        return None  # a token crosses the right cut
    return ids[first:last], offsets[first:last]


def _pairs(offsets: Any) -> np.ndarray:
    """Offsets as an int64 ``[n, 2]`` array."""
    return np.asarray(offsets, dtype=np.int64).reshape(-1, 2)


def spliced_tokens(
    tokenizer: Any,
    text: str,
    documents: Sequence[tuple[int, DocumentCut, np.ndarray, np.ndarray]],
    add_special: bool,
    rules: SpliceRules | None = None,
) -> tuple[np.ndarray, np.ndarray] | None:
    """Ids and ``[n, 2]`` character offsets of ``text``, its documents' tokens spliced in.

    ``documents`` are ``(character start, cut, ids, offsets)`` of each document in the text, in
    order, with its cut and its memoised ids and offsets (relative to its start). None when
    a window does not fall on token boundaries (the caller tokenizes the whole text).
    ``rules``: the tokenizer's `splice_rules` as just read by the caller (None: read here).
    """
    rules = rules or splice_rules(tokenizer)
    if rules is None:
        return None
    backend = call_backend(tokenizer)
    ids_parts: list[Any] = [rules.prefix[0] if add_special else []]
    offset_parts: list[Any] = [_pairs(rules.prefix[1] if add_special else [])]
    cursor = 0
    for start, cut, ids, offsets in documents:
        if cut.rules is not rules or start + cut.start < cursor:
            return None  # cut under other rules, or documents overlapping: not this text
        window = _window(backend, text, cursor, start + cut.start)
        if window is None:
            return None
        ids_parts += [window[0], ids[cut.first : cut.last]]
        offset_parts += [window[1], offsets[cut.first : cut.last] + start]
        cursor = start + cut.end
    window = _window(backend, text, cursor, len(text))
    if window is None:
        return None
    ids_parts.append(window[0])
    offset_parts.append(window[1])
    if add_special:
        ids_parts.append(rules.suffix[0])
        offset_parts.append(_pairs(rules.suffix[1]))
    return (
        np.concatenate([np.asarray(part, dtype=np.int64) for part in ids_parts]),
        np.concatenate(offset_parts),
    )
