"""Decoding from a fused KV cache through transformers' own `generate`.

The blended prefill leaves rotated K and V for every prompt token and the next-token logits
after the prompt. The first new token is picked from those logits through the same transformers
logits processors `generate` then uses for every later token (repetition penalty; temperature,
top-k and top-p warpers when sampling), so the time to the first token is the prefill and
nothing more. Transformers' `generate` then continues from a cache of the whole prompt
(`cache.py`: a `StaticCache` sized for the answer, written in place) with the first
token as its only new input: stop strings and streaming of every later token are transformers'.

Asked for (``margins``), the margins of the first new tokens' distributions (the most likely
token's probability minus the second's) are recorded from the logits decoding makes anyway: the
prefill's for the first token, then a logits processor that sees each step's logits before the
others and returns them unchanged (`MarginRecorder`). They stay on the device until decoding
ends and are read once with the answer.

Sampling draws from generators of the call (`kvblend.decoding.options`), never from the
process-wide RNG. A stream closed early sets an event that a stopping criterion checks after
every token, so decoding stops within one token instead of running to ``max_new_tokens`` in the
background.
"""

from __future__ import annotations

import copy
import threading
import time
import warnings
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
    TextIteratorStreamer,
)

from kvblend.blend.guard import top_margin
from kvblend.decoding.options import DecodeOptions, DecodePlan, decode_plan
from kvblend.errors import BlendCancelledError

__all__ = [
    "GenerationResult",
    "MarginRecorder",
    "check_margins",
    "cut_at_stop",
    "decode",
    "decode_stream",
    "generate_from_cache",
    "stop_criteria",
]

# transformers' StopStringCriteria scans the whole vocabulary when it is built (0.75 s for a
# 151K-token Qwen2.5 vocabulary), and `generate(stop_strings=...)` builds one per call. It is
# stateless once built, so one per tokenizer and stop tuple is kept here.
_STOP_CRITERIA: weakref.WeakKeyDictionary[Any, dict[tuple[str, ...], StopStringCriteria]] = (
    weakref.WeakKeyDictionary()
)
_STOP_LOCK = threading.Lock()


def stop_criteria(tokenizer: Any, stop: tuple[str, ...]) -> StopStringCriteria:
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
    #: Prompts decoded together with this one (`BlendEngine.generate_batch`), itself included;
    #: in a batch ``ttft_s`` is the batch's (every prompt prefilled first) and
    #: ``stats.timings["prefill_s"]`` this prompt's own prefill.
    batch_size: int = 1
    #: The most likely token's probability minus the second's, in the model's next-token
    #: distribution before each of the first new tokens (``generate(margins=n)``: n of them,
    #: fewer when the answer ends first; empty when not asked).
    margins: list[float] = field(default_factory=list)

    @property
    def output_tokens(self) -> int:
        """Number of generated tokens."""
        return len(self.token_ids)


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


def check_margins(margins: object) -> int:
    """Return ``margins`` if it is an int >= 0 (the new tokens whose margins are recorded)."""
    if isinstance(margins, bool) or not isinstance(margins, int) or margins < 0:
        raise ValueError(f"margins must be an int >= 0, got {margins!r}")
    return margins


class MarginRecorder(LogitsProcessor):
    """Record the top-1 minus top-2 probability of the first ``steps`` distributions it sees.

    As `generate`'s first logits processor it sees each step's logits as the model made them
    and returns them unchanged; each margin stays on the device (`top_margin`) until `read`.
    `record` takes a distribution seen elsewhere (the prefill's, for the first token).
    """

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.margins: list[torch.Tensor] = []

    def record(self, logits: torch.Tensor) -> None:
        """Keep the margin of ``logits`` (``[vocab]``, or the first row of ``[rows, vocab]``)."""
        if len(self.margins) < self.steps:
            self.margins.append(top_margin(logits.reshape(-1, logits.shape[-1])[0]))

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """Record the step's margin; return ``scores`` as they came."""
        self.record(scores)
        return scores

    def read(self) -> list[float]:
        """Return the margins recorded, in order (one read from the device)."""
        return torch.stack(self.margins).tolist() if self.margins else []


def _first_token(logits: torch.Tensor, token_ids: Sequence[int], plan: DecodePlan) -> int:
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
    plan: DecodePlan,
    cancel: threading.Event | None = None,
) -> dict[str, Any] | None:
    """`generate` arguments that decode after ``first``, or None when ``first`` ends it."""
    config = plan.config
    if first in plan.eos_ids or config.max_new_tokens <= 1:
        return None
    if plan.stop and cut_at_stop(tokenizer.decode([first]), plan.stop)[1]:
        return None
    config = copy.deepcopy(config)
    config.max_new_tokens -= 1
    criteria: list[StoppingCriteria] = [stop_criteria(tokenizer, plan.stop)] if plan.stop else []
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


def generate_from_cache(model: Any, kwargs: dict[str, Any]) -> Any:
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


def cut_at_stop(text: str, stop: tuple[str, ...]) -> tuple[str, bool]:
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
    margins: int = 0,
    **options: Any,
) -> GenerationResult:
    """Decode after a blended prefill that began at ``started`` (a perf_counter time).

    ``options`` are `DecodeOptions` fields: ``stop`` is one stop sequence (a str) or several;
    ``seed`` seeds this call's own sampler. ``cancel``, once set, stops decoding after the
    current token (`BlendCancelledError`). ``margins``: how many of the first new tokens'
    margins to record (`GenerationResult.margins`; 0: none).
    """
    plan = decode_plan(model, tokenizer, len(token_ids), DecodeOptions(**options))
    first = _first_token(logits, token_ids, plan)
    first_at = time.perf_counter()
    new_ids = [first]
    recorder = MarginRecorder(check_margins(margins)) if margins else None
    if recorder is not None:
        recorder.record(logits)  # the first token's distribution: the prefill's
    kwargs = _continue_kwargs(model, tokenizer, token_ids, first, keys, values, plan, cancel)
    if kwargs is not None:
        if recorder is not None and margins > 1:  # first: it sees the model's own logits
            kwargs["logits_processor"] = LogitsProcessorList([recorder, *plan.processors])
        with torch.inference_mode():
            output = generate_from_cache(model, kwargs)
        new_ids = output[0, len(token_ids) :].tolist()
    if cancel is not None and cancel.is_set():
        raise BlendCancelledError("the generation was cancelled")
    text, stopped = cut_at_stop(tokenizer.decode(new_ids, skip_special_tokens=True), plan.stop)
    finished = stopped or new_ids[-1] in plan.eos_ids
    end = time.perf_counter()
    return GenerationResult(
        text=text,
        token_ids=new_ids,
        ttft_s=first_at - started,
        total_s=end - started,
        stats=stats,
        finish_reason="stop" if finished else "length",
        margins=recorder.read() if recorder is not None else [],
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
    plan = decode_plan(model, tokenizer, len(token_ids), DecodeOptions(**options))
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
                generate_from_cache(model, {**kwargs, "streamer": streamer})
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
        text, stopped = cut_at_stop(held, stop)
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
