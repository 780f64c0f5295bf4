"""Exactness of the blend loop against transformers' own forward pass, for every family."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import byte_tokenizer, tiny_model, transformers_rope
from kvblend import BlendConfig, BlendEngine, Segment
from kvblend.blend.prefill import run_blend, selection_context
from kvblend.blend.selectors.attention import AttentionSelector
from kvblend.blend.selectors.tail_attention import tail_rows
from kvblend.blend.types import COMPUTE, MOVED, BlendInput, RowSet
from kvblend.documents import blend_plan as blend_plan_module
from kvblend.store import MemoryKVStore

SYSTEM = "System: answer from the documents.\n"
DOCS = [
    "Doc one: Marta Quill lives in Lisbon and keeps bees.",
    "Doc two: the {orange} cat\nsleeps all day — très calme.",
    "Doc three: a meeting at 9:30 in room 12.",
]
QUESTION = "\nQuestion: where does Marta live?\nAnswer:"
STRATEGIES = [
    BlendConfig("full"),
    BlendConfig("cacheblend", recompute_ratio=0.15),
    BlendConfig("cacheblend", recompute_ratio=0.3, deviation="key", check_layer=2),
    BlendConfig("cacheblend", ratio_schedule=((1, 0.5), (2, 0.2))),
    BlendConfig("epic", epic_tokens=4),
    BlendConfig("attention", recompute_ratio=0.3, min_recompute=0, full_above=1.0),  # a blend
    BlendConfig("reuse"),
]


def segments(order=(0, 1, 2)) -> list[Segment]:
    return [
        Segment(SYSTEM, role="prefix"),
        *[Segment(DOCS[i]) for i in order],
        Segment(QUESTION, cache=False),
    ]


def hf_logits(engine: BlendEngine, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return (
            engine.model(torch.tensor([token_ids], device=engine.decoder.device))
            .logits[0, -1]
            .float()
        )


def report(got: torch.Tensor, expected: torch.Tensor) -> str:
    error = (got - expected).abs()
    return f"max abs error {error.max():.3g}, mean {error.mean():.3g}"


def test_full_matches_transformers_forward(device_engine: BlendEngine) -> None:
    pre = device_engine.prefill(segments(), BlendConfig("full"))
    expected = hf_logits(device_engine, pre.token_ids)
    assert pre.logits.dtype == torch.float32 and pre.logits.shape == expected.shape
    assert torch.allclose(pre.logits, expected, atol=1e-4, rtol=0), report(pre.logits, expected)
    assert device_engine.parity_error is not None and device_engine.parity_error < 1e-4


def test_token_ids_are_the_whole_text_tokenized(tiny_engine: BlendEngine) -> None:
    tiny_engine.precompute(DOCS)
    pre = tiny_engine.prefill(segments((2, 0, 1)), BlendConfig("reuse"))
    text = "".join([SYSTEM, DOCS[2], DOCS[0], DOCS[1], QUESTION])
    assert pre.token_ids == tiny_engine.tokenizer(text)["input_ids"]
    assert pre.token_ids[0] == tiny_engine.tokenizer.bos_token_id


def plant_in_context_kv(engine: BlendEngine, token_ids: list[int], order) -> None:
    """Store each document's KV as computed in the full prompt, under its segment id."""
    ids = torch.tensor(token_ids, device=engine.decoder.device)
    kinds = torch.full((len(ids),), COMPUTE, dtype=torch.int8, device=ids.device)
    exact = run_blend(
        engine.decoder,
        BlendInput(ids, kinds, []),
        BlendConfig("full").selector(),
    )
    assert exact.raw_kv is not None
    # Plant the in-context KV under each document's store key.
    cursor = len(engine.tokenize(SYSTEM)) + 1  # after BOS and the system prompt
    for index in order:
        length = len(engine.tokenize(DOCS[index]))
        tensors = {"kv": exact.raw_kv[:, :, :, cursor : cursor + length].contiguous()}
        engine.store.put(engine.segment_id(DOCS[index]), tensors)
        cursor += length


