"""Batched precompute stores the same KV as computing each document alone, for every family.

The reference is `SegmentKV.compute`: one document through the blend loop's full prefill,
itself checked against transformers' forward pass (test_engine_exact.py). In float32 the
batched rows may differ from it only by the rounding of differently shaped matrix products:
measured at most 3e-7 of a tensor's magnitude (a few float32 epsilons; the one-by-one path with
1 and with 2 CPU threads agrees to the bit on these models), so the bound is 1e-5, about 80
epsilons, while a padding or mask error moves the KV by whole percents. In bfloat16 the bound
is derived from bf16 itself: the batched KV may be at most twice as far from the float32 KV as
the one-by-one bf16 KV is. On a GPU:
``pytest tests/documents/test_precompute_batch.py --device cuda``.
"""

from __future__ import annotations

import pytest
import torch

from conftest import byte_tokenizer, tiny_model
from kvblend import BlendConfig, BlendEngine, Segment
from kvblend.documents.precompute import document_kv, length_batches
from kvblend.store import MemoryKVStore

# Mixed lengths: shorter and longer than the sliding window (48) of the tiny Mistral.
DOCS = [
    "Short one.",
    "Doc two: the {orange} cat\nsleeps all day — très calme, near the window sill.",
    "Doc three: Marta Quill lives in Lisbon and keeps bees " * 3,
    "Doc four: a meeting at 9:30 in room 12.",
    "x" * 70,
]
QUESTION = "\nQuestion: where does Marta live?\nAnswer:"
STRATEGIES = [
    BlendConfig(),
    BlendConfig("reuse"),
    BlendConfig("cacheblend", recompute_ratio=0.15),
    BlendConfig("epic", epic_tokens=4),
    BlendConfig("attention", recompute_ratio=0.3),
]


def engine_for(model: torch.nn.Module, name: str) -> BlendEngine:
    return BlendEngine(model, byte_tokenizer(), store=MemoryKVStore(), name=name)


def one_by_one(engine: BlendEngine, texts: list[str]) -> list[str]:
    keys = []
    for text in texts:
        layout = engine.library.segment_kv.layout(text)
        key = engine.segment_id(text)
        engine.library.segment_kv.compute(key, layout.context_ids, layout.ids)
        keys.append(key)
    return keys


def relative_errors(a: BlendEngine, b: BlendEngine, keys: list[str]) -> dict[str, float]:
    """Max abs difference / max abs value, per tensor of every entry; entries must match."""
    errors = {}
    for key in keys:
        entry_a, entry_b = a.store.get(key), b.store.get(key)
        assert entry_a is not None and entry_b is not None
        assert list(entry_a) == list(entry_b)
        described = sorted(name for name in entry_b.metadata if name.startswith("document."))
        assert described and described == sorted(set(entry_b.metadata) - set(entry_a.metadata))
        assert entry_a.metadata == {
            name: value for name, value in entry_b.metadata.items() if name not in described
        }  # precompute's entries also name their document, for the registry
        for name in entry_a:
            x, y = entry_a[name].float(), entry_b[name].float()
            assert x.shape == y.shape and entry_a[name].dtype == entry_b[name].dtype
            assert y.is_contiguous()
            errors[f"{key[:8]}/{name}"] = float((x - y).abs().max() / x.abs().max())
    return errors


def test_length_batches_sort_by_length_and_keep_the_budget() -> None:
    lengths = [100, 400, 250, 90, 400, 1000, 30]
    batches = length_batches(lengths, batch_tokens=800)
    assert sorted(i for batch in batches for i in batch) == list(range(len(lengths)))
    flat = [lengths[i] for batch in batches for i in batch]
    assert flat == sorted(lengths, reverse=True)
    assert batches[0] == [5]  # longer than the budget: alone
    for batch in batches:
        assert len(batch) == 1 or len(batch) * max(lengths[i] for i in batch) <= 800
    assert [len(b) for b in batches] == [1, 2, 3, 1]  # 2 x 400, 3 x 250, then 30 alone
    with pytest.raises(ValueError, match="batch_tokens"):
        length_batches(lengths, 0)


