"""Decoding from a fused KV cache through transformers' own `generate`.

The blended prefill leaves rotated K and V for every prompt token. We hand transformers a
`DynamicCache` holding all but the last prompt token; `generate` then runs only that last token
(which the blend always computes in full, so its logits equal the blended ones) and decodes as
usual: sampling, stop strings and streaming are transformers'.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import (
    DynamicCache,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    TextIteratorStreamer,
)


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


class _FirstTokenClock(LogitsProcessor):
    """Records when the first decoding step's logits are ready."""

    def __init__(self) -> None:
        self.first: float | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.first is None:
            self.first = time.perf_counter()
        return scores


def _cache(
    model: Any, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]
) -> DynamicCache:
    """Build a transformers cache of every prompt token but the last."""
    data = [(k[None, :, :-1], v[None, :, :-1]) for k, v in zip(keys, values, strict=True)]
    return DynamicCache(ddp_cache_data=data, config=model.config)


def _generation_kwargs(
    model: Any,
    tokenizer: Any,
    token_ids: Sequence[int],
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    stop: Sequence[str] | None,
    seed: int | None,
) -> dict[str, Any]:
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit and len(token_ids) + max_new_tokens > limit:
        max_new_tokens = max(1, limit - len(token_ids))
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
        stop_strings=list(stop) if stop else None,
    )
    device = keys[0].device
    input_ids = torch.tensor([list(token_ids)], dtype=torch.long, device=device)
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "past_key_values": _cache(model, keys, values),
        "generation_config": config,
        "tokenizer": tokenizer if stop else None,
    }


def _cut_at_stop(text: str, stop: Sequence[str] | None) -> tuple[str, bool]:
    """``text`` up to the first stop string, and whether one was found."""
    cut = min((i for i in (text.find(s) for s in stop or ()) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def decode(
    model: Any,
    tokenizer: Any,
    token_ids: Sequence[int],
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
    kwargs = _generation_kwargs(
        model, tokenizer, token_ids, keys, values, max_new_tokens, temperature, top_p, stop, seed
    )
    clock = _FirstTokenClock()
    with torch.inference_mode():
        output = model.generate(**kwargs, logits_processor=LogitsProcessorList([clock]))
    new_ids = output[0, len(token_ids) :].tolist()
    text, stopped = _cut_at_stop(tokenizer.decode(new_ids, skip_special_tokens=True), stop)
    eos = kwargs["generation_config"].eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    finished = stopped or bool(new_ids and new_ids[-1] in eos_ids)
    end = time.perf_counter()
    return GenerationResult(
        text=text,
        token_ids=new_ids,
        ttft_s=(clock.first or end) - started,
        total_s=end - started,
        stats=stats,
        finish_reason="stop" if finished else "length",
    )


def decode_stream(
    model: Any,
    tokenizer: Any,
    token_ids: Sequence[int],
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
    kwargs = _generation_kwargs(
        model, tokenizer, token_ids, keys, values, max_new_tokens, temperature, top_p, stop, seed
    )
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    failure: list[BaseException] = []

    def run() -> None:
        try:
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