@pytest.mark.parametrize("config", STRATEGIES, ids=lambda c: f"{c.strategy}")
def test_kv_from_real_context_makes_every_strategy_exact(
    device_engine: BlendEngine, config: BlendConfig
) -> None:
    """With each segment's cached KV taken from its real context, blending changes nothing."""
    order = (1, 2, 0)
    reference = device_engine.prefill(segments(order), BlendConfig("full"))
    plant_in_context_kv(device_engine, reference.token_ids, order)
    pre = device_engine.prefill(segments(order), config)
    assert pre.token_ids == reference.token_ids
    assert torch.allclose(pre.logits, reference.logits, atol=1e-4, rtol=0), report(
        pre.logits, reference.logits
    )
    for got, expected in zip(pre.keys, reference.keys, strict=True):
        assert torch.allclose(got, expected, atol=1e-4, rtol=0)


def test_rope_replacement_equals_computing_at_target_positions(device_engine: BlendEngine) -> None:
    """Layer-0 keys of a moved document equal transformers' keys at its new positions."""
    device_engine.precompute(DOCS)
    pre = device_engine.prefill(segments((2, 1, 0)), BlendConfig("reuse"))
    with torch.inference_mode():
        out = device_engine.model(
            torch.tensor([pre.token_ids], device=device_engine.decoder.device), use_cache=True
        )
    hf_keys = out.past_key_values.layers[0].keys[0]  # a sliding-window layer keeps the tail only
    got = pre.keys[0][:, -hf_keys.shape[1] :]
    assert torch.allclose(got, hf_keys, atol=1e-5, rtol=0), report(got, hf_keys)


