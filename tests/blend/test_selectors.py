"""Strategies as selector classes: settings declared per strategy, unused ones rejected, the
registry open to a new selector, and the row attention's mask memory bounded."""

from __future__ import annotations

import pickle
from collections.abc import Iterable

import numpy as np
import pytest
import torch

from conftest import byte_tokenizer, tiny_model
from kvblend import BlendConfig, BlendEngine, Segment
from kvblend.blend import selectors
from kvblend.blend.attention.rows import QUERY_CHUNK, RowAttention, attention_mask, sdpa
from kvblend.blend.selectors.base import (
    Forecast,
    Selection,
    SelectionContext,
    Selector,
    Setting,
    SpanRows,
    ratio,
)
from kvblend.blend.types import COMPUTE, MOVED, RowSet
from kvblend.models.decoder import Decoder
from kvblend.store import MemoryKVStore

#: The rule tests count the rows of one budget over all moved documents, ranked by a probe over
#: every uncached row: no per-document minima (``per_document``), the probe not the tail's alone.
ONE_BUDGET = {"per_document": 0, "probe_tail": False}


def test_defaults_and_settings_of_each_strategy() -> None:
    assert BlendConfig().strategy == "attention"
    assert BlendConfig().settings == {
        "recompute_ratio": 0.3, "early_ratio": 0.4, "early_layers": 0.0, "probe_layers": 1.0,
        "min_recompute": 256, "window": 1, "per_document": 16,
        "lead_tokens": 8, "short_document": 32, "full_above": 0.8, "correction": 0.75,
        "stale_temperature": 1.0, "probe_tail": True, "guard": None, "guard_signal": "shift",
    }  # fmt: skip
    assert BlendConfig("cacheblend").settings == {
        "recompute_ratio": 0.2,
        "check_layer": 1,
        "deviation": "value",
        "ratio_schedule": None,
        "correction": 0.5,
        "stale_temperature": 1.0,
    }
    assert BlendConfig("epic").settings == {
        "epic_tokens": 16,
        "correction": 0.5,
        "stale_temperature": 1.0,
    }
    assert BlendConfig("reuse").settings == {} == BlendConfig("full").settings
    assert BlendConfig("epic", epic_tokens=4).epic_tokens == 4


@pytest.mark.parametrize(
    ("strategy", "settings", "named"),
    [
        ("attention", {"check_layer": 2}, "'check_layer'"),
        ("attention", {"epic_tokens": 8}, "'epic_tokens'"),
        ("attention", {"ratio_schedule": ((1, 0.5),)}, "'ratio_schedule'"),
        ("epic", {"recompute_ratio": 0.1}, "'recompute_ratio'"),
        ("reuse", {"correction": 0.5}, "'correction'"),
        ("full", {"recompute_ratio": 1.0}, "'recompute_ratio'"),
        ("cacheblend", {"epic_tokens": 3}, "'epic_tokens'"),
    ],
)
def test_a_setting_the_strategy_does_not_use_is_rejected(
    strategy: str, settings: dict, named: str
) -> None:
    with pytest.raises(ValueError, match=f"strategy '{strategy}' does not use {named}"):
        BlendConfig(strategy, **settings)


def test_schedule_and_the_settings_it_replaces_are_exclusive() -> None:
    with pytest.raises(ValueError, match="ratio_schedule replaces check_layer"):
        BlendConfig("cacheblend", check_layer=2, ratio_schedule=((1, 0.5), (2, 0.2)))
    with pytest.raises(ValueError, match="ratios must not increase"):
        BlendConfig("cacheblend", ratio_schedule=((1, 0.2), (2, 0.5)))
    config = BlendConfig("cacheblend", ratio_schedule=[[1, 0.5], [2, 0.2]])
    assert config.ratio_schedule == ((1, 0.5), (2, 0.2))


@pytest.mark.parametrize(
    "settings",
    [{"recompute_ratio": 1.5}, {"recompute_ratio": True}, {"correction": -0.1}],
)
def test_bad_values_name_the_setting(settings: dict) -> None:
    (name,) = settings
    with pytest.raises(ValueError, match=f"{name} must be a number in"):
        BlendConfig(**settings)


def test_unknown_strategy_lists_the_registered_ones() -> None:
    with pytest.raises(ValueError, match="unknown strategy 'fastest'; choose one of attention"):
        BlendConfig("fastest")


