"""RoPE as the blend loop applies it, against transformers' own formula (`apply_rotary_pos_emb`)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from conftest import tiny_model
from kvblend.blend import rope
from kvblend.blend.rope import inverse_table, rope_table, rope_tables, rotate, rotate_
from kvblend.models.decoder import Decoder


def _tables(tokens: int, head_dim: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of a real model's rotary embedding at positions 0..tokens-1."""
    decoder = Decoder(tiny_model("llama", seed))
    cos, sin = decoder.rotary(torch.arange(tokens))
    assert cos.shape[-1] == head_dim
    return cos, sin


def test_rotate_is_transformers_formula_bit_for_bit() -> None:
    cos, sin = _tables(37)
    generator = torch.Generator().manual_seed(1)
    queries = torch.randn(4, 37, 16, generator=generator)
    keys = torch.randn(2, 37, 16, generator=generator)
    expected_q, expected_k = apply_rotary_pos_emb(queries[None], keys[None], cos[None], sin[None])
    table = rope_table(cos, sin)
    assert torch.equal(rotate(queries, table), expected_q[0])
    assert torch.equal(rotate(keys, table), expected_k[0])


def test_rotate_in_place_equals_rotate_across_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    cos, sin = _tables(11)
    table = rope_table(cos, sin)
    # a K/V buffer's keys: [layers, kv_heads, tokens, head_dim], rotated as a view in place
    buffer = torch.randn(5, 2, 2, 11, 16, generator=torch.Generator().manual_seed(2))
    expected = rotate(buffer[:, 0].clone(), table)
    monkeypatch.setattr(rope, "ROTATE_SLICE", 2 * 11 * 16)  # two layers a slice: three slices
    keys = buffer[:, 0]
    assert rotate_(keys, table) is keys
    assert torch.equal(buffer[:, 0], expected)


def test_the_inverse_table_undoes_the_rotation() -> None:
    cos, sin = _tables(23)
    table = rope_table(cos, sin)
    keys = torch.randn(3, 23, 16, generator=torch.Generator().manual_seed(3))
    back = rotate(rotate(keys, table), inverse_table(table))
    assert torch.allclose(back, keys, atol=1e-5, rtol=0)
    assert not torch.allclose(rotate(keys, table), keys, atol=1e-3)  # the rotation did something


def test_a_buckets_rows_past_the_prompt_get_zeros_and_no_position_is_asked_for_them() -> None:
    asked: list[int] = []
    decoder = Decoder(tiny_model("llama"))

    def rotary(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        asked.append(int(positions.max()) + 1)
        return decoder.rotary(positions)

    tables = rope_tables(rotary, total=9, length=16, device=torch.device("cpu"))
    assert asked == [9]
    assert tables.table.shape[0] == 16
    assert torch.equal(tables.table[9:], torch.zeros_like(tables.table[9:]))
    assert torch.equal(tables.table[:9], rope_table(*decoder.rotary(torch.arange(9))))