def test_prefix_is_reused_exactly_with_no_recompute(tiny_engine: BlendEngine) -> None:
    only_prefix = [Segment(SYSTEM, role="prefix"), Segment(QUESTION, cache=False)]
    reference = tiny_engine.prefill(only_prefix, BlendConfig("full"))
    tiny_engine.prefill(only_prefix, BlendConfig("reuse"))  # caches the prefix
    pre = tiny_engine.prefill(only_prefix, BlendConfig("cacheblend", recompute_ratio=1.0))
    system_tokens = len(tiny_engine.encode(SYSTEM))  # the BOS and the system prompt
    assert pre.stats.prefix_tokens == system_tokens
    assert pre.stats.reused_tokens == system_tokens
    assert pre.stats.recomputed_tokens == 0
    assert pre.stats.segments_precomputed == 0
    assert torch.allclose(pre.logits, reference.logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("config", STRATEGIES[1:], ids=lambda c: c.strategy)
def test_uncached_tokens_are_always_computed(tiny_engine: BlendEngine, config: BlendConfig) -> None:
    tiny_engine.precompute(DOCS)
    between = Segment(" -- ", cache=False)
    prompt = [
        Segment(SYSTEM, role="prefix"),
        Segment(DOCS[0]),
        between,
        Segment("A new document nobody cached.", cache=False),
        Segment(DOCS[1]),
        Segment(QUESTION, cache=False),
    ]
    pre = tiny_engine.prefill(prompt, config)
    uncached = sum(len(tiny_engine.tokenize(s.text)) for s in prompt if not s.cache)
    moved = len(tiny_engine.tokenize(DOCS[0])) + len(tiny_engine.tokenize(DOCS[1]))
    stats = pre.stats
    assert stats.computed_tokens == uncached
    assert stats.moved_tokens == moved
    assert stats.reused_tokens + stats.recomputed_tokens + stats.computed_tokens == len(
        pre.token_ids
    )
    if config.strategy == "reuse":
        assert stats.recomputed_tokens == 0
    if config.strategy == "cacheblend":
        schedule = config.ratio_schedule or ((config.check_layer, config.recompute_ratio),)
        assert stats.recomputed_tokens == round(schedule[-1][1] * moved)
    if config.strategy == "attention":
        leads = sum(min(config.lead_tokens, len(tiny_engine.tokenize(d))) for d in DOCS[:2])
        expected = min(moved, leads + round(config.recompute_ratio * moved))
        assert stats.recomputed_tokens == expected


def test_cacheblend_ratio_one_equals_full(tiny_engine: BlendEngine) -> None:
    tiny_engine.precompute(DOCS)
    reference = tiny_engine.prefill(segments((2, 0, 1)), BlendConfig("full"))
    config = BlendConfig("cacheblend", recompute_ratio=1.0)
    pre = tiny_engine.prefill(segments((2, 0, 1)), config)
    assert pre.stats.strategy == "cacheblend"
    assert pre.stats.recomputed_tokens == pre.stats.moved_tokens > 0
    assert torch.allclose(pre.logits, reference.logits, atol=1e-4, rtol=0)


def test_attention_ratio_one_equals_full_and_zero_equals_reuse(tiny_engine: BlendEngine) -> None:
    tiny_engine.precompute(DOCS)
    prompt = segments((2, 0, 1))
    full = tiny_engine.prefill(prompt, BlendConfig("full"))
    everything = tiny_engine.prefill(prompt, BlendConfig("attention", recompute_ratio=1.0))
    assert everything.stats.recomputed_tokens == everything.stats.moved_tokens > 0
    assert torch.allclose(everything.logits, full.logits, atol=1e-4, rtol=0)
    reuse = tiny_engine.prefill(prompt, BlendConfig("reuse"))
    nothing = tiny_engine.prefill(
        prompt,
        BlendConfig("attention", recompute_ratio=0.0, early_ratio=0.0, lead_tokens=0,
                    min_recompute=0, per_document=0),
    )  # fmt: skip
    assert nothing.stats.recomputed_tokens == 0 and "probe_s" in nothing.stats.timings
    assert torch.equal(nothing.logits, reuse.logits)


def test_blending_reads_cached_kv_not_fresh(tiny_engine: BlendEngine) -> None:
    """Reuse must differ from full on moved documents (it really reads the cache)."""
    tiny_engine.precompute(DOCS)
    full = tiny_engine.prefill(segments(), BlendConfig("full"))
    reuse = tiny_engine.prefill(segments(), BlendConfig("reuse"))
    assert reuse.stats.segments_precomputed == 1  # only the prefix was not precomputed
    assert not torch.allclose(full.logits, reuse.logits, atol=1e-4)


def test_missing_segment_is_computed_and_stored(tiny_engine: BlendEngine) -> None:
    first = tiny_engine.prefill(segments(), BlendConfig())
    assert first.stats.segments_precomputed == 4  # the prefix and three documents
    second = tiny_engine.prefill(segments((1, 0, 2)), BlendConfig())
    assert second.stats.segments_precomputed == 0
    assert tiny_engine.store.contains(tiny_engine.segment_id(DOCS[0]))


def test_full_greedy_generation_equals_model_generate(device_engine: BlendEngine) -> None:
    out = device_engine.generate(segments(), BlendConfig("full"), max_new_tokens=12)
    out_ids = device_engine.prefill(segments(), BlendConfig("full")).token_ids
    ids = torch.tensor([out_ids], device=device_engine.decoder.device)
    with torch.inference_mode():
        expected = device_engine.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
            pad_token_id=0, eos_token_id=1,
        )  # fmt: skip
    assert out.token_ids == expected[0, len(out_ids) :].tolist()
    assert out.ttft_s > 0 and out.total_s >= out.ttft_s


def test_stream_concatenates_to_generate(tiny_engine: BlendEngine) -> None:
    config = BlendConfig("cacheblend")
    whole = tiny_engine.generate(segments(), config, max_new_tokens=10)
    pieces = list(tiny_engine.stream(segments(), config, max_new_tokens=10))
    assert "".join(pieces) == whole.text


def test_stop_string_cuts_output(tiny_engine: BlendEngine) -> None:
    whole = tiny_engine.generate(segments(), BlendConfig("full"), max_new_tokens=16)
    assert len(whole.text) > 3
    stop = whole.text[2:4]
    cut = tiny_engine.generate(segments(), BlendConfig("full"), max_new_tokens=16, stop=[stop])
    assert stop not in cut.text and whole.text.startswith(cut.text)
    assert cut.finish_reason == "stop"
    # transformers' stop-string criterion scans the vocabulary once per tokenizer and stop tuple
    from kvblend.decoding.generation import stop_criteria

    assert stop_criteria(tiny_engine.tokenizer, (stop,)) is stop_criteria(
        tiny_engine.tokenizer, (stop,)
    )
    streamed = "".join(
        tiny_engine.stream(segments(), BlendConfig("full"), max_new_tokens=16, stop=[stop])
    )
    assert streamed == cut.text


