"""The ``attention`` strategy's ``window`` (whole blocks of rows) and ``per_document`` (a minimum
per document) settings: the rows a prefill recomputes are the top blocks and the per-document top
rows by the probe's own scores (checked against a plain numpy ranking of those scores), and their
count is the one ``explain`` forecasts, on random prompts and settings."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch

from conftest import TOY_BLEND_SETTINGS, byte_tokenizer, make_tiny_engine, tiny_model
from kvblend import BlendConfig, BlendEngine, Segment
from kvblend.blend.types import COMPUTE, MOVED, RowSet
from kvblend.store import MemoryKVStore

DOCUMENTS = [
    "Ann Lee, Lisbon; she keeps bees and sells honey at the market on Fridays.",
    "Bo works at Acme Co. as a welder, and rides a green bike to the yard.",
    "Cy is a painter who lives in Oslo and keeps a small boat by the harbour all year.",
    "Di teaches maths in Porto; her class meets at nine in room four on Mondays.",
]
#: the settings the tests vary from: no floor, no fallback, two leading rows a document, one
#: budget over all documents (no per-document minima), the probe over every uncached row
BLEND = BlendConfig(recompute_ratio=0.2, lead_tokens=2, short_document=0, min_recompute=0,
                    full_above=1.0, per_document=0, probe_tail=False)  # fmt: skip


def _engine() -> tuple[BlendEngine, list[Segment]]:
    engine = BlendEngine(tiny_model("qwen2"), byte_tokenizer(), store=MemoryKVStore())
    engine.precompute(DOCUMENTS)
    prompt = [Segment("Records:\n", role="prefix"), *map(Segment, reversed(DOCUMENTS)),
              Segment("\nWho lives in Oslo?", cache=False)]  # fmt: skip
    return engine, prompt


def _capture(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, Any, Any]]:
    """Record each attention selection: (selector, selection, context)."""
    from kvblend.blend.selectors import attention

    chosen: list[tuple[Any, Any, Any]] = []
    real = attention.AttentionSelector.select

    def recording(self, context):  # type: ignore[no-untyped-def]
        selection = real(self, context)
        chosen.append((self, selection, context))
        return selection

    monkeypatch.setattr(attention.AttentionSelector, "select", recording)
    return chosen


def _documents(context: Any, lead: int) -> list[np.ndarray]:
    """Each moved document's candidate rows: its moved rows after its first ``lead`` rows."""
    kinds = context.kinds.numpy()
    runs = []
    for span in context.spans:
        if span.kind == MOVED:
            rows = np.arange(span.start + lead, span.end)
            runs.append(rows[kinds[rows] == MOVED])
    return runs


def _positions(selection: Any) -> np.ndarray:
    computed = selection.computed
    rows = computed.positions if isinstance(computed, RowSet) else computed
    return np.asarray(rows.cpu())


def _is_top(chosen: np.ndarray, others: np.ndarray) -> bool:
    """Every chosen score is at least every other one (up to float32 sums' rounding)."""
    if chosen.size == 0 or others.size == 0:
        return True
    return bool(chosen.min() >= others.max() - 1e-5 * max(abs(others.max()), 1.0))