def test_configs_are_values() -> None:
    config = BlendConfig("cacheblend", recompute_ratio=0.15, deviation="key")
    assert config == BlendConfig("cacheblend", deviation="key", recompute_ratio=0.15)
    assert hash(config) == hash(BlendConfig("cacheblend", deviation="key", recompute_ratio=0.15))
    assert config != BlendConfig("cacheblend", recompute_ratio=0.15)
    assert pickle.loads(pickle.dumps(config)) == config
    assert eval(repr(config), {"BlendConfig": BlendConfig}) == config
    assert config.replace(recompute_ratio=0.3).recompute_ratio == 0.3
    assert config.recompute_ratio == 0.15  # unchanged
    with pytest.raises(AttributeError, match="immutable"):
        config.recompute_ratio = 0.5  # type: ignore[misc]
    with pytest.raises(AttributeError, match="has no setting 'epic_tokens'"):
        _ = config.epic_tokens
    with pytest.raises(ValueError, match="'epic' does not use 'recompute_ratio', 'deviation'"):
        config.replace(strategy="epic")


class LastTokensSelector(Selector):
    """Recompute the last ``tokens`` tokens of every moved document (a worked example)."""

    name = "last-tokens"
    settings = {"tokens": Setting(4, lambda name, v: int(ratio(name, v / 100) * 100), "count")}

    def select(self, context: SelectionContext) -> Selection:
        computed = context.uncached.clone()
        for span in context.spans:
            if span.kind == MOVED:
                computed[max(span.start, span.end - self.options["tokens"]) : span.end] = True
        return Selection(computed.nonzero().squeeze(1))

    def forecast(self, kinds: np.ndarray, spans: Iterable[SpanRows]) -> Forecast:
        tokens = self.options["tokens"]
        moved = np.asarray(kinds) == MOVED
        return Forecast(sum(int(moved[max(s.start, s.end - tokens) : s.end].sum()) for s in spans))


def test_a_new_selector_is_one_class_and_one_registry_line() -> None:
    selectors.register(LastTokensSelector)
    try:
        engine = BlendEngine(tiny_model("llama"), byte_tokenizer(), store=MemoryKVStore())
        documents = ["First document, twenty-nine b.", "Second document is here, ok."]
        engine.precompute(documents)
        prompt = [Segment("Head:\n", role="prefix"), *map(Segment, reversed(documents)),
                  Segment("\nQ?", cache=False)]  # fmt: skip
        pre = engine.prefill(prompt, BlendConfig("last-tokens", tokens=3))
        assert pre.stats.strategy == "last-tokens"
        assert pre.stats.recomputed_tokens == 6
        everything = engine.prefill(prompt, BlendConfig("last-tokens", tokens=99))
        full = engine.prefill(prompt, BlendConfig("full"))
        assert torch.allclose(everything.logits, full.logits, atol=1e-4, rtol=0)
        with pytest.raises(ValueError, match="does not use 'recompute_ratio'"):
            BlendConfig("last-tokens", recompute_ratio=0.2)
    finally:
        del selectors.SELECTORS["last-tokens"]


def test_a_strategy_registered_from_outside_forecasts_what_its_prefill_recomputes() -> None:
    from kvblend.vllm.request_plan import plan_request

    selectors.register(LastTokensSelector)
    try:
        engine = BlendEngine(tiny_model("llama"), byte_tokenizer(), store=MemoryKVStore())
        documents = ["First document, twenty-nine b.", "Second document is here, ok.",
                     "A third one, a little longer than the other two."]  # fmt: skip
        engine.precompute(documents)
        for tokens, order in ((3, [2, 0, 1]), (5, [1, 2, 0]), (40, [2, 1, 0])):
            config = BlendConfig("last-tokens", tokens=tokens)
            prompt = "".join(
                s.text for s in engine.rag_segments("Which one?", [documents[i] for i in order])
            )
            ran = engine.prefill(prompt, config).stats
            explained = engine.explain(prompt, config)
            vllm_plan = plan_request(engine.library, engine.encode(prompt), 0, config)
            assert ran.recomputed_tokens > 0 and ran.fallback is None
            assert explained.recomputed_tokens == ran.recomputed_tokens
            assert vllm_plan.recomputed == ran.recomputed_tokens
            assert explained.reused_tokens == ran.reused_tokens == vllm_plan.reused
            # vLLM's cost of the blend: the rows its own forecast says it computes
            uncached = int((vllm_plan.plan.kinds == COMPUTE).sum())
            assert vllm_plan.rows == uncached + ran.recomputed_tokens
    finally:
        del selectors.SELECTORS["last-tokens"]


class WordyFallbackSelector(LastTokensSelector):
    """`LastTokensSelector` that says, in words only, when it recomputes every moved row."""

    name = "wordy-fallback"
    WORDS = "every: token of every document (its words hold colons: none is read back)"

    def forecast(self, kinds: np.ndarray, spans: Iterable[SpanRows]) -> Forecast:
        planned = super().forecast(kinds, spans)
        if self.options["tokens"] < 99:
            return planned
        return Forecast(planned.recomputed, fallback=self.WORDS)