def test_first_token_is_picked_from_the_prefill_logits(tiny_engine: BlendEngine) -> None:
    config = BlendConfig("cacheblend")
    pre = tiny_engine.prefill(segments(), config)
    one = tiny_engine.generate(pre, max_new_tokens=1)
    assert one.token_ids == [int(pre.logits.argmax())]
    eos = tiny_engine.model.generation_config.eos_token_id
    assert one.finish_reason == ("stop" if one.token_ids[0] == eos else "length")
    longer = tiny_engine.generate(pre, max_new_tokens=6)
    assert longer.token_ids[0] == one.token_ids[0]
    streamed = "".join(tiny_engine.stream(pre, max_new_tokens=1))
    assert streamed == tiny_engine.tokenizer.decode(one.token_ids, skip_special_tokens=True)


def test_sampling_with_a_tiny_top_p_is_greedy(tiny_engine: BlendEngine) -> None:
    pre = tiny_engine.prefill(segments(), BlendConfig("cacheblend"))
    greedy = tiny_engine.generate(pre, max_new_tokens=8)
    sampled = tiny_engine.generate(pre, max_new_tokens=8, temperature=1.0, top_p=1e-9, seed=0)
    assert sampled.token_ids == greedy.token_ids
    first = tiny_engine.generate(pre, max_new_tokens=8, temperature=1.5, seed=3)
    again = tiny_engine.generate(pre, max_new_tokens=8, temperature=1.5, seed=3)
    assert first.token_ids == again.token_ids


def test_end_of_sequence_as_first_token_ends_the_answer(tiny_engine: BlendEngine) -> None:
    pre = tiny_engine.prefill(segments(), BlendConfig("cacheblend"))
    eos = tiny_engine.model.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    logits = torch.full_like(pre.logits, -10.0)
    logits[eos] = 10.0
    pre.logits = logits
    out = tiny_engine.generate(pre, max_new_tokens=8)
    assert out.token_ids == [eos] and out.finish_reason == "stop"
    assert list(tiny_engine.stream(pre, max_new_tokens=8)) == []


def test_no_bos_tokenizer_and_single_segment() -> None:
    engine = BlendEngine(tiny_model("qwen2"), byte_tokenizer(bos=False), store=MemoryKVStore())
    pre = engine.prefill(["just a question"], BlendConfig())
    assert pre.token_ids == engine.tokenize("just a question")
    assert pre.stats.computed_tokens == len(pre.token_ids)
    only_doc = engine.prefill([Segment("a cached document only")], BlendConfig())
    assert only_doc.stats.computed_tokens == 1  # the last token always produces the logits


def dense_reference(decoder, q, k, v, window):
    """Every row's attention with transformers' rule (key <= query, within the window)."""
    from kvblend.blend.attention.rows import attention_mask, sdpa

    total = q.shape[1]
    mask = attention_mask(torch.arange(total), 0, total, window, q.dtype)
    return sdpa(q, k, v, decoder.scaling, mask)