@pytest.mark.parametrize(("window", "funnel"), [(2, False), (5, False), (7, False), (4, True)])
def test_window_recomputes_the_top_whole_blocks_by_summed_score(
    window: int, funnel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, prompt = _engine()
    config = BLEND.replace(window=window, recompute_ratio=0.19)  # 57 rows: rounded up
    if funnel:
        config = config.replace(early_layers=0.34, early_ratio=0.5)
    chosen = _capture(monkeypatch)
    pre = engine.prefill(prompt, config)
    selector, selection, context = chosen[-1]
    kinds = context.kinds.numpy()
    moved = int(np.count_nonzero(kinds == MOVED))
    runs = _documents(context, 2)
    blocks = -(-round(0.19 * moved) // window)  # the budget of rows, rounded up to whole blocks
    assert pre.stats.recomputed_tokens == 2 * len(runs) + blocks * window
    assert engine.explain(prompt, config).forecast.recomputed_tokens == pre.stats.recomputed_tokens
    # every full block of every document, its rows and its summed score (numpy, float64)
    rows = [run[: run.size - run.size % window].reshape(-1, window) for run in runs]
    block_rows = np.concatenate(rows)
    assert (np.diff(block_rows, axis=1) == 1).all()  # consecutive rows of one document
    sums = selector.scores.double().numpy()[block_rows].sum(axis=1)
    early = blocks
    if funnel:
        early = max(-(-round(0.5 * moved) // window), blocks)
        later = selector.later.rows.positions.numpy()
        assert selector.later is not None and later.size < _positions(selection).size
    sets = [(_positions(selection), early)]
    if funnel:
        sets.append((later, blocks))
    for positions, count in sets:
        candidates = np.concatenate(runs)
        picked = np.isin(block_rows, positions)
        # each block is recomputed whole or not at all; no row outside the full blocks is
        assert (picked.all(axis=1) | ~picked.any(axis=1)).all()
        assert np.isin(positions, candidates).sum() == picked.sum() == count * window
        whole = picked.all(axis=1)
        assert _is_top(sums[whole], sums[~whole])
        assert whole.sum() == count


def test_window_one_is_the_plain_ranking(monkeypatch: pytest.MonkeyPatch) -> None:
    engine, prompt = _engine()
    chosen = _capture(monkeypatch)
    plain = engine.prefill(prompt, BLEND)
    one = engine.prefill(prompt, BLEND.replace(window=1))
    assert np.array_equal(_positions(chosen[-2][1]), _positions(chosen[-1][1]))
    assert torch.equal(plain.logits, one.logits)
    blocks = engine.prefill(prompt, BLEND.replace(window=4))
    assert not np.array_equal(_positions(chosen[-1][1]), _positions(chosen[-2][1]))
    assert not torch.equal(blocks.logits, plain.logits)


def _check_per_document(
    selector: Any, positions: np.ndarray, runs: list[np.ndarray], minimum: int, count: int
) -> None:
    """The rows are each document's top ``minimum`` and then the top of the rest."""
    scores = selector.scores.double().numpy()
    candidates = np.concatenate(runs)
    picked = np.isin(candidates, positions)
    assert picked.sum() == count
    first = []
    for run in runs:
        mine = np.isin(run, positions)
        least = min(minimum, run.size)
        assert mine.sum() >= least  # at least the document's minimum
        best = run[np.argsort(-scores[run], kind="stable")[:least]]
        assert _is_top(scores[best], scores[run[~np.isin(run, best)]])
        assert _is_top(scores[best], scores[run[~mine]])  # its own top ones, chosen
        first.extend(best)
    rest = candidates[picked & ~np.isin(candidates, first)]
    assert rest.size == count - len(first)
    assert _is_top(scores[rest], scores[candidates[~picked]])  # then the global top


def test_per_document_gives_each_document_its_top_rows_then_the_global_top(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine, prompt = _engine()
    chosen = _capture(monkeypatch)
    engine.prefill(prompt, BLEND)
    _, selection, context = chosen[-1]
    runs = _documents(context, 2)
    moved = int(np.count_nonzero(context.kinds.numpy() == MOVED))
    plain = [int(np.isin(run, _positions(selection)).sum()) for run in runs]
    minimum = min(plain) + 3  # more than the plain ranking gives some document
    assert 4 * minimum < round(0.2 * moved)  # the minima come out of the budget
    config = BLEND.replace(per_document=minimum)
    pre = engine.prefill(prompt, config)
    selector, selection, context = chosen[-1]
    assert pre.stats.recomputed_tokens == 2 * 4 + round(0.2 * moved)  # the budget unchanged
    assert engine.explain(prompt, config).forecast.recomputed_tokens == pre.stats.recomputed_tokens
    _check_per_document(selector, _positions(selection), runs, minimum, round(0.2 * moved))
    assert min(int(np.isin(run, _positions(selection)).sum()) for run in runs) >= minimum


def test_per_document_minima_above_the_budget_are_the_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine, prompt = _engine()
    chosen = _capture(monkeypatch)
    config = BLEND.replace(per_document=20, early_layers=0.34, early_ratio=0.6)
    pre = engine.prefill(prompt, config)
    selector, selection, context = chosen[-1]
    runs = _documents(context, 2)
    moved = int(np.count_nonzero(context.kinds.numpy() == MOVED))
    assert 4 * 20 > round(0.2 * moved)
    assert pre.stats.recomputed_tokens == 2 * 4 + 4 * 20
    assert engine.explain(prompt, config).forecast.recomputed_tokens == pre.stats.recomputed_tokens
    later = selector.later.rows.positions.numpy()  # the funnel keeps every document's minimum
    _check_per_document(selector, later, runs, 20, 4 * 20)
    _check_per_document(selector, _positions(selection), runs, 20, round(0.6 * moved))
    everything = engine.prefill(prompt, BLEND.replace(per_document=200))
    assert everything.stats.recomputed_tokens == moved
    assert everything.stats.fallback is not None
    assert everything.stats.fallback.startswith("per_document: 200 tokens of each moved document")


def test_window_and_per_document_count_whole_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    engine, prompt = _engine()
    chosen = _capture(monkeypatch)
    config = BLEND.replace(window=4, per_document=6)  # two blocks of each document first
    pre = engine.prefill(prompt, config)
    selector, selection, context = chosen[-1]
    runs = _documents(context, 2)
    moved = int(np.count_nonzero(context.kinds.numpy() == MOVED))
    blocks = max(-(-round(0.2 * moved) // 4), 4 * 2)
    assert pre.stats.recomputed_tokens == 2 * 4 + 4 * blocks
    assert engine.explain(prompt, config).forecast.recomputed_tokens == pre.stats.recomputed_tokens
    positions = _positions(selection)
    scores = selector.scores.double().numpy()
    for run in runs:
        block_rows = run[: run.size - run.size % 4].reshape(-1, 4)
        picked = np.isin(block_rows, positions)
        assert (picked.all(axis=1) | ~picked.any(axis=1)).all()
        assert picked.all(axis=1).sum() >= 2
        sums = scores[block_rows].sum(axis=1)
        best = np.argsort(-sums, kind="stable")[:2]
        assert picked[best].all()


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"window": 0}, "window must be an int >= 1"),
        ({"window": -2}, "window must be an int >= 1"),
        ({"window": 2.0}, "window must be an int >= 1"),
        ({"window": True}, "window must be an int >= 1"),
        ({"per_document": -1}, "per_document must be a non-negative int"),
        ({"per_document": 1.5}, "per_document must be a non-negative int"),
        ({"per_document": False}, "per_document must be a non-negative int"),
    ],
)
def test_bad_values_of_window_and_per_document_name_the_setting(settings: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        BlendConfig(**settings)
    with pytest.raises(ValueError, match="strategy 'cacheblend' does not use 'window'"):
        BlendConfig("cacheblend", window=2)


def _rows_per_layer(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    from kvblend.blend import loop as blend

    passes: list[list[int]] = []
    real = blend.compute_layer

    def recording(state, layer, *args):  # type: ignore[no-untyped-def]
        if layer == 0:
            passes.append([])
        passes[-1].append(state.rows.count)
        return real(state, layer, *args)

    monkeypatch.setattr(blend, "compute_layer", recording)
    return passes


def test_forecast_equals_what_select_recomputes_on_random_prompts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Random documents, orders, heads and settings: the prefill's recomputed rows (at every
    layer, the funnel's included) are the ones `attention_budget` and ``explain`` count."""
    from kvblend.blend.selectors.attention import attention_budget

    rng = random.Random(7)
    engine = BlendEngine(tiny_model("qwen2"), byte_tokenizer(), store=MemoryKVStore())
    words = ["ant", "bee", "cat", "dog", "eel", "fox", "gnu", "hen", "owl", "yak", "Oslo", "Lima"]
    library = [" ".join(rng.choice(words) for _ in range(rng.randint(2, 30))) + "."
               for _ in range(12)]  # fmt: skip
    engine.precompute(library)
    chosen = _capture(monkeypatch)
    passes = _rows_per_layer(monkeypatch)
    checked = blocks_and_minima = 0
    for _ in range(120):
        documents = rng.sample(library, rng.randint(1, 5))
        head = [Segment("Notes:\n", role="prefix")] if rng.random() < 0.5 else ["Notes:\n"]
        joiner = rng.choice(["", "\n", " | "])
        middle: list[Any] = []
        for document in documents:
            middle += [Segment(document), joiner] if joiner else [Segment(document)]
        prompt = [*head, *middle, Segment("\nWhich animal?", cache=False)]
        config = BlendConfig(
            recompute_ratio=rng.choice([0.0, 0.1, 0.2, 0.5]),
            min_recompute=rng.choice([0, 0, 16, 60]),
            lead_tokens=rng.choice([0, 2, 8]),
            short_document=rng.choice([0, 6, 32]),
            full_above=rng.choice([1.0, 1.0, 0.8]),
            early_layers=rng.choice([0.0, 1 / 3, 2 / 3]),
            early_ratio=rng.choice([0.1, 0.4, 0.9]),
            probe_tail=rng.random() < 0.3,
            window=rng.choice([1, 2, 3, 4, 7]),
            per_document=rng.choice([0, 0, 1, 5, 16]),
        )
        chosen.clear()
        passes.clear()
        forecast = engine.explain(prompt, config).forecast
        pre = engine.prefill(prompt, config)
        assert pre.stats.recomputed_tokens == forecast.recomputed_tokens, config
        assert pre.stats.fallback == forecast.fallback, config
        if not chosen:  # no documents, or a fallback that skips the strategy
            continue
        selector, selection, context = chosen[-1]
        kinds = context.kinds.numpy()
        budget = attention_budget(kinds, context.spans, selector.options)
        uncached = int(np.count_nonzero(kinds == COMPUTE))
        main = passes[-1]
        assert main[0] == uncached + budget.lead + budget.early, config  # the first layer
        assert main[-1] == uncached + budget.recomputed, config  # the last layer
        assert _positions(selection).size == main[0]
        assert forecast.computed_rows == pytest.approx(
            pre.stats.compute_fraction * pre.stats.prompt_tokens, rel=1e-6
        ), config
        checked += 1
        blocks_and_minima += (config.window > 1 or config.per_document > 0) and budget.probe > 0
    assert checked >= 60 and blocks_and_minima >= 20  # the random settings blended and ranked


@pytest.mark.parametrize(
    "settings", [{"window": 4}, {"per_document": 5}, {"window": 2, "per_document": 3,
                                                      "early_layers": 0.34}]
)  # fmt: skip
def test_the_compiled_loop_runs_blocks_and_minima_as_the_eager_one(
    settings: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvblend.blend import compiled as compiled_loop

    engine = make_tiny_engine("qwen2")
    engine.precompute(DOCUMENTS, progress=False)
    prompt = [Segment("System: answer.\n", role="prefix"), *map(Segment, DOCUMENTS[::-1]),
              Segment("\nQuestion: who keeps bees?\nAnswer:", cache=False)]  # fmt: skip
    config = BlendConfig(**TOY_BLEND_SETTINGS, recompute_ratio=0.2, **settings)
    monkeypatch.setenv(compiled_loop.COMPILE_ENV, "0")
    eager = engine.prefill(prompt, config)
    monkeypatch.setenv(compiled_loop.COMPILE_ENV, "1")
    got = engine.prefill(prompt, config)
    assert got.stats.recomputed_tokens == eager.stats.recomputed_tokens
    assert got.stats.uncompiled_calls == 0
    torch.testing.assert_close(got.logits, eager.logits, atol=1e-5, rtol=0)


def test_a_funnel_of_every_row_early_and_none_later_narrows_as_forecast(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Nothing to rank (every candidate early, none after): the rows are known on the host and
    the funnel still narrows to the leading rows after its early layers."""
    engine, prompt = _engine()
    passes = _rows_per_layer(monkeypatch)
    config = BLEND.replace(recompute_ratio=0.0, early_ratio=1.0, early_layers=0.34)
    pre = engine.prefill(prompt, config)
    assert pre.stats.recomputed_tokens == 2 * 4
    assert engine.explain(prompt, config).forecast.recomputed_tokens == 2 * 4
    (main,) = passes[-1:]  # no probe: a single pass
    uncached = main[-1] - 2 * 4
    assert main == [uncached + pre.stats.moved_tokens, uncached + 8, uncached + 8]