def test_a_strategy_giving_its_fallback_in_words_only_is_its_own_cause() -> None:
    """A strategy registered from outside may give its fallback as words: they are kept as they
    are, and its name is the cause the stats, the log and vLLM's record name."""
    from kvblend.vllm.request_plan import plan_request
    from kvblend.vllm.scheduling.request_records import planned_record

    selectors.register(WordyFallbackSelector)
    try:
        engine = BlendEngine(tiny_model("llama"), byte_tokenizer(), store=MemoryKVStore())
        documents = ["First document, twenty-nine b.", "Second document is here, ok."]
        engine.precompute(documents)
        prompt = "".join(s.text for s in engine.rag_segments("Which?", documents[::-1]))
        blended = engine.prefill(prompt, BlendConfig("wordy-fallback", tokens=3)).stats
        assert blended.fallback is None and blended.fallback_cause is None
        config = BlendConfig("wordy-fallback", tokens=99)
        stats = engine.prefill(prompt, config).stats
        assert stats.fallback == WordyFallbackSelector.WORDS
        assert stats.fallback_cause == "wordy-fallback" and stats.strategy_run == "full"
        # the first document follows the head it was cached behind: reused in place
        assert stats.documents_lost == ["document 2: recomputed whole (wordy-fallback)"]
        plan = plan_request(engine.library, engine.encode(prompt), 0, config)
        assert plan.claimed == 0 and plan.fallback == WordyFallbackSelector.WORDS
        assert planned_record(plan)["reason"] == "wordy-fallback"
    finally:
        del selectors.SELECTORS["wordy-fallback"]


def test_a_strategy_without_a_forecast_is_refused_at_registration() -> None:
    class NoForecast(Selector):
        name = "no-forecast"

        def select(self, context: SelectionContext) -> Selection:
            return Selection(context.uncached.nonzero().squeeze(1))

    with pytest.raises(TypeError, match="must implement forecast"):
        selectors.register(NoForecast)
    assert "no-forecast" not in selectors.SELECTORS


def _row_attention(decoder: Decoder, rows: torch.Tensor, total: int, **kwargs) -> RowAttention:
    rowset = RowSet.from_host(rows.numpy(), decoder.device)
    return RowAttention(rowset, total, decoder.windows, decoder.scaling, decoder.dtype, **kwargs)