@pytest.mark.parametrize("pattern", ["sparse", "prefix-then-block", "device-chosen"])
def test_attention_of_active_rows_matches_dense_causal(
    tiny_engine: BlendEngine, pattern: str
) -> None:
    """Masked query chunks (sparse rows; from host bounds of rows chosen on the device too)
    and scattered dense attention (mostly active rows) equal dense causal attention."""
    from kvblend.blend.attention.rows import RowAttention
    from kvblend.blend.selectors.base import chosen_rows
    from kvblend.blend.types import RowSet

    decoder, shape = tiny_engine.decoder, tiny_engine.decoder.shape
    total = 700
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(shape.num_heads, total, shape.head_dim, generator=generator)
    k = torch.randn(shape.num_kv_heads, total, shape.head_dim, generator=generator)
    v = torch.randn(shape.num_kv_heads, total, shape.head_dim, generator=generator)
    if pattern == "sparse":  # several query chunks, the last row always active
        chosen = torch.randperm(total - 1, generator=generator)[:299]
        positions = torch.cat([chosen, torch.tensor([total - 1])]).sort().values
        rows = RowSet.from_host(positions.numpy(), decoder.device)
    elif pattern == "prefix-then-block":  # BOS computed, a reused prefix, then every row
        positions = torch.cat([torch.tensor([0]), torch.arange(120, total)])
        rows = RowSet.from_host(positions.numpy(), decoder.device)
    else:  # 200 of 600 candidates chosen on the device: the host knows bounds only
        base = np.array([0, *range(650, total)])
        candidates = np.arange(50, 650)
        chosen = torch.from_numpy(candidates)[torch.randperm(600, generator=generator)[:200]]
        rows = chosen_rows(base, chosen, candidates, decoder.device)
        positions = rows.positions
        assert rows.host is None and rows.bounds() is not None
    attention = RowAttention(rows, total, decoder.windows, decoder.scaling, q.dtype)
    assert attention.scatter == (pattern == "prefix-then-block")
    assert attention.rows.host is None or pattern != "device-chosen"  # never read back
    for window in decoder.windows:
        expected = dense_reference(decoder, q, k, v, window)[positions]
        got = attention(window, q[:, positions], k, v)
        assert torch.allclose(got, expected, atol=1e-5, rtol=0), report(got, expected)


def test_default_doc_context_is_the_rag_prompt_head(tiny_engine: BlendEngine) -> None:
    """Documents are precomputed behind `rag_prefix`: placed first, they are reused exactly."""
    engine = tiny_engine
    assert engine.doc_prefix == engine.rag_prefix()
    assert engine.system_prompt and engine.system_prompt in engine.doc_prefix
    segments = engine.rag_segments("where does Marta live?", [DOCS[0], DOCS[1]])
    assert segments[0].text == engine.rag_prefix()
    engine.precompute(DOCS[:2])
    full = engine.prefill(segments, BlendConfig("full"))
    # Only the first document: its KV is the in-context KV, so reusing it changes nothing.
    first_only = [segments[0], segments[1], Segment(segments[-1].text, cache=False)]
    exact = engine.prefill(first_only, BlendConfig("reuse"))
    expected = engine.prefill(first_only, BlendConfig("full"))
    # ... and it counts as exact reuse (a prefix), never as a candidate for recompute
    first_tokens = len(engine.tokenize(DOCS[0]))
    assert exact.stats.moved_tokens == 0 and exact.stats.recomputed_tokens == 0
    assert exact.stats.prefix_tokens == len(engine.encode(segments[0].text)) + first_tokens
    assert torch.allclose(exact.logits, expected.logits, atol=1e-4, rtol=0), report(
        exact.logits, expected.logits
    )
    # The second document follows the first instead of the head: it is moved, not exact.
    moved = engine.prefill(segments, BlendConfig("reuse"))
    assert moved.stats.moved_tokens == len(engine.tokenize(DOCS[1]))
    assert not torch.allclose(moved.logits, full.logits, atol=1e-4, rtol=0)
    # A moved document whose text is placed first but behind another head is not exact.
    other_head = [Segment("Other head:\n", role="prefix"), *segments[1:]]
    assert engine.prefill(other_head, BlendConfig("reuse")).stats.moved_tokens == len(
        engine.tokenize(DOCS[0])
    ) + len(engine.tokenize(DOCS[1]))


def test_doc_context_is_part_of_the_segment_id() -> None:
    model, tokenizer = tiny_model("llama"), byte_tokenizer()
    ids = {
        BlendEngine(model, tokenizer, store=MemoryKVStore(), **kwargs).segment_id(DOCS[0])
        for kwargs in (
            {},
            {"system_prompt": "Other system prompt."},
            {"doc_prefix": None},
            {"doc_prefix": "Context:\n"},
        )
    }
    assert len(ids) == 4
    bos_only = BlendEngine(model, tokenizer, store=MemoryKVStore(), doc_prefix=None)
    assert bos_only.doc_prefix is None
    assert bos_only.rag_segments("q?", ["d"], system="")[0].text == bos_only.rag_prefix(system="")


