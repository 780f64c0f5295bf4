"""Checks of what callers pass in: prompt text, its size, stop sequences and sampling settings.

Every check raises one `ValueError` (or `TypeError` for a wrong type) that names the argument
and what is wrong with it, before any tokenizing or decoding starts, so a mistake never surfaces
as a cryptic error from deep inside a tokenizer or as silently wrong output (a ``nan``
temperature decoding greedily, an empty stop string returning empty text).
"""

from __future__ import annotations

import math
import numbers
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

#: Most stop sequences one call may pass.
MAX_STOP_SEQUENCES = 32
#: Most characters in one stop sequence (the stopping criterion's tables grow with it).
MAX_STOP_CHARS = 200
#: Seeds are unsigned 64-bit integers, what `torch.Generator.manual_seed` takes.
SEED_LIMIT = 1 << 64


def check_text(text: str, what: str = "text") -> str:
    """Return ``text`` if it is a str of valid Unicode, else raise one clear error.

    A lone surrogate (U+D800..U+DFFF, what ``surrogateescape`` makes of undecodable bytes) cannot
    be encoded as UTF-8, so no tokenizer can read it.
    """
    if not isinstance(text, str):
        raise TypeError(f"{what} must be a str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        char = text[error.start]
        raise ValueError(
            f"{what} is not valid Unicode: lone surrogate U+{ord(char):04X} at character "
            f"{error.start} (undecodable bytes? decode the input as UTF-8 first)"
        ) from None
    return text


def check_texts(texts: object, what: str = "documents") -> list[str]:
    """Return ``texts`` as a list if it is a list (or other sequence) of str, else raise.

    A str is refused (iterating it would make one document of each character), and so is an
    item that is not a str, named by its index.
    """
    if isinstance(texts, (str, bytes)):
        raise TypeError(
            f"{what} must be a list of str, got a single {type(texts).__name__} (pass [text] "
            "for one document)"
        )
    if not isinstance(texts, Iterable) or isinstance(texts, (dict, set, frozenset)):
        raise TypeError(f"{what} must be a list of str, got {type(texts).__name__}")
    items = list(texts)
    for index, item in enumerate(items):
        if not isinstance(item, str):
            raise TypeError(f"{what}[{index}] must be a str, got {type(item).__name__}")
    return items


def check_count(value: object, what: str) -> int:
    """Return ``value`` if it is an int of at least 1, else raise one clear error."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{what} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{what} must be at least 1, got {value}")
    return int(value)


def check_cancel(cancel: object) -> None:
    """Refuse a ``cancel`` that is not a `threading.Event` or None (before any model work)."""
    if cancel is not None and not isinstance(cancel, threading.Event):
        raise TypeError(f"cancel must be a threading.Event or None, got {type(cancel).__name__}")


def check_prompt(prompt: object, what: str = "prompt") -> None:
    """Refuse a prompt that is neither a str nor a list of segments (before any model work)."""
    if not isinstance(prompt, (str, Sequence)) or isinstance(prompt, (bytes, bytearray)):
        raise TypeError(f"{what} must be a str or a list of segments, got {type(prompt).__name__}")


@dataclass(frozen=True)
class ContextWindow:
    """A model's context window, which every prompt and document must fit (0: no limit)."""

    tokens: int
    #: Characters of the vocabulary's longest token: no token covers more.
    max_token_chars: int
    #: The model's name, to say whose window a text does not fit.
    model: str

    def check_chars(self, chars: int, what: str | None = None) -> None:
        """Refuse, before tokenizing it, a text too long to fit the context window in any case.

        No token covers more characters than the vocabulary's longest token, so a text longer
        than that many characters per position of the window cannot fit: tokenizing megabytes
        only to reject them would cost seconds and gigabytes.
        """
        limit = self.tokens
        if not limit:
            return
        if chars > limit * self.max_token_chars:
            raise ValueError(
                f"{what or 'prompt'} of {chars:,} characters is longer than {self.model}'s "
                f"context window of {limit} tokens can hold (at most {self.max_token_chars} "
                "characters a token)"
            )

    def check_length(self, tokens: int, what: str | None = None, *, at_least: bool = False) -> None:
        """Refuse a text of ``tokens`` tokens (``at_least``: or more) that cannot fit the window."""
        limit = self.tokens
        if limit and tokens > limit:
            count = f"at least {tokens:,}" if at_least else f"{tokens:,}"
            raise ValueError(
                f"{what or 'prompt'} of {count} tokens is longer than {self.model}'s context "
                f"window of {limit} tokens"
            )


#: Tokens a prefix cut before a space may have beyond the whole text's first tokens (a word cut
#: in two is tokenized apart from what follows it).
PREFIX_SLACK = 8


def tokens_beyond(
    tokenize: Callable[[str], Sequence[int]], text: str, limit: int
) -> tuple[int, bool] | None:
    """Tell, tokenizing as little of ``text`` as it can, whether it has more than ``limit`` tokens.

    Tokenizes prefixes of ``text`` cut before a whitespace character, from about 4 characters a
    token of ``limit`` on, doubling while they fit: a text far over the limit is refused after
    tokenizing about ``limit`` tokens of it, not its megabytes. Returns ``(tokens, exact)``: the
    whole text's count (``exact``), or a lower bound from a prefix (its count less
    `PREFIX_SLACK`); None when the whole text has at most ``limit`` tokens.
    """
    size = 4 * (limit + PREFIX_SLACK + 1)
    while size < len(text):
        cut = max(text.rfind(" ", size // 2, size), text.rfind("\n", size // 2, size))
        if cut > 0:
            counted = len(tokenize(text[:cut])) - PREFIX_SLACK
            if counted > limit:
                return counted, False
        size *= 2
    counted = len(tokenize(text))
    return (counted, True) if counted > limit else None


def longest_token_chars(tokenizer: Any) -> int:
    """Characters of the tokenizer's longest vocabulary entry (64 when it has no vocabulary)."""
    vocabulary = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    return max((len(token) for token in vocabulary), default=64) or 64


def check_stop(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    """Normalize ``stop`` to a tuple of stop sequences.

    A str is one stop sequence (not a sequence of one-character ones); an empty stop sequence
    would match at once and is refused.
    """
    if stop is None:
        return ()
    items: Sequence[object] = (stop,) if isinstance(stop, str) else stop
    if not isinstance(items, Sequence):
        raise TypeError(f"stop must be a str or a list of str, got {type(stop).__name__}")
    if len(items) > MAX_STOP_SEQUENCES:
        raise ValueError(f"too many stop sequences: {len(items)} (at most {MAX_STOP_SEQUENCES})")
    result = []
    for item in items:
        if not isinstance(item, str):
            raise TypeError(f"stop sequences must be str, got {type(item).__name__}: {short(item)}")
        if not item:
            raise ValueError("stop sequences must be non-empty; an empty one would stop at once")
        if len(item) > MAX_STOP_CHARS:
            raise ValueError(
                f"stop sequence {short(item)} has {len(item):,} characters "
                f"(at most {MAX_STOP_CHARS})"
            )
        result.append(check_text(item, "stop sequence"))
    return tuple(dict.fromkeys(result))


def check_sampling(max_new_tokens: int, temperature: float, top_p: float) -> None:
    """Refuse settings that would decode nothing or sample from a broken distribution."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral):
        raise TypeError(f"max_new_tokens must be an int, got {type(max_new_tokens).__name__}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    for name, value in (("temperature", temperature), ("top_p", top_p)):
        if not _is_number(value):
            raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be a number in (0, 1], got {top_p!r}")


def check_seed(seed: object) -> None:
    """Refuse a seed that is not None or an int in 0..2**64-1."""
    if seed is None:
        return
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
    if not 0 <= int(seed) < SEED_LIMIT:
        raise ValueError(f"seed must be in 0..2**64-1, got {seed}")


def check_generation(
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    stop: str | Sequence[str] | None,
    seed: object,
) -> tuple[str, ...]:
    """Check every decoding argument at once, before any model work; return the stop tuple."""
    check_sampling(max_new_tokens, temperature, top_p)
    check_seed(seed)
    return check_stop(stop)


def short(value: object, chars: int = 40) -> str:
    """Return a repr of ``value`` cut to about ``chars`` characters, to name it in one line."""
    text = repr(value[: chars + 1] if isinstance(value, str) else value)
    return text if len(text) <= chars + 2 else f"{text[:chars]}...{text[-1]}"


def snippet(text: str, width: int = 48) -> str:
    """Return the text's repr, cut to about ``width`` characters."""
    if len(text) <= width:
        return repr(text)
    return repr(text[: width - 3]) + "..."


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_hf_options(top_k: int, repetition_penalty: float, do_sample: bool | None) -> None:
    """Refuse transformers-style generation options outside the ranges transformers accepts."""
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0: no top-k filtering), got {top_k!r}")
    if not _is_number(repetition_penalty) or not (
        math.isfinite(repetition_penalty) and repetition_penalty > 0
    ):
        raise ValueError(
            f"repetition_penalty must be a finite number > 0 (1: none), got {repetition_penalty!r}"
        )
    if do_sample is not None and not isinstance(do_sample, bool):
        raise TypeError(f"do_sample must be True, False or None, got {type(do_sample).__name__}")