def test_row_attention_masks_stay_within_their_budget() -> None:
    """Masks cover each query chunk's own key range, and past the budget are not kept."""
    decoder = Decoder(tiny_model("mistral"))  # a sliding window on every layer
    window = decoder.windows[0]
    assert window is not None
    total = 64 * window
    rows = torch.arange(0, total, 3)  # sparse: masked chunks
    kept = _row_attention(decoder, rows, total)
    element = torch.empty((), dtype=decoder.dtype).element_size()
    # Each chunk spans at most its rows' positions plus one window of keys: O(rows x window).
    bound = rows.numel() * (3 * QUERY_CHUNK + window) * element
    assert 0 < kept.mask_bytes <= bound < rows.numel() * total * element
    for chunk in kept.chunks[window]:
        assert chunk.key_end - chunk.key_begin <= 3 * QUERY_CHUNK + window
    rebuilt = _row_attention(decoder, rows, total, mask_budget=0)
    assert rebuilt.mask_bytes == 0 and not rebuilt.masks
    generator = torch.Generator().manual_seed(0)
    shape = decoder.shape
    q = torch.randn(shape.num_heads, rows.numel(), shape.head_dim, generator=generator)
    k = torch.randn(shape.num_kv_heads, total, shape.head_dim, generator=generator)
    v = torch.randn(shape.num_kv_heads, total, shape.head_dim, generator=generator)
    assert torch.equal(kept(window, q, k, v), rebuilt(window, q, k, v))
    full_q = torch.zeros(shape.num_heads, total, shape.head_dim)
    full_q[:, rows] = q
    mask = attention_mask(torch.arange(total), 0, total, window, q.dtype)
    expected = sdpa(full_q, k, v, decoder.scaling, mask)[rows]
    assert torch.allclose(kept(window, q, k, v), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("window", [None, 300])
def test_query_chunks_read_fewest_keys_in_no_more_calls(window: int | None) -> None:
    """Chunk boundaries minimise the pairs read (and calls), never more calls than chunks of
    `QUERY_CHUNK` rows, and every row reads every key it may attend to."""
    from kvblend.blend.attention.rows import CALL_PAIRS, QueryChunk, query_chunks

    generator = np.random.default_rng(0)
    early = np.sort(generator.choice(2000, 100, replace=False))
    late = np.sort(generator.choice(np.arange(2000, 4000), 800, replace=False))
    exact = np.concatenate([early, late])
    loose = np.sort(np.concatenate([early, np.arange(3200, 4000)]))  # upper bounds of a probe
    for lower, upper in ((exact, exact), (exact, loose)):
        chunks = query_chunks(lower, upper, window)
        fixed = [
            QueryChunk(b, min(b + QUERY_CHUNK, upper.size),
                       0 if window is None else max(0, int(lower[b]) - window + 1),
                       int(upper[min(b + QUERY_CHUNK, upper.size) - 1]) + 1)
            for b in range(0, upper.size, QUERY_CHUNK)
        ]  # fmt: skip

        def cost(chunks: list[QueryChunk]) -> int:
            return sum((c.end - c.begin) * (c.key_end - c.key_begin) + CALL_PAIRS for c in chunks)

        assert len(chunks) <= len(fixed) and cost(chunks) <= cost(fixed)
        assert [c.begin for c in chunks[1:]] == [c.end for c in chunks[:-1]]
        assert chunks[0].begin == 0 and chunks[-1].end == upper.size
        for c in chunks:
            assert c.end - c.begin <= 2 * QUERY_CHUNK
            assert c.key_end > upper[c.end - 1]
            if window is not None:
                assert c.key_begin <= max(0, lower[c.begin] - window + 1)
    rows = np.arange(3000, 3000 + QUERY_CHUNK + 44)  # bounded only by the prompt's end:
    assert len(query_chunks(rows, np.full(rows.size, 3999), None)) == 1  # a split saves nothing


def _blend_every_strategy(engine: BlendEngine) -> None:
    documents = ["Doc one: Marta Quill lives in Lisbon. " * 3, "Doc two: a meeting at 9:30. " * 4]
    engine.precompute(documents)
    prompt = [Segment("System:\n", role="prefix"), *map(Segment, reversed(documents)),
              Segment("\nQuestion: where?\nAnswer:", cache=False)]  # fmt: skip
    for config in (
        BlendConfig(),
        BlendConfig("cacheblend", recompute_ratio=0.15),
        BlendConfig("epic", epic_tokens=4),
        BlendConfig("reuse"),
        BlendConfig("full"),
    ):
        engine.prefill(prompt, config)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_masked_attention_never_asks_sdpa_for_gqa(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SDPA's enable_gqa with a mask runs the math kernel on CUDA: KV heads are expanded."""
    from kvblend.blend.attention import rows as row_attention

    calls: list[tuple[bool, bool, int, int]] = []
    real = row_attention.F.scaled_dot_product_attention

    def recording(q, k, v, *args, **kwargs):
        masked = kwargs.get("attn_mask") is not None
        calls.append((masked, bool(kwargs.get("enable_gqa")), q.shape[1], k.shape[1]))
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(row_attention.F, "scaled_dot_product_attention", recording)
    # The CUDA rule, exercised on the CPU: masked calls get expanded KV heads.
    assert not row_attention.sdpa_takes_gqa(True, torch.device("cuda"))
    assert row_attention.sdpa_takes_gqa(True, torch.device("cpu"))
    monkeypatch.setattr(row_attention, "sdpa_takes_gqa", lambda masked, device: not masked)
    engine = BlendEngine(tiny_model(family), byte_tokenizer(), store=MemoryKVStore())
    shape = engine.decoder.shape
    assert shape.num_heads > shape.num_kv_heads  # the tiny models use GQA
    _blend_every_strategy(engine)
    masked = [call for call in calls if call[0]]
    assert masked and all(not gqa and q == k for _, gqa, q, k in masked)
    if set(engine.decoder.windows) == {None}:  # plain causal calls keep SDPA's own GQA
        assert any(gqa for masked, gqa, _, _ in calls if not masked)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_no_strategy_syncs_with_the_host_before_the_logits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """From the first pass to the logits, no strategy waits for the GPU (rows chosen on the
    device stay there; attention is FlexAttention over a block mask built there): torch raises
    on a sync in ``set_sync_debug_mode("error")``. The statistics read rows after the logits."""
    from kvblend.blend import loop as blend
    from kvblend.documents import blend_plan as blend_plan_module

    real_run, real_stats = blend_plan_module.run_blend, blend.pass_stats

    def checked(*args, **kwargs):  # type: ignore[no-untyped-def]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return real_run(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    def stats_may_sync(*args, **kwargs):  # type: ignore[no-untyped-def]
        torch.cuda.set_sync_debug_mode(0)
        try:
            return real_stats(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    model = tiny_model("qwen2").to("cuda")
    engine = BlendEngine(model, byte_tokenizer(), store=MemoryKVStore())
    _blend_every_strategy(engine)  # stores every segment: the prefills below read them
    monkeypatch.setattr(blend_plan_module, "run_blend", checked)
    monkeypatch.setattr(blend, "pass_stats", stats_may_sync)
    _blend_every_strategy(engine)


def test_lead_tokens_recompute_the_first_tokens_of_every_moved_document() -> None:
    engine = BlendEngine(tiny_model("qwen2"), byte_tokenizer(), store=MemoryKVStore())
    documents = ["First document, a longer one.", "Second document is here, ok.", "Third."]
    engine.precompute(documents)
    prompt = [Segment("Head:\n", role="prefix"), *map(Segment, reversed(documents)),
              Segment("\nQ?", cache=False)]  # fmt: skip
    blend = BlendConfig(short_document=0, min_recompute=0, full_above=1.0, **ONE_BUDGET)
    only_leads = engine.prefill(prompt, blend.replace(recompute_ratio=0.0, lead_tokens=3))
    assert only_leads.stats.moved_tokens > 0
    assert only_leads.stats.recomputed_tokens == 3 * 3  # every document here is moved
    both = engine.prefill(prompt, blend.replace(recompute_ratio=0.2, lead_tokens=3))
    moved = both.stats.moved_tokens
    assert both.stats.recomputed_tokens == 3 * 3 + round(0.2 * moved)
    everything = engine.prefill(prompt, blend.replace(recompute_ratio=0.0, lead_tokens=99))
    full = engine.prefill(prompt, BlendConfig("full"))
    assert everything.stats.recomputed_tokens == moved
    assert torch.allclose(everything.logits, full.logits, atol=1e-4, rtol=0)


def _records_engine() -> tuple[BlendEngine, list[Segment], list[int]]:
    """Three documents of 12, 20 and 60 bytes (tokens), moved behind a two-line head."""
    engine = BlendEngine(tiny_model("qwen2"), byte_tokenizer(), store=MemoryKVStore())
    documents = [
        "Ann, Lisbon.",
        "Bo works at Acme Co.",
        "Cy is a painter who lives in Oslo and keeps a small boat too.",
    ]
    engine.precompute(documents)
    prompt = [Segment("Records:\n", role="prefix"), *map(Segment, reversed(documents)),
              Segment("\nWho lives in Oslo?", cache=False)]  # fmt: skip
    return engine, prompt, [len(engine.tokenize(d)) for d in reversed(documents)]


def test_short_documents_are_recomputed_whole() -> None:
    engine, prompt, lengths = _records_engine()
    config = BlendConfig(recompute_ratio=0.0, min_recompute=0, lead_tokens=4, full_above=1.0,
                         **ONE_BUDGET)  # fmt: skip
    for short in (0, 12, 20, 59, 60):
        pre = engine.prefill(prompt, config.replace(short_document=short))
        expected = sum(n if n <= short else 4 for n in lengths)
        assert pre.stats.recomputed_tokens == expected, short
        assert pre.stats.documents_reused == 3 - sum(n <= short for n in lengths)


def test_a_blend_costing_about_a_full_prefill_computes_the_whole_prompt() -> None:
    engine, prompt, lengths = _records_engine()
    full = engine.prefill(prompt, BlendConfig("full"))
    config = BlendConfig(recompute_ratio=0.2, min_recompute=0, lead_tokens=8, short_document=0,
                         **ONE_BUDGET)  # fmt: skip
    blended = engine.prefill(prompt, config.replace(full_above=1.0))
    assert 0 < blended.stats.recomputed_tokens < blended.stats.moved_tokens
    assert blended.stats.documents_reused == 3
    planned = blended.stats.estimated_cost  # the probe's rows and the reused rows included
    assert blended.stats.fallback is None and blended.stats.strategy_run == "attention"
    whole = engine.prefill(prompt, config.replace(full_above=min(planned - 0.01, 0.99)))
    assert whole.stats.fallback is not None and whole.stats.fallback.startswith("full_above")
    assert whole.stats.strategy_run == "full" and len(whole.stats.documents_lost) == 3
    assert whole.stats.recomputed_tokens == whole.stats.moved_tokens == sum(lengths)
    assert whole.stats.reused_tokens == whole.stats.prefix_tokens > 0  # the head is in place
    assert whole.stats.documents_reused == 0 and whole.stats.timings["probe_s"] == 0.0
    assert torch.allclose(whole.logits, full.logits, atol=1e-4, rtol=0)
    kept = engine.prefill(prompt, config.replace(full_above=min(planned + 0.01, 1.0)))
    assert kept.stats.recomputed_tokens == blended.stats.recomputed_tokens


def test_min_recompute_floors_the_budget_leading_tokens_included() -> None:
    engine, prompt, lengths = _records_engine()
    moved, leads = sum(lengths), 3 * 4
    config = BlendConfig(recompute_ratio=0.1, lead_tokens=4, short_document=0, full_above=1.0,
                         **ONE_BUDGET)  # fmt: skip
    share = leads + round(0.1 * moved)
    for floor in (0, share, 30, moved, 500):
        pre = engine.prefill(prompt, config.replace(min_recompute=floor))
        assert pre.stats.recomputed_tokens == min(moved, max(share, floor)), floor
    everything = engine.prefill(prompt, config.replace(min_recompute=moved))
    full = engine.prefill(prompt, BlendConfig("full"))
    assert torch.allclose(everything.logits, full.logits, atol=1e-4, rtol=0)


def _rows_per_layer(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """Record each pass's computed rows per layer (one list per pass)."""
    from kvblend.blend import loop as blend

    passes: list[list[int]] = []
    real = blend.compute_layer

    def recording(state, layer, *args):
        if layer == 0:
            passes.append([])
        passes[-1].append(state.rows.count)
        return real(state, layer, *args)

    monkeypatch.setattr(blend, "compute_layer", recording)
    return passes


def test_the_funnel_recomputes_more_rows_in_the_early_layers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine, prompt, lengths = _records_engine()
    moved, leads = sum(lengths), 3 * 2
    config = BlendConfig(recompute_ratio=0.1, early_ratio=0.5, early_layers=0.34, lead_tokens=2,
                         short_document=0, min_recompute=0, full_above=1.0,
                         **ONE_BUDGET)  # fmt: skip
    passes = _rows_per_layer(monkeypatch)
    pre = engine.prefill(prompt, config)
    probe, main = passes[-2:]  # after the head's own KV, computed and stored once
    uncached = probe[0]
    assert probe == [uncached] * 3  # the probe computes the uncached rows only
    early, later = uncached + leads + round(0.5 * moved), uncached + leads + round(0.1 * moved)
    assert main == [early, later, later]  # 0.34 of 3 layers: the first one
    assert pre.stats.recomputed_tokens == leads + round(0.1 * moved)
    total = pre.stats.prompt_tokens
    assert pre.stats.compute_fraction == pytest.approx((3 * uncached + sum(main)) / (3 * total))
    assert engine.explain(prompt, config).forecast.estimated_cost == pytest.approx(
        pre.stats.estimated_cost
    )
    passes.clear()
    flat = engine.prefill(prompt, config.replace(early_layers=0))  # no funnel
    assert passes == [probe, [later] * 3]
    assert flat.stats.recomputed_tokens == pre.stats.recomputed_tokens
    assert flat.stats.estimated_cost < pre.stats.estimated_cost
    passes.clear()
    engine.prefill(prompt, config.replace(early_ratio=0.05))  # below the ratio: no funnel
    assert passes == [probe, [later] * 3]


def test_the_funnel_keeps_the_best_scoring_rows_after_the_early_layers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvblend.blend.selectors import attention

    chosen: list[tuple] = []
    real = attention.AttentionSelector.select

    def keeping(self, context):
        selection = real(self, context)
        chosen.append((self, selection, context.kinds.numpy()))
        return selection

    monkeypatch.setattr(attention.AttentionSelector, "select", keeping)
    engine, prompt, _ = _records_engine()
    config = BlendConfig(recompute_ratio=0.1, early_ratio=0.6, early_layers=0.5, lead_tokens=0,
                         short_document=0, min_recompute=0, full_above=1.0,
                         **ONE_BUDGET)  # fmt: skip
    engine.prefill(prompt, config)
    selector, selection, kinds = chosen[-1]
    assert selector.refine_layers == frozenset([2])  # round(0.5 * 3 layers)
    budget = selector.budget
    assert 0 < budget.keep < budget.early
    scores = selector.scores.numpy()
    candidates = np.flatnonzero(kinds == MOVED)
    ranked = candidates[np.argsort(-scores[candidates], kind="stable")]
    assert isinstance(selection.computed, RowSet) and selection.computed.host is None
    rows = selection.computed.positions.numpy()
    later = rows[selector.later.keep.numpy()]
    assert np.array_equal(later, selector.later.rows.positions.numpy())
    assert set(rows[kinds[rows] == MOVED]) == set(ranked[: budget.early])
    assert set(later[kinds[later] == MOVED]) == set(ranked[: budget.keep])
    assert set(later[kinds[later] != MOVED]) == set(rows[kinds[rows] != MOVED])


def test_early_layers_is_a_share_of_the_model_s_layers() -> None:
    from kvblend.blend.selectors.attention import early_layer_count

    assert [early_layer_count(share, 30) for share in (0, 0.01, 0.25, 0.5, 0.99)] == [
        0, 1, 8, 15, 29
    ]  # fmt: skip
    assert early_layer_count(0.9, 2) == 1  # never every layer
    for bad in (1, 1.0, -0.1, "0.2", True):
        with pytest.raises(ValueError, match="early_layers must be a share"):
            BlendConfig(early_layers=bad)


def test_the_probe_runs_its_share_of_the_first_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvblend.blend.selectors import Selection, attention

    engine, prompt, lengths = _records_engine()
    config = BlendConfig(recompute_ratio=0.1, lead_tokens=2, short_document=0, min_recompute=0,
                         full_above=1.0, probe_layers=0.34, **ONE_BUDGET)  # fmt: skip
    passes = _rows_per_layer(monkeypatch)
    pre = engine.prefill(prompt, config)
    probe, main = passes[-2:]
    uncached, later = probe[0], 3 * 2 + round(0.1 * sum(lengths)) + probe[0]
    assert (probe, main) == ([uncached], [later] * 3)  # 0.34 of 3 layers: the first one
    total = pre.stats.prompt_tokens
    assert pre.stats.compute_fraction == pytest.approx((uncached + 3 * later) / (3 * total))
    assert engine.explain(prompt, config).forecast.estimated_cost == pytest.approx(
        pre.stats.estimated_cost
    )
    every = engine.prefill(prompt, config.replace(probe_layers=1.0))
    assert passes[-2] == [uncached] * 3
    assert pre.stats.estimated_cost < every.stats.estimated_cost

    # the prefill continues from the short probe's buffer: the same as loading it anew
    real = attention.AttentionSelector.select

    def without_start(self, context):
        return Selection(real(self, context).computed)

    monkeypatch.setattr(attention.AttentionSelector, "select", without_start)
    anew = engine.prefill(prompt, config)
    assert torch.equal(anew.logits, pre.logits)


def test_probe_layers_is_a_share_of_the_model_s_layers() -> None:
    from kvblend.blend.selectors.attention import probe_layer_count

    assert [probe_layer_count(share, 30) for share in (0.01, 0.25, 0.5, 1.0)] == [1, 8, 15, 30]
    for bad in (0, 1.5, -0.1, "0.5", True):
        with pytest.raises(ValueError, match="probe_layers must be a share"):
            BlendConfig(probe_layers=bad)


def test_full_prefill_reports_documents_found_and_none_reused() -> None:
    engine, prompt, lengths = _records_engine()
    stats = engine.prefill(prompt, BlendConfig("full")).stats
    assert stats.documents_found == 3 and stats.documents_reused == 0
    assert stats.reused_tokens == 0 and stats.computed_tokens == len(
        engine.encode("".join(segment.text for segment in prompt))
    )


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_flex_attention_rows_equal_the_chunked_ones(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``KVBLEND_ATTENTION=flex`` (one call per layer, a block mask built once per pass) gives
    the chunked attention's output, sliding windows included (run eagerly on the CPU)."""
    import warnings

    from kvblend.blend.attention.rows import ATTENTION_ENV, use_flex

    decoder = Decoder(tiny_model(family))
    total = 300
    rows = torch.tensor(sorted({*range(0, total, 7), *range(250, total)}))
    shape = decoder.shape
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(shape.num_heads, rows.numel(), shape.head_dim, generator=generator)
    k = torch.randn(shape.num_kv_heads, total, shape.head_dim, generator=generator)
    v = torch.randn(shape.num_kv_heads, total, shape.head_dim, generator=generator)
    with torch.inference_mode():
        chunked = _row_attention(decoder, rows, total)(decoder.windows[0], q, k, v)
        monkeypatch.setenv(ATTENTION_ENV, "flex")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # eager flex attention warns that it is slow
            flex = _row_attention(decoder, rows, total, flex=use_flex(decoder.device, False))
            assert flex.flex is not None
            got = flex(decoder.windows[0], q, k, v)
    torch.testing.assert_close(got, chunked, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    ("strategy", "most", "probe_layers"),
    [("reuse", 0, None), ("attention", 1, 1.0), ("attention", 1, 0.5), ("epic", 0, None),
     ("cacheblend", 1, None)],
)  # fmt: skip
def test_a_whole_blend_syncs_at_most_once_on_cuda(
    strategy: str, most: int, probe_layers: float | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a whole blend, the host waits for the GPU at most once: for the statistics, the rows
    a probe or a check layer chose are read after the logits (torch warns at every sync in
    ``set_sync_debug_mode("warn")``)."""
    import warnings

    from kvblend.documents import blend_plan as blend_plan_module

    real = blend_plan_module.run_blend
    counted: list[int] = []

    def checked(*args, **kwargs):  # type: ignore[no-untyped-def]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = real(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        counted.append(sum("synchroniz" in str(w.message) for w in caught))
        return out

    engine = BlendEngine(tiny_model("qwen2").to("cuda"), byte_tokenizer(), store=MemoryKVStore())
    _blend_every_strategy(engine)  # stores every segment: the prefill below reads them
    monkeypatch.setattr(blend_plan_module, "run_blend", checked)
    documents = ["Doc one: Marta Quill lives in Lisbon. " * 3, "Doc two: a meeting at 9:30. " * 4]
    prompt = [Segment("System:\n", role="prefix"), *map(Segment, reversed(documents)),
              Segment("\nQuestion: where?\nAnswer:", cache=False)]  # fmt: skip
    settings: dict = {}
    if strategy == "attention":
        settings = {"min_recompute": 0, "full_above": 1.0, "probe_layers": probe_layers}
    engine.prefill(prompt, BlendConfig(strategy, **settings))
    assert counted and counted[-1] <= most


@pytest.mark.parametrize("strategy", ["attention", "cacheblend"])
def test_selectors_choose_rows_by_the_adapters_reduced_scores(
    monkeypatch: pytest.MonkeyPatch, strategy: str
) -> None:
    """Under tensor parallelism `reduce_scores` sums the ranks' scores: the rows follow the sum.

    Here the "other ranks" add a ramp that outweighs any score, so the moved rows chosen are
    the last ones, whatever the model's own scores; the hook runs once per selection.
    """
    from kvblend.blend.selectors import cacheblend

    engine, prompt, lengths = _records_engine()
    sums: list[int] = []

    def with_other_ranks(scores: torch.Tensor) -> torch.Tensor:
        sums.append(scores.numel())
        return scores + 1e6 * torch.arange(scores.numel(), dtype=scores.dtype)

    monkeypatch.setattr(engine.decoder, "reduce_scores", with_other_ranks)
    kept: list[np.ndarray] = []
    if strategy == "attention":
        config = BlendConfig(recompute_ratio=0.25, lead_tokens=0, short_document=0,
                             min_recompute=0, full_above=1.0, **ONE_BUDGET)  # fmt: skip
        real_select = selectors.attention.AttentionSelector.select

        def select(self, context):
            selection = real_select(self, context)
            kept.append(selection.computed.positions.numpy())
            return selection

        monkeypatch.setattr(selectors.attention.AttentionSelector, "select", select)
    else:
        config = BlendConfig("cacheblend", recompute_ratio=0.25)
        real_refine = cacheblend.CacheBlendSelector.refine

        def refine(self, *args):
            narrowing = real_refine(self, *args)
            kept.append(narrowing.rows.positions.numpy())
            return narrowing

        monkeypatch.setattr(cacheblend.CacheBlendSelector, "refine", refine)
    pre = engine.prefill(prompt, config)
    moved = sum(lengths)
    assert len(sums) == 1 and pre.stats.recomputed_tokens == round(0.25 * moved)
    rows = kept[-1]
    total = pre.stats.prompt_tokens
    question = total - len(engine.tokenize("\nWho lives in Oslo?"))
    chosen = rows[(rows >= len(engine.tokenize("Records:\n"))) & (rows < question)]
    assert chosen.tolist() == list(range(question - round(0.25 * moved), question))


@pytest.mark.parametrize("strategy", ["attention", "epic", "cacheblend"])
def test_a_stale_temperature_divides_the_keys_the_blend_reads_from_caches(strategy: str) -> None:
    """With no correction, the rows a blend reads from the cache at the last layer hold their
    cached keys: at temperature 2, halved, and only those; values are the cache's either way.
    The rows chosen are the same (the temperature acts in the blend, after any choice), and the
    computed rows, which attend less sharply to the stale ones, move the logits."""
    engine, prompt, _ = _records_engine()
    settings = {"correction": 0.0}
    if strategy == "attention":
        settings |= {"recompute_ratio": 0.2, "lead_tokens": 1, "short_document": 0,
                     "min_recompute": 0, "full_above": 1.0}  # fmt: skip
    cold = engine.prefill(prompt, BlendConfig(strategy, **settings))
    hot = engine.prefill(prompt, BlendConfig(strategy, stale_temperature=2.0, **settings))
    assert hot.stats.recomputed_tokens == cold.stats.recomputed_tokens > 0
    last_hot, last_cold = hot.keys[-1], cold.keys[-1]
    halved = torch.isclose(last_hot, last_cold / 2, atol=1e-6).all(dim=-1).all(dim=0)
    stale = halved & ~torch.isclose(last_cold, torch.zeros(()), atol=1e-6).all(-1).all(0)
    kinds = torch.as_tensor(engine.plan(prompt).kinds)
    assert int(stale.sum()) == int((kinds == MOVED).sum()) - cold.stats.recomputed_tokens
    assert bool((kinds[stale] == MOVED).all())
    values_read = stale.nonzero().squeeze(1)
    assert torch.equal(hot.values[-1][:, values_read], cold.values[-1][:, values_read])
    assert not torch.allclose(hot.logits, cold.logits)
    with pytest.raises(ValueError, match="stale_temperature"):
        BlendConfig(strategy, stale_temperature=0.0)