def test_document_kv_rejects_empty_sequences(compute_device: torch.device) -> None:
    engine = engine_for(tiny_model("llama").to(compute_device), "llama")
    with pytest.raises(ValueError, match="no empty one"):
        document_kv(engine.decoder, [[1, 2], []], [0, 0], torch.float32)
    with pytest.raises(ValueError, match="no empty one"):
        document_kv(engine.decoder, [], [], torch.float32)


def test_batched_kv_equals_one_by_one(family: str, compute_device: torch.device) -> None:
    model = tiny_model(family).to(compute_device)
    alone, batched = engine_for(model, family), engine_for(model, family)
    expected = one_by_one(alone, DOCS)
    # a budget of 2-3 documents a batch: several batches, each padded
    keys = batched.precompute(DOCS, batch_tokens=260, progress=False)
    assert keys == expected
    errors = relative_errors(alone, batched, keys)
    worst = max(errors, key=errors.__getitem__)
    assert errors[worst] <= 1e-5, f"{worst}: relative error {errors[worst]:.3g}"
    assert all(batched.is_known(text) for text in DOCS)


def test_every_strategy_reads_batched_kv_like_one_by_one(
    family: str, compute_device: torch.device
) -> None:
    model = tiny_model(family).to(compute_device)
    alone, batched = engine_for(model, family), engine_for(model, family)
    one_by_one(alone, DOCS)
    batched.precompute(DOCS, batch_tokens=10_000, progress=False)  # one batch
    prompt = [Segment(DOCS[i]) for i in (2, 0, 4, 1)] + [Segment(QUESTION, cache=False)]
    for config in STRATEGIES:
        got = batched.prefill(prompt, config)
        want = alone.prefill(prompt, config)
        assert got.stats.segments_precomputed == want.stats.segments_precomputed == 0
        error = float((got.logits - want.logits).abs().max() / want.logits.abs().max())
        assert error <= 1e-5, f"{config.strategy}: relative logit error {error:.3g}"


def test_bf16_batched_kv_is_as_close_to_fp32_as_one_by_one(compute_device: torch.device) -> None:
    reference = engine_for(tiny_model("qwen2").to(compute_device), "fp32")
    expected = one_by_one(reference, DOCS)
    half = tiny_model("qwen2").to(compute_device, torch.bfloat16)
    alone, batched = engine_for(half, "bf16"), engine_for(half, "bf16")
    one_by_one(alone, DOCS)
    batched.precompute(DOCS, batch_tokens=260, progress=False)
    # bf16 ids differ from fp32 ones (the KV dtype is in the fingerprint): compare by position
    alone_keys = [alone.segment_id(text) for text in DOCS]
    for text, key32, key16 in zip(DOCS, expected, alone_keys, strict=True):
        fp32, own = reference.store.get(key32), alone.store.get(key16)
        got = batched.store.get(key16)
        assert fp32 is not None and own is not None and got is not None
        for name in fp32:
            exact = fp32[name].float()
            scale = exact.abs().max()
            own_error = float((own[name].float() - exact).abs().max() / scale)
            batched_error = float((got[name].float() - exact).abs().max() / scale)
            assert batched_error <= 2 * own_error + 1e-3, (
                f"{text[:12]!r} {name}: batched bf16 error {batched_error:.3g}, "
                f"one-by-one bf16 error {own_error:.3g}"
            )


def test_a_document_too_long_fails_before_any_is_computed() -> None:
    engine = engine_for(tiny_model("llama"), "llama")  # a window of 1024 tokens
    with pytest.raises(ValueError, match="context window of 1024 tokens"):
        engine.precompute([DOCS[0], "y" * 2000], batch_tokens=100)
    assert not engine.store.contains(engine.segment_id(DOCS[0]))
    assert not engine.is_known(DOCS[0])
