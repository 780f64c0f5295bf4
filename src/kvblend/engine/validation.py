"""Checks of what callers pass in: prompt text, stop sequences and sampling settings.

Every check raises one `ValueError` (or `TypeError` for a wrong type) that names the argument
and what is wrong with it, before any tokenizing or decoding starts, so a mistake never surfaces
as a cryptic error from deep inside a tokenizer or as silently wrong output (a ``nan``
temperature decoding greedily, an empty stop string returning empty text).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence


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
    result = []
    for item in items:
        if not isinstance(item, str):
            raise TypeError(f"stop sequences must be str, got {type(item).__name__}: {item!r}")
        if not item:
            raise ValueError("stop sequences must be non-empty; an empty one would stop at once")
        result.append(check_text(item, "stop sequence"))
    return tuple(dict.fromkeys(result))


def check_sampling(max_new_tokens: int, temperature: float, top_p: float) -> None:
    """Refuse settings that would decode nothing or sample from a broken distribution."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral):
        raise TypeError(f"max_new_tokens must be an int, got {type(max_new_tokens).__name__}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if not _is_number(temperature) or not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if not _is_number(top_p) or not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be a number in (0, 1], got {top_p!r}")


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
