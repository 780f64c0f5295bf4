"""Stored KV is read in place and never written: no defensive copies, no blend touches it.

A document's entry is one tensor (``kv``, ``[layers, 2, kv_heads, tokens, head_dim]``). The
memory tier hands out the tensor it holds, `StoredRows` hands out views into it, and the blend
loop copies out of those into its own prompt buffer. These tests prove the views are views (so
the bitwise check below is not vacuous) and that prefills of every strategy, the stale-KV
correction and a first pass's refinement included, leave every stored byte as it was.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import byte_tokenizer, tiny_model
from kvblend import BlendConfig, BlendEngine, Segment
from kvblend.blend.selectors import strategy_names
from kvblend.documents.blend_plan import open_spans
from kvblend.store import DiskKVStore, KVStore, MemoryKVStore, TieredKVStore

SYSTEM = "System: answer from the documents.\n"
DOCS = [
    "Doc one: Marta Quill lives in Lisbon and keeps bees.",
    "Doc two: the {orange} cat\nsleeps all day, very calm.",
    "Doc three: a meeting at 9:30 in room 12.",
]
QUESTION = "\nQuestion: where does Marta live?\nAnswer:"
CONFIGS = [
    *(BlendConfig(name) for name in strategy_names()),
    BlendConfig("cacheblend", recompute_ratio=0.3, correction=0.5),
    BlendConfig("cacheblend", recompute_ratio=0.3, deviation="key", check_layer=2),
    BlendConfig("epic", epic_tokens=4, correction=1.0),
    BlendConfig("attention", recompute_ratio=0.3, min_recompute=0, full_above=1.0),
]


def prompt(order: tuple[int, ...]) -> list[Segment]:
    return [
        Segment(SYSTEM, role="prefix"),
        *(Segment(DOCS[index]) for index in order),
        Segment(QUESTION, cache=False),
    ]


def stored_blobs(store: KVStore, keys: list[str]) -> dict[str, torch.Tensor]:
    """The tensor each key's entry holds, as the store hands it out."""
    blobs = {}
    for key in keys:
        entry = store.get(key)
        assert entry is not None and set(entry) == {"kv"}
        blobs[key] = entry["kv"]
    return blobs


def test_stored_rows_are_views_into_the_memory_tiers_tensor() -> None:
    store = MemoryKVStore()
    engine = BlendEngine(tiny_model("qwen2"), byte_tokenizer(), store=store)
    engine.prefill(prompt((2, 0, 1)))  # stores the prefix and every document
    blobs = stored_blobs(store, store.keys())
    spans, computed = open_spans(engine.library.segment_kv, engine.plan(prompt((2, 0, 1))))
    assert computed == 0 and len(spans) == 1 + len(DOCS)
    for span in spans:
        rows = span.source.layer(1)
        owners = [key for key, blob in blobs.items() if _inside(rows, blob)]
        assert len(owners) == 1, "a layer's rows must be a view of the stored tensor"
        assert rows.shape[0] == 2 and rows.shape[2] == span.end - span.start


@pytest.mark.parametrize("tier", ["memory", "memory-and-disk"])
def test_no_prefill_writes_into_the_store(tmp_path: Path, tier: str) -> None:
    if tier == "memory":
        store: KVStore = MemoryKVStore()
    else:
        store = TieredKVStore(MemoryKVStore(), DiskKVStore(tmp_path / "kv"))
    engine = BlendEngine(tiny_model("qwen2"), byte_tokenizer(), store=store)
    engine.prefill(prompt((0, 1, 2)))  # stores the prefix and every document
    keys = store.keys()
    assert len(keys) == 1 + len(DOCS)
    pristine = {key: blob.clone() for key, blob in stored_blobs(store, keys).items()}
    for config in CONFIGS:
        for order in ((0, 1, 2), (2, 0, 1)):  # documents at their own and at other positions
            got = engine.prefill(prompt(order), config)
            assert got.stats.documents_reused + got.stats.documents_found >= 1
    now = stored_blobs(store, keys)
    for key, blob in pristine.items():
        assert now[key].dtype == blob.dtype and now[key].shape == blob.shape
        assert torch.equal(now[key].view(torch.uint8), blob.view(torch.uint8)), key
    assert store.stats().corrupt_dropped == 0


def _inside(view: torch.Tensor, blob: torch.Tensor) -> bool:
    """Whether ``view`` shares ``blob``'s memory (a view of it, not a copy)."""
    start = blob.untyped_storage().data_ptr()
    return start <= view.data_ptr() < start + blob.untyped_storage().nbytes()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gpu_tier_is_read_in_place_and_a_host_tier_is_pinned_once() -> None:
    kv = torch.randn(3, 2, 2, 40, 16)
    gpu = MemoryKVStore(device="cuda")
    gpu.put("doc", {"kv": kv})
    first, second = gpu.get("doc", device="cuda"), gpu.get("doc", device="cuda")
    assert first is not None and second is not None
    assert first["kv"].device.type == "cuda"
    assert first["kv"].data_ptr() == second["kv"].data_ptr()  # no copy per read
    host = MemoryKVStore()
    host.put("doc", {"kv": kv})
    kept = host.get("doc")
    assert kept is not None and kept["kv"].is_pinned()
    moved = host.get("doc", device="cuda")
    assert moved is not None and torch.equal(moved["kv"].cpu(), kv)
    assert host.get("doc")["kv"].data_ptr() == kept["kv"].data_ptr()  # pinned once, kept


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_host_tier_entry_reaches_the_gpu_through_the_loops_group_copies() -> None:
    """A host-tier entry is opened in (pinned) host memory, not copied to the GPU whole: the
    blend loop's copies of each group of layers are the transfer, and the answer is the same
    as from a GPU tier."""
    model = tiny_model("qwen2").to("cuda")
    engines = {
        where: BlendEngine(model, byte_tokenizer(), store=MemoryKVStore(device=device))
        for where, device in (("host", None), ("gpu", "cuda"))
    }
    results = {}
    for where, engine in engines.items():
        engine.precompute(DOCS, progress=False)
        engine.prefill(prompt((2, 0, 1)))  # stores the prompt head too
        spans, computed = open_spans(engine.library.segment_kv, engine.plan(prompt((2, 0, 1))))
        assert computed == 0
        devices = {span.source.layers().device.type for span in spans}
        assert devices == ({"cpu"} if where == "host" else {"cuda"})
        if where == "host":
            assert all(span.source.layers().is_pinned() for span in spans)
        results[where] = engine.prefill(prompt((2, 0, 1)), BlendConfig())
    torch.testing.assert_close(results["host"].logits, results["gpu"].logits, atol=1e-5, rtol=0)
