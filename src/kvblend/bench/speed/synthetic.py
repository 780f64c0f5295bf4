"""Deterministic synthetic prose of a target token length, for timing benchmarks.

The text need not mean anything: only its length matters to TTFT. Sentences are drawn from a
fixed word list by a seeded `random.Random`, so the same seed gives the same documents anywhere.
"""

from __future__ import annotations

import random
from typing import Any

_SUBJECTS = (
    "the council", "a small team", "the old harbour", "our neighbours", "the river", "a traveller",
    "the library", "the committee", "a young engineer", "the market", "the orchestra", "a farmer",
    "the museum", "the northern valley", "a quiet village", "the research group",
)  # fmt: skip
_VERBS = (
    "described", "rebuilt", "measured", "visited", "painted", "discussed", "planned", "opened",
    "followed", "changed", "studied", "recorded", "protected", "welcomed", "explored", "repaired",
)  # fmt: skip
_OBJECTS = (
    "the stone bridge", "a new schedule", "the winter festival", "several maps", "the west tower",
    "an early report", "the garden paths", "a long letter", "the copper roof", "the spring harvest",
    "a wooden boat", "the city archive", "the mountain road", "a careful survey", "the clock",
)  # fmt: skip
_TAILS = (
    "before the rain began", "after a long debate", "with great care", "in the early morning",
    "during the summer", "for the first time", "without much help", "near the eastern gate",
    "as the records show", "over several weeks", "under a grey sky", "with quiet confidence",
)  # fmt: skip


def synthetic_sentence(rng: random.Random) -> str:
    """One random sentence."""
    sentence = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
    if rng.random() < 0.7:
        sentence += f" {rng.choice(_TAILS)}"
    return sentence[0].upper() + sentence[1:] + "."


def synthetic_text(tokenizer: Any, target_tokens: int, seed: int) -> str:
    """Prose of about ``target_tokens`` tokens under ``tokenizer`` (cut at a token boundary)."""
    if target_tokens < 1:
        raise ValueError(f"target_tokens must be at least 1, got {target_tokens}")
    rng = random.Random(seed)
    words: list[str] = []
    # about 1.3 tokens per word in English prose; overshoot, then cut at the target token
    while len(words) < target_tokens * 1.2 + 8:
        words.extend(synthetic_sentence(rng).split())
    text = " ".join(words)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = encoded["offset_mapping"]
    if len(offsets) <= target_tokens:
        return text
    return text[: offsets[target_tokens - 1][1]].rstrip()
