"""Decoding several prefilled prompts at once: one transformers `generate` over padded caches.

Each prompt keeps its own blended prefill; decoding is what batches well (one step reads the
weights once for every row). The fused caches are left-padded to one length, put in one cache
of the plan's kind (`decode_cache.py`: static unless asked otherwise) and `generate` gets
an attention mask, from which it derives each row's positions (``cumsum(mask) - 1``): a row's
real tokens keep positions ``0..n-1``, exactly those its cached keys were rotated at, so every
row decodes as it would alone. Padding repeats the row's own first token (masked out), so a
repetition penalty sees the same token set as the row alone; each row samples with a generator
seeded like a call of its own. A stopping criterion records when each row ends, since `generate`
keeps padding finished rows until the last one is done.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from typing import Any

import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.cache_utils import Cache

from kvblend.decoding.generation import (
    GenerationResult,
    cut_at_stop,
    generate_from_cache,
    stop_criteria,
)
from kvblend.decoding.options import DecodeOptions, DecodePlan, SeededSampler, decode_plan

__all__ = ["decode_batch"]


class _RowEnds(StoppingCriteria):
    """Stop rows on stop strings, and remember the length at which each row first stopped."""

    def __init__(self, inner: StoppingCriteria | None, rows: int) -> None:
        self.inner = inner
        self.ends: list[int | None] = [None] * rows

    def __call__(
        self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any
    ) -> torch.BoolTensor:
        if self.inner is None:
            done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        else:
            done = self.inner(input_ids, scores, **kwargs)
        for row in torch.nonzero(done).flatten().tolist():
            if self.ends[row] is None:
                self.ends[row] = int(input_ids.shape[1])
        return done  # type: ignore[return-value]


def _padded(rows: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token rows with each row's own first token; return ids and attention mask."""
    width = max(len(row) for row in rows)
    ids = torch.tensor([[row[0]] * (width - len(row)) + list(row) for row in rows])
    mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows])
    return ids, mask


def _padded_cache(model: Any, prefills: Sequence[Any], width: int, plan: DecodePlan) -> Cache:
    """Build one cache of every row's keys and values, left-padded with zeros to ``width``."""

    def stacked(tensors: list[torch.Tensor]) -> torch.Tensor:
        pad = torch.nn.functional.pad
        return torch.stack([pad(t, (0, 0, width - t.shape[1], 0)) for t in tensors])

    layers = range(len(prefills[0].keys))
    keys = [stacked([p.keys[layer] for p in prefills]) for layer in layers]
    values = [stacked([p.values[layer] for p in prefills]) for layer in layers]
    return plan.cache.build(model, keys, values, plan.config.max_new_tokens)


def _first_tokens(prefills: Sequence[Any], plan: DecodePlan) -> list[int]:
    """Each row's first new token from its own prefill logits, through the plan's processors."""
    scores = torch.stack([p.logits.float() for p in prefills]).to(plan.device)
    if plan.processors:
        ids, _ = _padded([p.token_ids for p in prefills])
        scores = plan.processors(ids.to(plan.device), scores)  # type: ignore[arg-type]
    return [int(t) for t in scores.argmax(dim=-1)]


def _continuing(first: list[int], plan: DecodePlan, tokenizer: Any) -> list[int]:
    """Rows whose answer goes on after the first token."""
    if plan.config.max_new_tokens <= 1:
        return []
    rows = []
    for row, token in enumerate(first):
        if token in plan.eos_ids:
            continue
        if plan.stop and cut_at_stop(tokenizer.decode([token]), plan.stop)[1]:
            continue
        rows.append(row)
    return rows


def _decode_rows(
    model: Any, tokenizer: Any, prefills: Sequence[Any], first: list[int], plan: DecodePlan
) -> list[list[int]]:
    """Decode the given rows after their first tokens in one batched `generate`."""
    rows = [[*p.token_ids, token] for p, token in zip(prefills, first, strict=True)]
    input_ids, mask = _padded(rows)
    device = prefills[0].keys[0].device
    ends = _RowEnds(stop_criteria(tokenizer, plan.stop) if plan.stop else None, len(rows))
    config = copy.deepcopy(plan.config)
    config.max_new_tokens -= 1
    eos = sorted(plan.eos_ids)
    if eos:
        config.pad_token_id = eos[0]  # a finished row is padded with EOS: cut at the first one
    with torch.inference_mode():
        output = generate_from_cache(
            model,
            {
                "input_ids": input_ids.to(device),
                "attention_mask": mask.to(device),
                "past_key_values": _padded_cache(model, prefills, input_ids.shape[1] - 1, plan),
                "generation_config": config,
                "stopping_criteria": StoppingCriteriaList([ends]),
                "logits_processor": plan.processors,
            },
        )
    width = input_ids.shape[1]
    result = []
    for row in range(len(rows)):
        tokens = output[row, width : ends.ends[row] or output.shape[1]].tolist()
        cut = next((i + 1 for i, t in enumerate(tokens) if t in plan.eos_ids), len(tokens))
        result.append(tokens[:cut])
    return result


def decode_batch(
    model: Any, tokenizer: Any, prefills: Sequence[Any], *, started: float, **options: Any
) -> list[GenerationResult]:
    """Decode prefilled prompts together; each result equals the prompt's own `decode`.

    ``prefills`` are `PrefillResult`s sharing one device; ``options`` are `DecodeOptions`
    fields, common to every row. Prompts whose output budget is clamped by the model's context
    window should be decoded alone (`BlendEngine.generate_batch` does so).
    """
    options_ = DecodeOptions(**options)
    longest = max(len(p.token_ids) for p in prefills)
    plan = decode_plan(model, tokenizer, longest, options_, rows=len(prefills))
    sampler = next((p for p in plan.processors if isinstance(p, SeededSampler)), None)
    first = _first_tokens(prefills, plan)
    first_at = time.perf_counter()
    news: list[list[int]] = [[token] for token in first]
    going = _continuing(first, plan, tokenizer)
    if going:
        if sampler is not None:
            sampler.generators = [sampler.generators[row] for row in going]
        chosen = [prefills[row] for row in going]
        for row, tokens in zip(
            going,
            _decode_rows(model, tokenizer, chosen, [first[r] for r in going], plan),
            strict=True,
        ):
            news[row] += tokens
    end = time.perf_counter()
    results = []
    for prefill, new_ids in zip(prefills, news, strict=True):
        text, stopped = cut_at_stop(tokenizer.decode(new_ids, skip_special_tokens=True), plan.stop)
        finished = stopped or new_ids[-1] in plan.eos_ids
        results.append(
            GenerationResult(
                text=text,
                token_ids=new_ids,
                ttft_s=first_at - started,
                total_s=end - started,
                stats=prefill.stats,
                finish_reason="stop" if finished else "length",
                batch_size=len(prefills),
            )
        )
    return results
