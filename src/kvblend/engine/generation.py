"""Decoding from a fused KV cache through transformers' own `generate`.

The blended prefill leaves rotated K and V for every prompt token and the next-token logits
after the prompt. The first new token is picked from those logits through the same transformers
logits processors `generate` then uses for every later token (repetition penalty; temperature,
top-k and top-p warpers when sampling), so the time to the first token is the prefill and
nothing more. Transformers' `generate` then continues from a cache of the whole prompt
(`decode_cache.py`: a `StaticCache` sized for the answer, written in place) with the first
token as its only new input: stop strings and streaming of every later token are transformers'.

Sampling draws from a `torch.Generator` of the call (seeded by ``seed``), never from the
process-wide RNG, so seeded calls on several threads each get their own reproducible text:
`generate` runs greedy over scores where `_SeededSampler` has already kept only the token it
drew. A stream closed early sets an event that a stopping criterion checks after every token,
so decoding stops within one token instead of running to ``max_new_tokens`` in the background.
"""

from __future__ import annotations

import copy
import threading
import time
import warnings
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    StoppingCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
    TemperatureLogitsWarper,
    TextIteratorStreamer,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from .decode_cache import DecodeCache, check_environment
from .results import BlendCancelledError
from .validation import check_generation, check_hf_options, check_sampling, check_stop

# transformers' StopStringCriteria scans the whole vocabulary when it is built (0.75 s for a
# 151K-token Qwen2.5 vocabulary), and `generate(stop_strings=...)` builds one per call. It is
# stateless once built, so one per tokenizer and stop tuple is kept here.
_STOP_CRITERIA: weakref.WeakKeyDictionary[Any, dict[tuple[str, ...], StopStringCriteria]] = (
    weakref.WeakKeyDictionary()
)
_STOP_LOCK = threading.Lock()


def _stop_criteria(tokenizer: Any, stop: tuple[str, ...]) -> StopStringCriteria:
    """Return the (cached) transformers stopping criterion for ``stop`` over ``tokenizer``."""
    with _STOP_LOCK:
        per_tokenizer = _STOP_CRITERIA.setdefault(tokenizer, {})
        criteria = per_tokenizer.get(stop)
        if criteria is None:
            criteria = StopStringCriteria(tokenizer, list(stop))
            if len(per_tokenizer) >= 32:
                per_tokenizer.pop(next(iter(per_tokenizer)))
            per_tokenizer[stop] = criteria
        return criteria


@dataclass
class GenerationResult:
    """Generated text with timing and the prefill's stats."""

    text: str
    token_ids: list[int]
    ttft_s: float  # from the call until the first new token's logits
    total_s: float
    stats: Any  # BlendStats of the prefill
    finish_reason: str  # "stop" (EOS or stop string) or "length"

    @property
    def output_tokens(self) -> int:
        """Number of generated tokens."""
        return len(self.token_ids)


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
class _Plan:
    """The decoding settings shared by `decode` and `decode_stream`."""

    config: GenerationConfig  # greedy over the processed scores (see `_SeededSampler`)
    eos_ids: frozenset[int]
    stop: tuple[str, ...]
    processors: LogitsProcessorList  # repetition penalty, then the sampler when sampling
    device: torch.device
    cache: DecodeCache  # the cache kind decoding continues from


class _SeededSampler(LogitsProcessor):
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
        chosen = self.draw(scores)
        out = torch.full_like(scores, float("-inf"))
        out.scatter_(1, chosen[:, None], 0.0)
        return out  # type: ignore[return-value]  # FloatTensor is a Tensor alias for typing


class _Cancelled(StoppingCriteria):
    """Stop `generate` once ``event`` is set (the stream's consumer went away)."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def __call__(
        self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any
    ) -> torch.BoolTensor:
        done = self.event.is_set()
        return torch.full(  # type: ignore[return-value]  # BoolTensor is a Tensor alias
            (input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device
        )


def _generator(device: torch.device, seed: int | None) -> torch.Generator:
    """Return a generator of its own: seeded, or fresh entropy (the global RNG is untouched)."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(int(seed))
    return generator


def _plan(
    model: Any, tokenizer: Any, prompt_tokens: int, options: DecodeOptions, rows: int = 1
) -> _Plan:
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
            _SeededSampler(temperature, int(options.top_k), float(options.top_p), generators)
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
    return _Plan(config, eos_ids, stops, processors, device, cache)


def _first_token(logits: torch.Tensor, token_ids: Sequence[int], plan: _Plan) -> int:
    """Pick the first new token from the prefill's logits as `generate` would."""
    scores = logits.float()[None].to(plan.device)
    if plan.processors:
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=plan.device)
        scores = plan.processors(ids, scores)  # type: ignore[arg-type]
    return int(scores[0].argmax())


