"""Decoding from a fused KV cache through transformers' own `generate`.

The blended prefill leaves rotated K and V for every prompt token and the next-token logits
after the prompt. The first new token is picked from those logits (argmax, or transformers'
temperature and top-p warpers when sampling), so the time to the first token is the prefill
and nothing more. Transformers' `generate` then continues from a `DynamicCache` of the whole
prompt with the first token as its only new input: sampling, stop strings and streaming of
every later token are transformers'.
"""

from __future__ import annotations

import copy
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import (
    DynamicCache,
    GenerationConfig,
    StoppingCriteriaList,
    StopStringCriteria,
    TemperatureLogitsWarper,
    TextIteratorStreamer,
    TopPLogitsWarper,
)

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


def _cache(
    model: Any, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]
) -> DynamicCache:
    """Build a transformers cache of every prompt token."""
    data = [(k[None], v[None]) for k, v in zip(keys, values, strict=True)]
    return DynamicCache(ddp_cache_data=data, config=model.config)


@dataclass
class _Plan:
    """The decoding settings shared by `decode` and `decode_stream`."""

    config: GenerationConfig
    eos_ids: frozenset[int]
    stop: tuple[str, ...]


def _plan(
    model: Any,
    tokenizer: Any,
    prompt_tokens: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    stop: Sequence[str] | None,
    seed: int | None,
) -> _Plan:
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit and prompt_tokens + max_new_tokens > limit:
        max_new_tokens = max(1, limit - prompt_tokens)
    if seed is not None:
        torch.manual_seed(seed)
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    sampling = temperature > 0
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=sampling,
        temperature=temperature if sampling else None,
        top_p=top_p if sampling else None,
        top_k=None,
        eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos,
    )
    eos_ids = frozenset(eos if isinstance(eos, list) else ([] if eos is None else [eos]))
    return _Plan(config, eos_ids, tuple(stop or ()))


def _first_token(logits: torch.Tensor, config: GenerationConfig) -> int:
    """Pick the first new token from the prefill's logits as `generate` would."""
    if not config.do_sample:
        return int(logits.argmax())
    scores = logits.float()[None]
    scores = TemperatureLogitsWarper(config.temperature)(None, scores)
    if config.top_p is not None and config.top_p < 1.0:
        scores = TopPLogitsWarper(config.top_p)(None, scores)
    return int(torch.multinomial(torch.softmax(scores, dim=-1), 1))


def _continue_kwargs(
    model: Any,
    tokenizer: Any,
    token_ids: Sequence[int],
    first: int,
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    plan: _Plan,
) -> dict[str, Any] | None:
    """`generate` arguments that decode after ``first``, or None when ``first`` ends it."""
    config = plan.config
    if first in plan.eos_ids or config.max_new_tokens <= 1:
        return None
    if plan.stop and _cut_at_stop(tokenizer.decode([first]), plan.stop)[1]:
        return None
    config = copy.deepcopy(config)
    config.max_new_tokens -= 1
    input_ids = torch.tensor([[*token_ids, first]], dtype=torch.long, device=keys[0].device)
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "past_key_values": _cache(model, keys, values),
        "generation_config": config,
        "stopping_criteria": StoppingCriteriaList(
            [_stop_criteria(tokenizer, plan.stop)] if plan.stop else []
        ),
    }


def _cut_at_stop(text: str, stop: Sequence[str] | None) -> tuple[str, bool]:
    """``text`` up to the first stop string, and whether one was found."""
    cut = min((i for i in (text.find(s) for s in stop or ()) if i >= 0), default=-1)
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
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    stop: Sequence[str] | None = None,
    seed: int | None = None,
) -> GenerationResult:
    """Decode after a blended prefill that began at ``started`` (a perf_counter time)."""
    plan = _plan(model, tokenizer, len(token_ids), max_new_tokens, temperature, top_p, stop, seed)
    first = _first_token(logits, plan.config)
    first_at = time.perf_counter()
    new_ids = [first]
    kwargs = _continue_kwargs(model, tokenizer, token_ids, first, keys, values, plan)
    if kwargs is not None:
        with torch.inference_mode():
            output = model.generate(**kwargs)
        new_ids = output[0, len(token_ids) :].tolist()
    text, stopped = _cut_at_stop(tokenizer.decode(new_ids, skip_special_tokens=True), stop)
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
    *,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    stop: Sequence[str] | None = None,
    seed: int | None = None,
) -> Iterator[str]:
    """Yield decoded text pieces as transformers produces them, cut at the first stop string."""
    plan = _plan(model, tokenizer, len(token_ids), max_new_tokens, temperature, top_p, stop, seed)
    first = _first_token(logits, plan.config)
    kwargs = _continue_kwargs(model, tokenizer, token_ids, first, keys, values, plan)
    streamer = _FirstTokenStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    failure: list[BaseException] = []

    def run() -> None:
        try:
            if kwargs is None:  # the first token ends the answer: stream it alone
                streamer.put(torch.tensor([first]))
                streamer.end()
                return
            with torch.inference_mode():
                model.generate(**kwargs, streamer=streamer)
        except BaseException as error:  # noqa: BLE001 - re-raised in the consumer
            failure.append(error)
            streamer.end()

    worker = threading.Thread(target=run, name="kvblend-decode", daemon=True)
    worker.start()
    held = ""  # text not yet emitted because it may begin a stop string
    longest_stop = max((len(s) for s in stop or ()), default=0)
    for piece in streamer:
        held += piece
        text, stopped = _cut_at_stop(held, stop)
        if stopped:
            if text:
                yield text
            break
        safe = len(held) - max(0, longest_stop - 1)
        if safe > 0:
            yield held[:safe]
            held = held[safe:]
    else:
        if held:
            yield held
    worker.join()
    if failure:
        raise failure[0]
