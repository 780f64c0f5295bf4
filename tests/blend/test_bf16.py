"""bf16 exactness: a blend whose cached KV is the in-context KV equals bf16 full prefill.

In bf16 no two computation orders agree exactly, so the tolerance is derived, not picked: the
gap between the engine's bf16 full prefill and transformers' own bf16 forward pass over the same
ids (two exact computations of one thing, differing only by rounding) sets the noise floor, and
every strategy must stay within a small multiple of it. On a GPU: ``pytest --device cuda``.
"""

from __future__ import annotations

import pytest
import torch

from conftest import FAMILIES, byte_tokenizer, tiny_model
from kvblend import BlendConfig, BlendEngine, Segment
from kvblend.blend.prefill import run_blend
from kvblend.blend.types import COMPUTE, BlendInput
from kvblend.store import MemoryKVStore

SYSTEM = "System: answer from the documents.\n"
DOCS = [
    "Doc one: Marta Quill lives in Lisbon and keeps bees. " * 2,
    "Doc two: a meeting at 9:30. " * 3,
]
QUESTION = "\nQuestion: where does Marta live?\nAnswer:"
CONFIGS = [
    BlendConfig(min_recompute=0, full_above=1.0),  # the default, blending these short documents
    BlendConfig("attention", recompute_ratio=0.3, lead_tokens=4, min_recompute=0),
    BlendConfig("cacheblend", recompute_ratio=0.15),
    BlendConfig("epic", epic_tokens=4),
    BlendConfig("reuse"),
]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bf16_blend_of_in_context_kv_is_within_bf16_noise(
    family: str, compute_device: torch.device
) -> None:
    device = compute_device
    model = tiny_model(family).to(device=device, dtype=torch.bfloat16)
    engine = BlendEngine(model, byte_tokenizer(), store=MemoryKVStore(), name=family)
    prompt = [Segment(SYSTEM, role="prefix"), *map(Segment, reversed(DOCS)),
              Segment(QUESTION, cache=False)]  # fmt: skip
    full = engine.prefill(prompt, BlendConfig("full"))
    with torch.inference_mode():
        reference = model(torch.tensor([full.token_ids], device=device)).logits[0, -1].float()
    noise = float((full.logits - reference).abs().max())
    scale = float(reference.abs().max())
    tolerance = max(4 * noise, 1e-2 * scale)
    # Each document's cache is its KV in this very prompt: blending must change nothing.
    ids = torch.tensor(full.token_ids, device=device)
    kinds = torch.full((len(ids),), COMPUTE, dtype=torch.int8, device=device)
    exact = run_blend(engine.decoder, BlendInput(ids, kinds, []), BlendConfig("full").selector())
    assert exact.raw_kv is not None
    cursor = len(engine.tokenize(SYSTEM)) + 1
    for text in reversed(DOCS):
        length = len(engine.tokenize(text))
        tensors = {"kv": exact.raw_kv[:, :, :, cursor : cursor + length].contiguous()}
        engine.store.put(engine.segment_id(text), tensors)
        cursor += length
    for config in CONFIGS:
        blended = engine.prefill(prompt, config)
        assert blended.stats.documents_reused == 2
        error = float((blended.logits - full.logits).abs().max())
        assert error <= tolerance, (
            f"{config}: {error:.3g} > {tolerance:.3g} (bf16 noise {noise:.3g})"
        )
