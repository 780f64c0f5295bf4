"""One layer of the blend loop (`layer_step`) against the model's own decoder layer.

Every row computed, the step must give transformers' hidden states after that layer and write
the keys (rotated) and values transformers caches; with the last row alone (``LAST``) it must
give that row's hidden state, and with ``WRITE`` only the K/V.
"""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from kvblend.blend.attention.rows import RowAttention
from kvblend.blend.layer_step import FULL, LAST, WRITE, layer_step
from kvblend.blend.rope import rope_table
from kvblend.blend.types import RowSet
from kvblend.models.decoder import Decoder

TOKENS = 19


def _reference(model: torch.nn.Module, ids: torch.Tensor) -> tuple[list[torch.Tensor], object]:
    out = model(ids[None], output_hidden_states=True, use_cache=True)
    return [h[0] for h in out.hidden_states], out.past_key_values


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_a_full_step_is_the_models_decoder_layer(family: str) -> None:
    model = tiny_model(family)
    decoder = Decoder(model)
    ids = torch.randint(3, 200, (TOKENS,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        hidden_states, cache = _reference(model, ids)
        rows = torch.arange(TOKENS)
        table = rope_table(*decoder.rotary(rows))
        attention = RowAttention(
            RowSet.from_host(rows.numpy(), decoder.device), TOKENS, decoder.windows,
            decoder.scaling, decoder.dtype,
        )  # fmt: skip
        hidden = hidden_states[0]
        for layer in range(decoder.shape.num_layers):
            layer_kv = torch.zeros(2, decoder.shape.num_kv_heads, TOKENS, decoder.shape.head_dim)
            hidden, _ = layer_step(
                decoder, layer, FULL, hidden, layer_kv, rows, table, None, attention
            )
            keys, values = cache.layers[layer].keys[0], cache.layers[layer].values[0]
            assert torch.allclose(layer_kv[0], keys, atol=1e-5, rtol=1e-5), layer
            assert torch.allclose(layer_kv[1], values, atol=1e-5, rtol=1e-5), layer
            if layer < decoder.shape.num_layers - 1:  # the last hidden state is after the norm
                error = (hidden - hidden_states[layer + 1]).abs().max().item()
                assert error < 1e-4, (layer, error)


def test_last_and_write_modes_do_only_their_part() -> None:
    model = tiny_model("llama")
    decoder = Decoder(model)
    ids = torch.randint(3, 200, (TOKENS,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        hidden_states, _ = _reference(model, ids)
        rows = torch.arange(TOKENS)
        table = rope_table(*decoder.rotary(rows))
        attention = RowAttention(
            RowSet.from_host(rows.numpy(), decoder.device), TOKENS, decoder.windows,
            decoder.scaling, decoder.dtype,
        )  # fmt: skip
        shape = (2, decoder.shape.num_kv_heads, TOKENS, decoder.shape.head_dim)
        full_kv, last_kv, write_kv = (torch.zeros(shape) for _ in range(3))
        full, _ = layer_step(decoder, 0, FULL, hidden_states[0], full_kv, rows, table, None,
                             attention)  # fmt: skip
        last, _ = layer_step(decoder, 0, LAST, hidden_states[0], last_kv, rows, table, None,
                             attention)  # fmt: skip
        same, queries = layer_step(decoder, 0, WRITE, hidden_states[0], write_kv, rows, table,
                                   None, attention)  # fmt: skip
    assert last.shape[0] == 1 and torch.allclose(last[0], full[-1], atol=1e-6, rtol=0)
    assert same is hidden_states[0]  # WRITE leaves the hidden states as they were
    assert queries.shape == (decoder.shape.num_heads, TOKENS, decoder.shape.head_dim)
    assert torch.equal(full_kv, last_kv) and torch.equal(full_kv, write_kv)
