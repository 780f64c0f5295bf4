"""transformers' generation options (top_k, repetition_penalty, do_sample) against `generate`.

A full prefill decoded by kvblend must give the tokens transformers' own `generate` gives over
the same prompt with the same options: the first token is drawn from the prefill's logits, so
the options must reach it too.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from conftest import byte_tokenizer, tiny_model
from kvblend import BlendConfig, BlendEngine, Segment
from kvblend.store import MemoryKVStore


@pytest.fixture(scope="module")
def engine() -> BlendEngine:
    return BlendEngine(tiny_model("llama"), byte_tokenizer(), store=MemoryKVStore())


PROMPT = [Segment("Marta lives in Lisbon. Marta lives in Lisbon."), Segment("\nWho?", cache=False)]


def _reference(engine: BlendEngine, max_new_tokens: int, **options: Any) -> list[int]:
    ids = engine.encode("".join(s.text for s in PROMPT))
    input_ids = torch.tensor([ids])
    with torch.inference_mode():
        out = engine.model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=engine.tokenizer.pad_token_id,
            **options,
        )
    return [int(t) for t in out[0, len(ids) :]]


@pytest.fixture
def favours_a(engine: BlendEngine) -> Iterator[int]:
    """Make the LM head favour "a" (a prompt token) by a margin a repetition penalty undoes."""
    token = engine.tokenizer.get_vocab()["a"]

    def hook(module: torch.nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        output = output.clone()
        output[..., token] = output.max(dim=-1).values + 0.5
        return output

    handle = engine.model.lm_head.register_forward_hook(hook)
    yield token
    handle.remove()


@pytest.mark.parametrize("penalty", [1.0, 1.3, 5.0])
def test_repetition_penalty_matches_transformers_generate(
    engine: BlendEngine, penalty: float, favours_a: int
) -> None:
    got = engine.generate(
        PROMPT, BlendConfig("full"), max_new_tokens=12, repetition_penalty=penalty
    ).token_ids
    assert got == _reference(engine, 12, repetition_penalty=penalty)
    # without a penalty "a" comes first; a strong one reaches the first token and rules it out
    if penalty in (1.0, 5.0):
        assert (got[0] == favours_a) == (penalty == 1.0)


def test_top_k_one_sampling_is_greedy_and_do_sample_false_ignores_temperature(
    engine: BlendEngine,
) -> None:
    pre = engine.prefill(PROMPT, BlendConfig("full"))
    greedy = engine.generate(pre, max_new_tokens=8).token_ids
    top1 = engine.generate(pre, max_new_tokens=8, temperature=1.5, top_k=1, seed=3).token_ids
    forced_greedy = engine.generate(pre, max_new_tokens=8, temperature=1.5, do_sample=False)
    assert top1 == greedy == forced_greedy.token_ids


def test_do_sample_at_temperature_zero_samples_at_one(engine: BlendEngine) -> None:
    pre = engine.prefill(PROMPT, BlendConfig("full"))
    sampled = engine.generate(pre, max_new_tokens=8, do_sample=True, seed=5).token_ids
    at_one = engine.generate(pre, max_new_tokens=8, temperature=1.0, seed=5).token_ids
    assert sampled == at_one
    streamed = "".join(engine.stream(pre, max_new_tokens=8, do_sample=True, top_k=20, seed=5))
    whole = engine.generate(pre, max_new_tokens=8, do_sample=True, top_k=20, seed=5)
    assert streamed == whole.text


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"top_k": -1}, "top_k must be an int >= 0"),
        ({"top_k": 2.5}, "top_k must be an int >= 0"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be a finite number > 0"),
        ({"do_sample": "yes"}, "do_sample must be True, False or None"),
    ],
)
def test_bad_options_are_one_clear_error(
    engine: BlendEngine, setting: dict[str, Any], message: str
) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        engine.generate(["q"], max_new_tokens=2, **setting)


# ---------------------------------------------------------------------------- batched decoding
DOCS = ["Marta lives in Lisbon by the river.", "Tomas bakes bread.", "The cafe opens at seven."]


def _batch_prompts() -> list[str]:
    # different lengths: the batch is left-padded, so positions must come from the mask
    return [
        f"Q{i}: " + "\n".join(DOCS[i % 3 :] + DOCS[: i % 3]) + " Who?" * (i + 1) for i in range(4)
    ]


@pytest.mark.parametrize(
    "options",
    [
        {"max_new_tokens": 16},
        {"max_new_tokens": 16, "repetition_penalty": 1.3},
        {"max_new_tokens": 16, "temperature": 1.0, "top_k": 50, "seed": 3},
        {"max_new_tokens": 1},
    ],
    ids=["greedy", "repetition-penalty", "seeded-sampling", "one-token"],
)
def test_generate_batch_equals_one_by_one(engine: BlendEngine, options: dict[str, Any]) -> None:
    engine.precompute(DOCS, progress=False)
    prompts = _batch_prompts()
    config = BlendConfig(short_document=0, min_recompute=0, full_above=1.0)
    alone = [engine.generate(prompt, config, **options) for prompt in prompts]
    together = engine.generate_batch(prompts, config, **options)
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert [(r.text, r.finish_reason) for r in together] == [
        (r.text, r.finish_reason) for r in alone
    ]
    assert [r.stats.reused_tokens for r in together] == [r.stats.reused_tokens for r in alone]
    assert all(r.stats.reused_tokens > 0 for r in together)


def test_generate_batch_rows_end_on_their_own_stop_string(engine: BlendEngine) -> None:
    prompts = _batch_prompts()
    alone = [engine.generate(prompt, max_new_tokens=16) for prompt in prompts]
    stop = alone[0].text[3:5]  # ends the first row early; the others when (if) they meet it
    assert stop
    alone = [engine.generate(prompt, max_new_tokens=16, stop=[stop]) for prompt in prompts]
    together = engine.generate_batch(prompts, max_new_tokens=16, stop=[stop])
    assert [(r.text, r.token_ids, r.finish_reason) for r in together] == [
        (r.text, r.token_ids, r.finish_reason) for r in alone
    ]
    assert together[0].finish_reason == "stop"
