"""The cache decoding continues from: static (the default) and dynamic, against transformers.

Every family decodes greedily token for token as `model.generate` does, from either cache;
the static cache holds exactly what transformers' own `StaticCache` holds after a forward pass
over the prompt (a sliding-window layer its window's tail); stop strings, streaming, seeded
sampling and batched decoding of left-padded rows give the same tokens from both.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import StaticCache

from conftest import make_tiny_engine
from kvblend import BlendConfig, BlendEngine, Segment
from kvblend.decoding.cache import CACHE_ENV, COMPILE_BUCKET, COMPILE_ENV, DecodeCache
from kvblend.decoding.options import DecodeOptions, decode_plan

DOCS = [
    "Doc one: Marta Quill lives in Lisbon and keeps bees on the roof.",
    "Doc two: the orange cat sleeps all day by the warm window.",
]
#: longer than the tiny Mistral's 48-token sliding window
PROMPT = [Segment(DOCS[0]), Segment(DOCS[1]), Segment("\nWhere does Marta live?", cache=False)]
KINDS = ["static", "dynamic"]
BLEND = BlendConfig("attention", recompute_ratio=0.3, min_recompute=0, full_above=1.0)


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Decode from this cache kind (``KVBLEND_DECODE_CACHE``)."""
    monkeypatch.setenv(CACHE_ENV, request.param)
    return str(request.param)


def _reference(engine: BlendEngine, token_ids: list[int], new_tokens: int) -> list[int]:
    ids = torch.tensor([token_ids])
    with torch.inference_mode():
        out = engine.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
            do_sample=False, pad_token_id=0, eos_token_id=1,
        )  # fmt: skip
    return [int(t) for t in out[0, len(token_ids) :]]


def test_greedy_decoding_equals_model_generate(family: str, kind: str) -> None:
    engine = make_tiny_engine(family)
    out = engine.generate(PROMPT, BlendConfig("full"), max_new_tokens=20)
    token_ids = engine.encode("".join(s.text for s in PROMPT))
    assert len(token_ids) > 48  # past Mistral's window: its static layers hold the tail only
    assert out.token_ids == _reference(engine, token_ids, 20)


def test_static_cache_holds_what_transformers_prefill_leaves(family: str) -> None:
    engine = make_tiny_engine(family)
    pre = engine.prefill(PROMPT, BlendConfig("full"))
    total, new_tokens = len(pre.token_ids), 7
    ours = DecodeCache("static").build(
        engine.model, [k[None] for k in pre.keys], [v[None] for v in pre.values], new_tokens
    )
    theirs = StaticCache(config=engine.model.config, max_cache_len=total + new_tokens)
    with torch.inference_mode():
        engine.model(torch.tensor([pre.token_ids]), cache=theirs, use_cache=True)
    assert int(ours.get_seq_length()) == int(theirs.get_seq_length()) == total
    for layer, (mine, reference) in enumerate(zip(ours.layers, theirs.layers, strict=True)):
        assert type(mine) is type(reference)
        assert mine.get_max_length() == reference.get_max_length()
        for got, expected in ((mine.keys, reference.keys), (mine.values, reference.values)):
            error = (got - expected).abs().max()
            assert error < 1e-4, f"layer {layer}: max abs error {error:.3g}"


def test_both_caches_decode_a_blend_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_tiny_engine("mistral")
    engine.precompute(DOCS, progress=False)
    pre = engine.prefill(PROMPT, BLEND)
    assert pre.stats.reused_tokens > 0
    decoded = {}
    for kind in KINDS:
        monkeypatch.setenv(CACHE_ENV, kind)
        decoded[kind] = engine.generate(pre, max_new_tokens=16).token_ids
    assert decoded["static"] == decoded["dynamic"]


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_stop_strings_streaming_and_seeded_sampling(family: str, kind: str) -> None:
    engine = make_tiny_engine(family)
    pre = engine.prefill(PROMPT, BlendConfig("full"))
    whole = engine.generate(pre, max_new_tokens=16)
    assert whole.token_ids == _reference(engine, pre.token_ids, 16)
    stop = whole.text[3:5]
    cut = engine.generate(pre, max_new_tokens=16, stop=[stop])
    assert cut.finish_reason == "stop" and whole.text.startswith(cut.text)
    assert "".join(engine.stream(pre, max_new_tokens=16, stop=[stop])) == cut.text
    assert "".join(engine.stream(pre, max_new_tokens=16)) == whole.text
    sampled = [engine.generate(pre, max_new_tokens=12, temperature=1.3, seed=5) for _ in "ab"]
    assert sampled[0].token_ids == sampled[1].token_ids
    streamed = "".join(engine.stream(pre, max_new_tokens=12, temperature=1.3, seed=5))
    assert streamed == sampled[0].text


