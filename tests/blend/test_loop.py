"""The blend loop's full pass over a batch of sequences (`BlendInput.sequences`), directly.

Precompute runs documents through the loop this way: right-padded to the longest, laid one after
another, each at positions ``0..n-1`` and attending to its own rows only. The reference is
transformers' own forward of each sequence alone: its cache's keys un-rotated with transformers'
RoPE formula and the model's rotary embedding, and its values. In float32 the batched rows may
differ from it only by the rounding of differently shaped matrix products (measured below 1e-6
of a tensor's magnitude); a padding, position or mask error moves them by whole percents.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from conftest import tiny_model, transformers_rope
from kvblend import BlendConfig
from kvblend.blend.loop import prompt_tables, run_pass
from kvblend.blend.prefill import run_blend
from kvblend.blend.rope import rope_table
from kvblend.blend.selectors import Selection
from kvblend.blend.types import COMPUTE, BlendInput, CachedSpan
from kvblend.models.decoder import Decoder

# Longer and shorter than the tiny Mistral's sliding window (48), and a one-token sequence.
LENGTHS = [70, 23, 1, 52]


def sequences(lengths: list[int], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [[2, *torch.randint(3, 259, (n - 1,), generator=generator).tolist()] for n in lengths]


def batch_input(batch: list[list[int]], pad_id: int = 0) -> BlendInput:
    """``batch`` right-padded with ``pad_id`` and laid one after another."""
    longest = max(len(ids) for ids in batch)
    ids = torch.tensor([[*ids, *[pad_id] * (longest - len(ids))] for ids in batch]).flatten()
    kinds = torch.full((ids.numel(),), COMPUTE, dtype=torch.int8)
    return BlendInput(ids, kinds, [], sequences=len(batch))


def transformers_kv(model: torch.nn.Module, ids: list[int]) -> list[tuple[torch.Tensor, ...]]:
    """Per layer, keys before RoPE and values of ``ids`` from transformers' forward alone.

    A `DynamicCache` keeps every row (a sliding-window model's own cache keeps its window's).
    """
    cache = DynamicCache()
    with torch.inference_mode():
        model(torch.tensor([ids]), cache=cache, use_cache=True)
        positions = torch.arange(len(ids))[None]
        cos, sin = model.model.rotary_emb(model.model.embed_tokens.weight[:0], positions)
    return [
        (transformers_rope(layer.keys[0], cos[0], -sin[0]), layer.values[0])
        for layer in cache.layers
    ]


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def test_a_batch_of_sequences_is_each_sequence_alone(family: str) -> None:
    model = tiny_model(family)
    decoder = Decoder(model)
    batch = sequences(LENGTHS)
    out = run_blend(decoder, batch_input(batch), BlendConfig("full").selector(), need_logits=False)
    longest = max(LENGTHS)
    assert out.logits is None and out.keys[0].shape[1] == len(batch) * longest
    worst = 0.0
    for row, ids in enumerate(batch):
        got = out.raw_rows(row * longest, row * longest + len(ids))
        for layer, (keys, values) in enumerate(transformers_kv(model, ids)):
            worst = max(worst, relative(got[layer, 0], keys), relative(got[layer, 1], values))
    assert worst <= 1e-5, f"relative error {worst:.3g}"


def test_padding_never_reaches_a_sequence() -> None:
    decoder = Decoder(tiny_model("mistral"))
    batch = sequences(LENGTHS)
    outs = [
        run_blend(
            decoder, batch_input(batch, pad), BlendConfig("full").selector(), need_logits=False
        )
        for pad in (0, 7)
    ]
    longest = max(LENGTHS)
    for row, ids in enumerate(batch):
        rows = slice(row * longest, row * longest + len(ids))
        a, b = (out.raw_rows(rows.start, rows.stop) for out in outs)
        assert torch.equal(a, b)
        if len(ids) < longest:  # the padding rows themselves do differ
            pad_a, pad_b = (out.raw_rows(rows.stop, (row + 1) * longest) for out in outs)
            assert not torch.equal(pad_a, pad_b)


def test_every_sequence_of_a_batch_restarts_at_position_zero() -> None:
    decoder = Decoder(tiny_model("llama3-scaled"))
    blend_input = batch_input(sequences([5, 3, 4]))
    table = prompt_tables(decoder, blend_input).table
    alone = rope_table(*decoder.rotary(torch.arange(5)))
    assert table.shape[0] == 15
    for row in range(3):
        assert torch.equal(table[row * 5 : (row + 1) * 5], alone)


def test_a_batch_is_computed_whole_without_logits() -> None:
    decoder = Decoder(tiny_model("qwen2"))
    blend_input = batch_input(sequences([6, 4]))
    every = Selection(torch.arange(12))
    with pytest.raises(ValueError, match="computed whole"):
        run_pass(decoder, blend_input, every)  # logits
    with pytest.raises(ValueError, match="computed whole"):
        run_pass(decoder, blend_input, Selection(torch.arange(6, 12)), need_logits=False)
    source = run_blend(decoder, blend_input, BlendConfig("full").selector(), need_logits=False)
    spans = [CachedSpan(0, 2, source)]  # a cached span
    with pytest.raises(ValueError, match="computed whole"):
        run_pass(decoder, BlendInput(blend_input.token_ids, blend_input.kinds, spans,
                                     sequences=2), every, need_logits=False)  # fmt: skip
    uneven = BlendInput(torch.arange(3, 14), torch.full((11,), COMPUTE, dtype=torch.int8), [],
                        sequences=2)  # fmt: skip
    with pytest.raises(ValueError, match="computed whole"):
        run_pass(decoder, uneven, Selection(torch.arange(11)), need_logits=False)