def test_attention_probe_equals_transformers_attention_weights(
    tiny_engine: BlendEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe's scores are transformers' eager attention weights times value norms, summed.

    With every document's KV from its real context, the probe pass (uncached tokens over
    reused KV) computes exactly what the full forward computes for the question rows, so its
    scores must equal the attention weights transformers returns for those rows, times the
    norm of each key's value (from the model's own modules on its hidden states), summed over
    layers, heads and rows (sliding windows and GQA included).
    """
    order = (2, 0, 1)
    reference = tiny_engine.prefill(segments(order), BlendConfig("full"))
    plant_in_context_kv(tiny_engine, reference.token_ids, order)
    seen: list[BlendInput] = []

    def recording_run_blend(decoder, blend_input, config, **kwargs):
        seen.append(blend_input)
        return run_blend(decoder, blend_input, config, **kwargs)

    monkeypatch.setattr(blend_plan_module, "run_blend", recording_run_blend)
    config = BlendConfig(
        "attention",
        recompute_ratio=0.25,
        early_layers=0,
        lead_tokens=0,
        min_recompute=0,
        per_document=0,
        probe_tail=False,
    )
    pre = tiny_engine.prefill(segments(order), config)
    assert pre.token_ids == reference.token_ids
    model = tiny_engine.model
    model.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            out = model(
                torch.tensor([reference.token_ids]),
                output_attentions=True,
                output_hidden_states=True,
            )
            value_norms = []
            for layer, hidden in zip(model.model.layers, out.hidden_states, strict=False):
                values = layer.self_attn.v_proj(layer.input_layernorm(hidden[0]))
                head_dim = layer.self_attn.head_dim
                value_norms.append(values.view(len(hidden[0]), -1, head_dim).norm(dim=-1).T)
    finally:
        model.set_attn_implementation("sdpa")
    inputs = seen[-1]  # the prompt the prefill ran
    tail = tail_rows(inputs.kinds)
    assert int(tail[0]) > int((inputs.kinds == MOVED).nonzero()[-1])
    kv_heads = value_norms[0].shape[0]
    expected = sum(
        (
            weights[0][:, tail].sum(dim=1).view(kv_heads, -1, weights.shape[-1]).sum(dim=1) * norms
        ).sum(dim=0)
        for weights, norms in zip(out.attentions, value_norms, strict=True)
    )
    selected, scores = attention_selection(tiny_engine, inputs, config)
    assert torch.allclose(scores, expected.float(), atol=1e-4), (scores - expected).abs().max()
    moved = (inputs.kinds == MOVED).nonzero().squeeze(1)
    assert selected.numel() == pre.stats.recomputed_tokens == round(0.25 * moved.numel())
    # the selected rows are the moved rows the question attends to most
    threshold = scores[selected].min()
    others = moved[~torch.isin(moved, selected)]
    assert bool((scores[others] <= threshold).all())


def attention_selection(
    engine: BlendEngine, inputs: BlendInput, config: BlendConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """The moved rows the `attention` selector picks under ``config``, and its probe's scores."""
    selector = AttentionSelector(config.settings)
    with torch.inference_mode():
        selection = selector.select(selection_context(engine.decoder, inputs))
    rows = selection.computed
    assert isinstance(rows, RowSet) and rows.host is None  # chosen on the device
    positions = rows.positions
    return positions[inputs.kinds[positions] == MOVED], selector.scores


