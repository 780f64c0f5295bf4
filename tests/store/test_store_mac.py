"""Fault injection, forged entries: with a store key, only entries written with it are used.

Checksums find damage, not forgery: anyone who can write the folder or the server can plant an
entry with valid checksums and finite, wrong values (zeros, another document's KV), and a store
without a key uses it. With ``KVBLEND_STORE_KEY`` set, entries carry HMAC-SHA256 tags over their
bytes and metadata (`kvblend.store.entry_mac`); an entry without a valid one (written without
the key, with another key, or with tampered bytes) is a miss and a counted drop, on disk and on
Redis, and the engine computes the document instead: the answer of a clean run.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from conftest import byte_tokenizer, tiny_model
from kvblend import BlendConfig, BlendEngine
from kvblend.store import CorruptEntryError, DiskKVStore, KVStore, RedisKVStore, default_store
from kvblend.store.entry_mac import MAC_ITEM, STORE_KEY_ENV, StoreKey, load_store_key

KEY = "0f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c4b5a69788796a5b4c3d2e1f0"
OTHER_KEY = "ffeeddccbbaa99887766554433221100ffeeddccbbaa99887766554433221100"
DOC = "Hugo Brandt bakes rye bread at four every morning in the mill by the river. " * 2
PROMPT = f"Context: {DOC}\nQuestion: when does Hugo bake?"


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _opener(kind: str, tmp_path: Path, url: str | None) -> Callable[..., KVStore]:
    """Store objects over one place, each with the given store key (None: no key)."""
    if kind == "disk":
        return lambda key: DiskKVStore(tmp_path / "kv", store_key=key or "")
    return lambda key: RedisKVStore(url, store_key=key or "")


def _header(store: KVStore, kind: str, tmp_path: Path, url: str | None, key: str) -> dict:
    """The safetensors metadata of the stored entry `key`, read from its raw bytes."""
    if kind == "disk":
        (path,) = (tmp_path / "kv").glob("*/*/*.val")
        data = path.read_bytes()
    else:
        import redis

        data = redis.Redis.from_url(url).get(f"kvblend:kv:v1:{key}")
    return json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])["__metadata__"]


def _kv(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"kv": torch.randn(3, 2, 2, 256, 16, generator=generator)}  # 96 KiB: a file on disk


@pytest.mark.parametrize("kind", ["disk", "redis"])
def test_entries_written_with_the_key_carry_macs_and_read_back(
    request: pytest.FixtureRequest, tmp_path: Path, kind: str
) -> None:
    url = request.getfixturevalue("redis_server").url if kind == "redis" else None
    store = _opener(kind, tmp_path, url)(KEY)
    store.put("doc", _kv(), {"tokens": "256"})
    metadata = _header(store, kind, tmp_path, url, "doc")
    assert len(metadata[MAC_ITEM]) == 64 and len(json.loads(metadata["kvblend.macs"])) == 1
    entry = store.get("doc")
    assert entry is not None and torch.equal(entry["kv"], _kv()["kv"])
    assert store.metadata("doc") == {"tokens": "256"}
    keyless = _opener(kind, tmp_path, url)(None)  # a store without the key still reads it
    assert torch.equal(keyless.get("doc")["kv"], _kv()["kv"])
    assert (store.stats().hits, store.stats().corrupt_dropped) == (1, 0)


@pytest.mark.parametrize("forgery", ["no-mac", "other-key", "another-keys-entry"])
@pytest.mark.parametrize("kind", ["disk", "redis"])
def test_an_entry_without_a_valid_mac_is_a_miss_and_a_drop(
    request: pytest.FixtureRequest, tmp_path: Path, kind: str, forgery: str
) -> None:
    url = request.getfixturevalue("redis_server").url if kind == "redis" else None
    open_store = _opener(kind, tmp_path, url)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "notes.txt").write_text("not the store's")
    before = _tree(outside)
    forged = torch.zeros(3, 2, 2, 256, 16)  # finite, valid checksums, wrong
    if forgery == "another-keys-entry":  # a valid keyed entry, copied under this key
        writer = open_store(KEY)
        writer.put("other", {"kv": forged})
        if kind == "disk":
            raw = next((tmp_path / "kv").glob("*/*/*.val")).read_bytes()
            writer.close()
            import diskcache

            with diskcache.Cache(str(tmp_path / "kv")) as cache:
                cache.set("doc", raw)
        else:
            import redis

            client = redis.Redis.from_url(url)
            client.set("kvblend:kv:v1:doc", client.get("kvblend:kv:v1:other"))
    else:
        writer = open_store(None if forgery == "no-mac" else OTHER_KEY)
        writer.put("doc", {"kv": forged}, {"tokens": "256"})
    reader = open_store(KEY)
    assert reader.get("doc") is None and reader.metadata("doc") is None
    stats = reader.stats()
    assert (stats.hits, stats.misses) == (0, 1) and stats.corrupt_dropped >= 1
    assert not reader.contains("doc")  # dropped
    reader.put("doc", _kv(), {"tokens": "256"})  # the reader's own, computed entry
    assert torch.equal(reader.get("doc")["kv"], _kv()["kv"])
    assert _tree(outside) == before


@pytest.mark.parametrize("kind", ["disk", "redis"])
def test_tampered_tensor_bytes_fail_their_mac(
    request: pytest.FixtureRequest, tmp_path: Path, kind: str
) -> None:
    url = request.getfixturevalue("redis_server").url if kind == "redis" else None
    store = _opener(kind, tmp_path, url)(KEY)
    store.put("doc", _kv())
    if kind == "disk":
        (path,) = (tmp_path / "kv").glob("*/*/*.val")
        data = bytearray(path.read_bytes())
        data[-100] ^= 0x01
        path.write_bytes(bytes(data))
    else:
        import redis

        client = redis.Redis.from_url(url)
        size = client.strlen("kvblend:kv:v1:doc")
        client.setrange("kvblend:kv:v1:doc", size - 100, b"\x7f")
    entry = store.get("doc")  # the header is intact and signed
    assert entry is not None
    with pytest.raises(CorruptEntryError, match="MAC mismatch"):
        entry["kv"]
    assert store.stats().corrupt_dropped == 1 and not store.contains("doc")


@pytest.mark.parametrize("kind", ["disk", "redis"])
def test_a_forged_entry_changes_the_answer_only_without_the_key(
    request: pytest.FixtureRequest, tmp_path: Path, kind: str, monkeypatch
) -> None:
    url = request.getfixturevalue("redis_server").url if kind == "redis" else None

    def engine(folder: str) -> BlendEngine:
        store = default_store(tmp_path / folder, redis_url=url)
        return BlendEngine(tiny_model("qwen2"), byte_tokenizer(), store=store)

    monkeypatch.setenv(STORE_KEY_ENV, KEY)
    clean = engine("a")
    clean.precompute([DOC])
    expected = clean.prefill(PROMPT, BlendConfig("reuse")).logits
    key = clean.segment_id(DOC)
    entry = clean.store.get(key)
    forged = {"kv": torch.zeros_like(entry["kv"])}
    metadata = clean.store.metadata(key)
    clean.store.close()

    monkeypatch.delenv(STORE_KEY_ENV)  # someone who can write the store, without the key
    forger = engine("a" if kind == "disk" else "forger")
    (forger.store.remote if kind == "redis" else forger.store).put(key, forged, metadata)
    forger.store.close()
    fooled = engine("a" if kind == "disk" else "b")  # a reader without the key uses it
    wrong = fooled.prefill(PROMPT, BlendConfig("reuse"))
    assert wrong.stats.segments_precomputed == 0
    assert not torch.allclose(wrong.logits, expected, atol=1e-3, rtol=0)
    fooled.store.close()
    if kind == "disk":
        forger = engine("a")
        forger.store.put(key, forged, metadata)  # the fooled reader's memory tier is gone
        forger.store.close()

    monkeypatch.setenv(STORE_KEY_ENV, KEY)
    reader = engine("a" if kind == "disk" else "c")
    reader.register([DOC])
    got = reader.prefill(PROMPT, BlendConfig("reuse"))  # refused, computed, stored signed
    assert got.stats.segments_precomputed == 1
    assert torch.allclose(got.logits, expected, atol=1e-4, rtol=0)
    tier = reader.store.stats().tiers["redis" if kind == "redis" else "disk"]
    assert tier.corrupt_dropped == 1 and tier.hits == 0
    again = reader.prefill(PROMPT, BlendConfig("reuse"))
    assert again.stats.segments_precomputed == 0  # the recomputed entry is signed
    reader.store.close()


def test_the_key_is_checked_and_never_shown(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv(STORE_KEY_ENV, "too-short-a-secret")
    with pytest.raises(ValueError, match="at least 32") as short:
        DiskKVStore(tmp_path / "kv")
    assert "too-short-a-secret" not in str(short.value) and not (tmp_path / "kv").exists()
    monkeypatch.setenv(STORE_KEY_ENV, f"  {KEY}\n")  # as `$(cat keyfile)` or a file leaves it
    key = load_store_key()
    assert isinstance(key, StoreKey) and KEY not in repr(key) and repr(key) == "StoreKey(***)"
    assert key.tensor_tag("kv", b"x") == StoreKey(KEY.encode()).tensor_tag("kv", b"x")
    monkeypatch.setenv(STORE_KEY_ENV, "")
    assert load_store_key() is None