def _continue_kwargs(
    model: Any,
    tokenizer: Any,
    token_ids: Sequence[int],
    first: int,
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    plan: _Plan,
    cancel: threading.Event | None = None,
) -> dict[str, Any] | None:
    """`generate` arguments that decode after ``first``, or None when ``first`` ends it."""
    config = plan.config
    if first in plan.eos_ids or config.max_new_tokens <= 1:
        return None
    if plan.stop and _cut_at_stop(tokenizer.decode([first]), plan.stop)[1]:
        return None
    config = copy.deepcopy(config)
    config.max_new_tokens -= 1
    criteria: list[StoppingCriteria] = [_stop_criteria(tokenizer, plan.stop)] if plan.stop else []
    if cancel is not None:
        criteria.append(_Cancelled(cancel))
    input_ids = torch.tensor([[*token_ids, first]], dtype=torch.long, device=keys[0].device)
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "past_key_values": plan.cache.build(
            model, [k[None] for k in keys], [v[None] for v in values], config.max_new_tokens
        ),
        "generation_config": config,
        "stopping_criteria": StoppingCriteriaList(criteria),
        "logits_processor": plan.processors,
    }


def _generate(model: Any, kwargs: dict[str, Any]) -> Any:
    """Call ``model.generate`` with the fused cache as ``past_key_values``.

    transformers 5.x renamed that argument ``cache`` and warns about the old name on every call;
    the old name is the one every supported version accepts, so the warning is not the user's
    to read.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="`past_key_values` is deprecated", category=FutureWarning
        )
        return model.generate(**kwargs)


def _cut_at_stop(text: str, stop: tuple[str, ...]) -> tuple[str, bool]:
    """``text`` up to the first stop string, and whether one was found."""
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def decode(
    model: Any,
    tokenizer: Any,
    token_ids: Sequence[int],
    logits: torch.Tensor,
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    stats: Any,
    *,
    started: float,
    cancel: threading.Event | None = None,
    **options: Any,
) -> GenerationResult:
    """Decode after a blended prefill that began at ``started`` (a perf_counter time).

    ``options`` are `DecodeOptions` fields: ``stop`` is one stop sequence (a str) or several;
    ``seed`` seeds this call's own sampler. ``cancel``, once set, stops decoding after the
    current token (`BlendCancelledError`).
    """
    plan = _plan(model, tokenizer, len(token_ids), DecodeOptions(**options))
    first = _first_token(logits, token_ids, plan)
    first_at = time.perf_counter()
    new_ids = [first]
    kwargs = _continue_kwargs(model, tokenizer, token_ids, first, keys, values, plan, cancel)
    if kwargs is not None:
        with torch.inference_mode():
            output = _generate(model, kwargs)
        new_ids = output[0, len(token_ids) :].tolist()
    if cancel is not None and cancel.is_set():
        raise BlendCancelledError("the generation was cancelled")
    text, stopped = _cut_at_stop(tokenizer.decode(new_ids, skip_special_tokens=True), plan.stop)
    finished = stopped or new_ids[-1] in plan.eos_ids
    end = time.perf_counter()
    return GenerationResult(
        text=text,
        token_ids=new_ids,
        ttft_s=first_at - started,
        total_s=end - started,
        stats=stats,
        finish_reason="stop" if finished else "length",
    )


class _FirstTokenStreamer(TextIteratorStreamer):
    """A text streamer fed ``prompt + [first]`` first: it keeps only the first new token."""

    def put(self, value: torch.Tensor) -> None:
        if self.next_tokens_are_prompt:
            self.next_tokens_are_prompt = False
            value = value.reshape(-1)[-1:]
        super().put(value)


def decode_stream(
    model: Any,
    tokenizer: Any,
    token_ids: Sequence[int],
    logits: torch.Tensor,
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    **options: Any,
) -> Iterator[str]:
    """Yield decoded text pieces as transformers produces them, cut at the first stop string.

    Closing the iterator early (``close()``, ``break`` in a for loop, garbage collection) stops
    decoding within one token and waits for the decoding thread to finish.
    """
    plan = _plan(model, tokenizer, len(token_ids), DecodeOptions(**options))
    first = _first_token(logits, token_ids, plan)
    cancel = threading.Event()
    kwargs = _continue_kwargs(model, tokenizer, token_ids, first, keys, values, plan, cancel)
    streamer = _FirstTokenStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    failure: list[BaseException] = []

    def run() -> None:
        try:
            if kwargs is None:  # the first token ends the answer: stream it alone
                streamer.put(torch.tensor([first]))
                streamer.end()
                return
            with torch.inference_mode():
                _generate(model, {**kwargs, "streamer": streamer})
        except BaseException as error:  # noqa: BLE001 - re-raised in the consumer
            failure.append(error)
            streamer.end()

    worker = threading.Thread(target=run, name="kvblend-decode", daemon=True)
    worker.start()
    try:
        yield from _pieces(streamer, plan.stop)
    finally:
        cancel.set()  # a no-op when decoding already ended; else it stops after this token
        worker.join()
    if failure:
        raise failure[0]


def _pieces(streamer: Iterator[str], stop: tuple[str, ...]) -> Iterator[str]:
    """Text pieces of ``streamer``, holding back what may begin a stop string, cut at one."""
    held = ""  # text not yet emitted because it may begin a stop string
    longest_stop = max((len(s) for s in stop), default=0)
    for piece in streamer:
        held += piece
        text, stopped = _cut_at_stop(held, stop)
        if stopped:
            if text:
                yield text
            return
        safe = len(held) - max(0, longest_stop - 1)
        if safe > 0:
            yield held[:safe]
            held = held[safe:]
    if held:
        yield held