def test_seeded_sampling_draws_the_same_tokens_from_both(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_tiny_engine("mistral")
    pre = engine.prefill(PROMPT, BlendConfig("full"))
    options: dict[str, Any] = {"max_new_tokens": 12, "temperature": 1.3, "top_k": 40, "seed": 9}
    drawn = {}
    for kind in KINDS:
        monkeypatch.setenv(CACHE_ENV, kind)
        drawn[kind] = engine.generate(pre, **options).token_ids
    assert drawn["static"] == drawn["dynamic"]


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_left_padded_batch_equals_one_by_one(family: str, kind: str) -> None:
    engine = make_tiny_engine(family)
    engine.precompute(DOCS, progress=False)
    prompts = [f"Q{i}: " + DOCS[i % 2] + "\n" + DOCS[1 - i % 2] + " Who?" * i for i in range(3)]
    assert len({len(engine.encode(p)) for p in prompts}) == 3  # rows of different lengths
    alone = [engine.generate(p, BLEND, max_new_tokens=16).token_ids for p in prompts]
    together = [r.token_ids for r in engine.generate_batch(prompts, BLEND, max_new_tokens=16)]
    assert together == alone


def test_the_static_cache_is_the_default_and_sized_for_the_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(CACHE_ENV, raising=False)
    monkeypatch.delenv(COMPILE_ENV, raising=False)
    engine = make_tiny_engine("llama")
    plan = decode_plan(engine.model, engine.tokenizer, 10, DecodeOptions(max_new_tokens=5))
    assert plan.cache == DecodeCache("static", compiled=False)
    assert plan.config.disable_compile  # transformers would compile a static cache on CUDA
    pre = engine.prefill(PROMPT, BlendConfig("full"))
    keys, values = [k[None] for k in pre.keys], [v[None] for v in pre.values]
    cache = plan.cache.build(engine.model, keys, values, 5)
    assert cache.get_max_length() == len(pre.token_ids) + 5


def test_a_bad_setting_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, "paged")
    with pytest.raises(ValueError, match=f"{CACHE_ENV} must be one of static, dynamic"):
        DecodeCache.choose(torch.device("cpu"))
    engine = make_tiny_engine("llama")
    calls: list[object] = []
    monkeypatch.setattr(engine, "_prefill", lambda *args, **kwargs: calls.append(args))
    with pytest.raises(ValueError, match=f"{CACHE_ENV} must be one of"):  # before any model work
        engine.generate(PROMPT, max_new_tokens=4)
    assert calls == []
    monkeypatch.setenv(CACHE_ENV, "static")
    monkeypatch.setenv(COMPILE_ENV, "yes")
    with pytest.raises(ValueError, match=f"{COMPILE_ENV} must be one of 0, 1"):
        DecodeCache.choose(torch.device("cpu"))


def test_the_compiled_step_is_for_a_static_cache_on_cuda_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(COMPILE_ENV, "1")
    monkeypatch.setenv(CACHE_ENV, "static")
    with pytest.warns(UserWarning, match="runs uncompiled"):
        assert DecodeCache.choose(torch.device("cpu")) == DecodeCache("static", compiled=False)
    compiled = DecodeCache.choose(torch.device("cuda"))  # no device is touched
    assert compiled == DecodeCache("static", compiled=True)
    assert compiled.length(1) == COMPILE_BUCKET and compiled.length(COMPILE_BUCKET + 1) == 512
    assert DecodeCache("static").length(300) == 300
    monkeypatch.setenv(CACHE_ENV, "dynamic")
    with pytest.warns(UserWarning, match="dynamic cache runs uncompiled"):
        assert not DecodeCache.choose(torch.device("cuda")).compiled
    from transformers import GenerationConfig

    config = GenerationConfig()
    compiled.configure(config)
    assert not config.disable_compile and config.compile_config.mode == "reduce-overhead"
