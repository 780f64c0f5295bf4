"""Decode-step margins: the model's top-1 minus top-2 probability before each new token,
recorded from the logits decoding makes, against transformers' own `generate` logits."""

from __future__ import annotations

import pytest
import torch

from conftest import byte_tokenizer, tiny_model
from kvblend import BlendConfig, BlendEngine, Segment
from kvblend.store import MemoryKVStore


@pytest.fixture(scope="module")
def engine() -> BlendEngine:
    """A tiny random Llama whose LM head is sharpened: margins spread over (0, 1)."""
    model = tiny_model("llama")
    with torch.no_grad():
        model.lm_head.weight.mul_(100)
    engine = BlendEngine(model, byte_tokenizer(), store=MemoryKVStore())
    engine.precompute(["Marta lives in Lisbon and paints boats.", "Bo works at Acme Co."])
    return engine


def _prompt() -> list[Segment]:
    return [Segment("Bo works at Acme Co."), Segment("Marta lives in Lisbon and paints boats."),
            Segment("\nWhere does Marta live?", cache=False)]  # fmt: skip


def _reference(logits: torch.Tensor) -> float:
    """Top-1 minus top-2 probability, written out with a sort."""
    probs = torch.softmax(logits.double(), dim=-1).sort(descending=True).values
    return float(probs[0] - probs[1])


@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_margins_are_those_of_transformers_generate_logits(
    engine: BlendEngine, penalty: float
) -> None:
    """Full prefill decodes as `model.generate`; its raw logits give the same margins (the
    prompt holds the answer's text, so the penalty changes which tokens come next, not the
    margins of the logits the model made)."""
    answer = engine.generate(_prompt(), BlendConfig("full"), max_new_tokens=6).text
    prompt = [*_prompt(), Segment(answer * 2, cache=False)]
    out = engine.generate(prompt, BlendConfig("full"), max_new_tokens=6, margins=5,
                          repetition_penalty=penalty)  # fmt: skip
    ids = torch.tensor([engine.prefill(prompt, BlendConfig("full")).token_ids])
    made = engine.model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
        repetition_penalty=penalty, output_logits=True, return_dict_in_generate=True,
        pad_token_id=engine.tokenizer.pad_token_id, eos_token_id=None,
    )  # fmt: skip
    assert out.token_ids == made.sequences[0, ids.shape[1] :].tolist()
    expected = [_reference(step[0]) for step in made.logits[: len(out.margins)]]
    assert len(out.margins) == min(5, len(out.token_ids))
    assert out.margins == pytest.approx(expected, abs=1e-5)
    assert len(set(out.margins)) > 1 and max(out.margins) - min(out.margins) > 0.01


def test_recording_changes_nothing_and_stops_at_the_count(engine: BlendEngine) -> None:
    config = BlendConfig(recompute_ratio=0.3, min_recompute=0, lead_tokens=1, short_document=0,
                         full_above=1.0)  # fmt: skip
    pre = engine.prefill(_prompt(), config)
    plain = engine.generate(pre, max_new_tokens=8)
    assert plain.margins == []
    watched = engine.generate(pre, max_new_tokens=8, margins=3)
    assert watched.token_ids == plain.token_ids and watched.text == plain.text
    assert len(watched.margins) == min(3, len(plain.token_ids))
    assert watched.margins[0] == pytest.approx(_reference(pre.logits), abs=1e-6)  # the prefill's
    only_first = engine.generate(pre, max_new_tokens=8, margins=1)
    assert only_first.margins == watched.margins[:1]
    assert all(0 <= m <= 1 for m in watched.margins)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_a_bad_margin_count_is_refused_before_any_model_work(
    engine: BlendEngine, bad: object
) -> None:
    with pytest.raises(ValueError, match="margins"):
        engine.generate("never prefilled", margins=bad)  # type: ignore[arg-type]
