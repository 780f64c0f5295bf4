"""Decoding options turned into transformers' settings: a greedy config over its processors.

`DecodeOptions` are the keyword arguments of `BlendEngine.generate` and `BlendEngine.stream`;
`decode_plan` checks them and makes the `DecodePlan` that single-prompt decoding
(`generation.py`) and batched decoding (`batch.py`) share: a `GenerationConfig`, the logits
processors, the end-of-sequence ids, the stop strings and the decode cache's kind.

Sampling draws from a `torch.Generator` of the call (seeded by ``seed``), never from the
process-wide RNG, so seeded calls on several threads each get their own reproducible text:
`generate` runs greedy over scores where `SeededSampler` has already kept only the token it
drew.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from kvblend.decoding.cache import DecodeCache, check_environment
from kvblend.validation import check_generation, check_hf_options, check_sampling, check_stop

__all__ = ["DecodeOptions", "DecodePlan", "SeededSampler", "decode_plan"]


@dataclass(frozen=True)
class DecodeOptions:
    """How to decode: the keyword arguments of `BlendEngine.generate` and `BlendEngine.stream`.

    The names and meanings are transformers' `GenerationConfig` ones. ``do_sample=None`` samples
    when ``temperature > 0``; ``do_sample=True`` with ``temperature=0`` samples at temperature 1
    (transformers' default); ``do_sample=False`` decodes greedily whatever the temperature.
    ``top_k=0`` and ``repetition_penalty=1`` switch those processors off.
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    do_sample: bool | None = None
    stop: str | Sequence[str] | None = None
    seed: int | None = None

    def check(self) -> None:
        """Refuse any option out of range, with one line (before any model work)."""
        check_generation(self.max_new_tokens, self.temperature, self.top_p, self.stop, self.seed)
        check_hf_options(self.top_k, self.repetition_penalty, self.do_sample)
        check_environment()

    @property
    def samples(self) -> bool:
        """Whether tokens are drawn at random (else greedy)."""
        return self.do_sample if self.do_sample is not None else self.temperature > 0


@dataclass
class DecodePlan:
    """The decoding settings shared by `decode`, `decode_stream` and `decode_batch`."""

    config: GenerationConfig  # greedy over the processed scores (see `SeededSampler`)
    eos_ids: frozenset[int]
    stop: tuple[str, ...]
    processors: LogitsProcessorList  # repetition penalty, then the sampler when sampling
    device: torch.device
    cache: DecodeCache  # the cache kind decoding continues from


class SeededSampler(LogitsProcessor):
    """Draw the next token with the call's own generators; leave only that token possible.

    Applies transformers' temperature, top-k and top-p warpers, samples one token per row (row
    ``i`` with ``generators[i]``, or the one generator for every row), and returns scores that
    are ``-inf`` everywhere else, so greedy decoding in `generate` picks exactly the drawn token.
    """

    def __init__(
        self, temperature: float, top_k: int, top_p: float, generators: list[torch.Generator]
    ) -> None:
        self.warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
        if top_k > 0:
            self.warpers.append(TopKLogitsWarper(top_k))
        if top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(top_p))
        self.generators = generators

    def draw(self, scores: torch.Tensor) -> torch.Tensor:
        """Token ids ``[batch]`` drawn from ``scores`` ``[batch, vocab]``."""
        probs = torch.softmax(self.warpers(None, scores.float()), dim=-1)  # type: ignore[arg-type]
        if len(self.generators) == 1:
            return torch.multinomial(probs, 1, generator=self.generators[0])[:, 0]
        rows = [
            torch.multinomial(row[None], 1, generator=generator)[0]
            for row, generator in zip(probs, self.generators, strict=True)
        ]
        return torch.cat(rows)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """Keep only the drawn token of each row (greedy decoding then takes it)."""
        chosen = self.draw(scores)
        out = torch.full_like(scores, float("-inf"))
        out.scatter_(1, chosen[:, None], 0.0)
        return out  # type: ignore[return-value]  # FloatTensor is a Tensor alias for typing


def _generator(device: torch.device, seed: int | None) -> torch.Generator:
    """Return a generator of its own: seeded, or fresh entropy (the global RNG is untouched)."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(int(seed))
    return generator


def decode_plan(
    model: Any, tokenizer: Any, prompt_tokens: int, options: DecodeOptions, rows: int = 1
) -> DecodePlan:
    """Check ``options`` and turn them into a greedy config over transformers' processors.

    ``rows > 1`` (batched decoding) gives each row a generator seeded like a call of its own.
    """
    check_sampling(options.max_new_tokens, options.temperature, options.top_p)
    check_hf_options(options.top_k, options.repetition_penalty, options.do_sample)
    stops = check_stop(options.stop)
    max_new_tokens = options.max_new_tokens
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit and prompt_tokens + max_new_tokens > limit:
        max_new_tokens = max(1, limit - prompt_tokens)
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    device = next(model.parameters()).device
    processors = LogitsProcessorList()
    if options.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(float(options.repetition_penalty)))
    if options.samples:
        temperature = float(options.temperature) or 1.0  # do_sample=True at temperature 0
        generators = [_generator(device, options.seed) for _ in range(rows)]
        processors.append(
            SeededSampler(temperature, int(options.top_k), float(options.top_p), generators)
        )
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        temperature=None,
        top_p=None,
        top_k=None,
        eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos,
    )
    cache = DecodeCache.choose(device)
    cache.configure(config)
    eos_ids = frozenset(eos if isinstance(eos, list) else ([] if eos is None else [eos]))
    return DecodePlan(config, eos_ids, stops, processors, device, cache)