@pytest.mark.parametrize("share", [0.0, 0.5, 1.0])
def test_correction_moves_each_document_by_a_share_of_its_recomputed_change(
    tiny_engine: BlendEngine, monkeypatch: pytest.MonkeyPatch, share: float
) -> None:
    """Rows read from the cache move by ``share`` x the mean change of their document's
    recomputed rows (fresh minus cached, keys before RoPE), at every layer; recomputed rows and
    uncached rows are computed as without the correction's share on them."""
    order = (2, 0, 1)
    tiny_engine.precompute(DOCS)
    seen: list[BlendInput] = []

    def recording_run_blend(decoder, blend_input, config, **kwargs):
        seen.append(blend_input)
        return run_blend(decoder, blend_input, config, **kwargs)

    monkeypatch.setattr(blend_plan_module, "run_blend", recording_run_blend)
    config = BlendConfig(
        "attention", recompute_ratio=0.3, early_layers=0, min_recompute=0, full_above=1.0,
        correction=share,
    )  # fmt: skip
    pre = tiny_engine.prefill(segments(order), config)
    inputs = seen[-1]
    selected, _ = attention_selection(tiny_engine, inputs, config)
    decoder = tiny_engine.decoder
    cos, sin = decoder.rotary(torch.arange(len(pre.token_ids)))
    documents = []  # (rows, stored entry) of each moved document
    cursor = len(tiny_engine.tokenize(SYSTEM)) + 1  # after BOS and the system prompt
    for index in order:
        length = len(tiny_engine.tokenize(DOCS[index]))
        rows = torch.arange(cursor, cursor + length)
        documents.append((rows, tiny_engine.store.get(tiny_engine.segment_id(DOCS[index]))))
        cursor += length
    assert bool((inputs.kinds[torch.cat([rows for rows, _ in documents])] == MOVED).all())
    checked = 0
    for layer in range(decoder.shape.num_layers):
        raw_keys = transformers_rope(pre.keys[layer], cos, -sin)  # undo RoPE
        changes, fixed = [], []
        for rows, entry in documents:
            cached = {"k": entry["kv"][layer, 0], "v": entry["kv"][layer, 1]}
            got = {"k": raw_keys[:, rows], "v": pre.values[layer][:, rows]}
            recomputed = torch.isin(rows, selected)
            change = {n: (got[n] - cached[n])[:, recomputed] for n in "kv"}
            changes.append(change)
            fixed.append((got, cached, recomputed, change))
        everything = {n: torch.cat([c[n] for c in changes], dim=1).mean(dim=1) for n in "kv"}
        for got, cached, recomputed, change in fixed:
            for name in "kv":
                mean = change[name].mean(dim=1) if bool(recomputed.any()) else everything[name]
                expected = cached[name][:, ~recomputed] + share * mean.unsqueeze(1)
                actual = got[name][:, ~recomputed]
                assert torch.allclose(actual, expected, atol=1e-4), (
                    f"layer {layer} {name}: {report(actual, expected)}"
                )
                checked += int((~recomputed).sum())
    assert checked > 0 and selected.numel() > 0
    if share:  # the correction changed something the question reads
        plain = tiny_engine.prefill(
            segments(order),
            BlendConfig("attention", recompute_ratio=0.3, min_recompute=0, correction=0),
        )
        assert not torch.allclose(plain.logits, pre.logits, atol=1e-5)


def test_kv_kept_for_the_store_owns_its_memory() -> None:
    """The loop keeps every layer's K/V in one buffer, keys rotated; the K/V to be stored
    (`raw_kv`, keys before RoPE) is a tensor of its own, so a store never sees the buffer."""
    from kvblend.blend.prefill import run_blend
    from kvblend.blend.types import COMPUTE, BlendInput
    from kvblend.models.decoder import Decoder

    decoder = Decoder(tiny_model("qwen2"))
    ids = torch.arange(3, 23)
    kinds = torch.full((ids.numel(),), COMPUTE, dtype=torch.int8)
    out = run_blend(
        decoder, BlendInput(ids, kinds, []), BlendConfig("full").selector(), need_logits=False
    )
    raw = out.raw_kv
    assert raw is not None and raw.shape[3] == ids.numel()
    buffer = out.keys[0].untyped_storage().data_ptr()
    assert raw.untyped_storage().data_ptr() != buffer
    cos, sin = decoder.rotary(torch.arange(ids.numel()))
    for layer, keys in enumerate(out.keys):  # the stored keys, rotated, are the loop's keys
        rotated = transformers_rope(raw[layer, 0], cos, sin)
        assert torch.allclose(rotated, keys, atol=1e-6, rtol=0)
        assert torch.equal(raw[layer, 1], out.values[layer])
