"""Fault injection, the store's own API: an entry that does not fit the reader is a miss.

`get(key, expect=spec)` over an entry whose tensors are not those `spec` names (here: the same
document's KV cut to fewer tokens, written through `put()`, so every checksum is right) must
return None, count a miss and a dropped entry (never a hit), delete the entry, and raise
nothing, on every tier: memory, disk, Redis, memory -> disk, memory -> disk -> Redis. An engine
over such a store then reports 7 hits for 8 documents of which one does not fit, and answers
as a clean run does. Nothing outside the store folder is touched.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from conftest import byte_tokenizer, tiny_model
from kvblend import BlendConfig, BlendEngine
from kvblend.store import DiskKVStore, KVStore, MemoryKVStore, RedisKVStore, default_store
from kvblend.store.base import EntrySpec

DOCS = [
    f"Document {index}: the lighthouse keeper of island {index} logs {index * 7} ships a week. "
    for index in range(8)
]
MISFIT = 3  # the document whose entry is cut short


def _tree(folder: Path) -> dict[str, tuple[int, bytes]]:
    """Every path under `folder` with its mode and (for files) its bytes."""
    return {
        str(path.relative_to(folder)): (
            path.lstat().st_mode,
            path.read_bytes() if path.is_file() else b"",
        )
        for path in [folder, *folder.rglob("*")]
    }


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A folder next to the store's, which no store operation may change."""
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / "notes.txt").write_text("not the store's")
    return folder


def _stores(kind: str, tmp_path: Path, url: str | None) -> Callable[[], KVStore]:
    """A factory of store objects over one place (each call: as a new process opens it)."""
    memory = MemoryKVStore()
    return {
        "memory": lambda: memory,
        "disk": lambda: DiskKVStore(tmp_path / "kv"),
        "redis": lambda: RedisKVStore(url),
        "tiered": lambda: default_store(tmp_path / "kv"),
        "redis-tiered": lambda: default_store(tmp_path / f"kv{id(object())}", redis_url=url),
    }[kind]


def _tier(store: KVStore, kind: str):
    """The stats of the tier that held the entry (the store itself for a single tier)."""
    stats = store.stats()
    return {"tiered": stats.tiers.get("disk"), "redis-tiered": stats.tiers.get("redis")}.get(
        kind, stats
    )


KINDS = ["memory", "disk", "redis", "tiered", "redis-tiered"]


@pytest.mark.parametrize("kind", KINDS)
def test_an_entry_that_does_not_fit_is_a_miss_and_a_drop_on_every_tier(
    request: pytest.FixtureRequest, tmp_path: Path, outside: Path, kind: str
) -> None:
    url = request.getfixturevalue("redis_server").url if "redis" in kind else None
    open_store = _stores(kind, tmp_path, url)
    before = _tree(outside)
    kv = torch.randn(3, 2, 2, 40, 8)
    writer = open_store()
    writer.put("doc", {"kv": kv[:, :, :, :30].contiguous()}, {"tokens": "40"})  # 30 of 40
    writer.close()

    reader = open_store()
    spec = EntrySpec({"kv": (kv.dtype, tuple(kv.shape))})
    assert reader.get("doc", expect=spec) is None  # a miss, not a mapping over a closed file
    stats, tier = reader.stats(), _tier(reader, kind)
    assert (stats.hits, stats.misses) == (0, 1)
    assert tier is not None and (tier.hits, tier.corrupt_dropped) == (0, 1)
    assert not reader.contains("doc") and reader.get("doc") is None  # dropped
    reader.put("doc", {"kv": kv}, {"tokens": "40"})  # the caller's recomputed entry
    entry = reader.get("doc", expect=spec)
    assert entry is not None and torch.equal(entry["kv"], kv)
    assert reader.stats().hits == 1 and _tier(reader, kind).corrupt_dropped == 1
    reader.close()
    assert _tree(outside) == before


@pytest.mark.parametrize("kind", ["disk", "tiered", "redis-tiered"])
def test_precompute_counts_seven_hits_of_eight_when_one_entry_does_not_fit(
    request: pytest.FixtureRequest, tmp_path: Path, outside: Path, kind: str
) -> None:
    url = request.getfixturevalue("redis_server").url if "redis" in kind else None
    open_store = _stores(kind, tmp_path, url)
    before = _tree(outside)
    writer = BlendEngine(tiny_model("qwen2"), byte_tokenizer(), store=open_store())
    writer.precompute(DOCS)
    getattr(writer.store, "wait_for_promotions", lambda: None)()
    prompt = f"Context: {DOCS[MISFIT]}\nQuestion: how many ships?"
    expected = writer.prefill(prompt, BlendConfig("reuse")).logits
    key = writer.segment_id(DOCS[MISFIT])
    entry = writer.store.get(key)
    assert entry is not None
    short = {"kv": entry["kv"][:, :, :, :-4].clone()}
    target = writer.store.remote if kind == "redis-tiered" else writer.store
    target.put(key, short, writer.store.metadata(key))  # valid checksums, 4 tokens short
    writer.store.close()

    engine = BlendEngine(tiny_model("qwen2"), byte_tokenizer(), store=open_store())
    engine.precompute(DOCS)
    stats, tier = engine.store.stats(), _tier(engine.store, kind)
    assert (stats.hits, stats.misses) == (7, 1)  # 8 found, 7 real
    assert tier is not None and (tier.hits, tier.misses, tier.corrupt_dropped) == (7, 1, 1)
    assert engine.library.segment_kv.intact(key)  # the precompute stored a whole entry again
    got = engine.prefill(prompt, BlendConfig("reuse"))
    assert got.stats.segments_precomputed == 0 and got.stats.documents_reused == 1
    assert torch.allclose(got.logits, expected, atol=1e-5, rtol=0)
    engine.store.close()
    assert _tree(outside) == before
