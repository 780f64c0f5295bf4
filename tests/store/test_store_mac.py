"""Fault injection, forged entries: with a store key, only entries written with it are used.

Checksums find damage, not forgery: anyone who can write the folder or the server can plant an
entry with valid checksums and finite, wrong values (zeros, another document's KV), and a store
without a key uses it. With ``KVBLEND_STORE_KEY`` set, entries carry HMAC-SHA256 tags over their
bytes and metadata (`kvblend.store.entry_mac`); an entry without a valid one (written without
the key, with another key, or with tampered bytes) is a miss, on disk and on
Redis, and the engine computes the document instead: the answer of a clean run. An entry of
another store key is no forgery: a miss, left in place however often it is read (not "corrupt"),
said once in one line; a forged one under the reader's own key (its key id, a MAC that does not
verify) is dropped.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from conftest import byte_tokenizer, tiny_model
from kvblend import BlendConfig, BlendEngine
from kvblend.store import (
    CorruptEntryError,
    DiskKVStore,
    KVStore,
    MemoryKVStore,
    OtherStoreKeyError,
    RedisKVStore,
    TieredKVStore,
    default_store,
)
from kvblend.store.entry_mac import (
    KEY_ID_ITEM,
    MAC_ITEM,
    STORE_KEY_ENV,
    StoreKey,
    load_store_key,
)

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
    data = _raw(kind, tmp_path, url, key)
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


def _raw(kind: str, tmp_path: Path, url: str | None, key: str = "doc", folder: str = "kv") -> bytes:
    """The stored bytes of entry `key`, as they are on disk (in `folder`) or on the server."""
    if kind == "disk":
        import diskcache

        with diskcache.Cache(str(tmp_path / folder)) as cache:
            (mode, filename, value), *_ = cache._sql(
                "SELECT mode, filename, value FROM Cache WHERE key = ?", (key,)
            ).fetchall()
        return (tmp_path / folder / filename).read_bytes() if filename else bytes(value)
    import redis

    return redis.Redis.from_url(url).get(f"kvblend:kv:v1:{key}") or b""


def _store_raw(kind: str, tmp_path: Path, url: str | None, data: bytes, key: str = "doc") -> None:
    """Put `data` under entry `key`, as someone who can write the folder or the server."""
    if kind == "disk":
        import diskcache

        with diskcache.Cache(str(tmp_path / "kv")) as cache:
            cache.set(key, data)
    else:
        import redis

        redis.Redis.from_url(url).set(f"kvblend:kv:v1:{key}", data)


def _resigned(data: bytes, change: Callable[[dict], None]) -> bytes:
    """`data` with its metadata changed by `change` and the header checksum made valid again."""
    from kvblend.store.entry_format import _header_checksum

    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    change(header["__metadata__"])
    header["__metadata__"]["kvblend.header_checksum"] = _header_checksum(header["__metadata__"])
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw + data[8 + size :]


@pytest.mark.parametrize("kind", ["disk", "redis"])
def test_another_keys_entries_are_misses_left_in_place_however_often_read(
    request: pytest.FixtureRequest, tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    url = request.getfixturevalue("redis_server").url if kind == "redis" else None
    open_store = _opener(kind, tmp_path, url)
    owner = open_store(OTHER_KEY)
    owner.put("doc", _kv(), {"tokens": "256"})
    written = _raw(kind, tmp_path, url)
    reader = open_store(KEY)
    with caplog.at_level("DEBUG", logger="kvblend.store"):
        for _ in range(5):  # any number of reads, and the writes that follow a miss
            assert reader.get("doc") is None and reader.metadata("doc") is None
            with pytest.raises(OtherStoreKeyError, match="another store key"):
                reader.put("doc", _kv(1), {"tokens": "256"})
    assert _raw(kind, tmp_path, url) == written  # never dropped, never written over
    stats = reader.stats()
    assert (stats.hits, stats.misses, stats.corrupt_dropped) == (0, 5, 0)
    assert stats.other_key == 15
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "the store holds entries of another key" in warnings[0]
    assert STORE_KEY_ENV in warnings[0] and "corrupt" not in warnings[0].lower()
    assert "forged" not in warnings[0]
    assert torch.equal(owner.get("doc")["kv"], _kv()["kv"])  # the owner still reads it
    # a tiered store keeps its own copy in memory and says nothing more
    if kind == "disk":
        tiered = TieredKVStore(MemoryKVStore(), DiskKVStore(tmp_path / "kv", store_key=KEY))
        assert tiered.get("doc") is None
        tiered.put("doc", _kv(1))
        assert torch.equal(tiered.get("doc")["kv"], _kv(1)["kv"])
        assert tiered.stats().put_errors == 0 and tiered.stats().other_key == 2
        assert _raw(kind, tmp_path, url) == written


@pytest.mark.parametrize("kind", ["disk", "redis"])
def test_a_forged_entry_under_the_readers_key_is_dropped(
    request: pytest.FixtureRequest, tmp_path: Path, kind: str
) -> None:
    url = request.getfixturevalue("redis_server").url if kind == "redis" else None
    open_store = _opener(kind, tmp_path, url)
    reader = open_store(KEY)
    reader.put("doc", _kv(), {"tokens": "256"})
    # someone who can write the store edits the signed header and fixes its checksum: the key
    # id still says this key, the MAC no longer verifies
    forged = _resigned(_raw(kind, tmp_path, url), lambda meta: meta.update(tokens="999"))
    _store_raw(kind, tmp_path, url, forged)
    assert reader.get("doc") is None and reader.metadata("doc") is None
    stats = reader.stats()
    assert stats.corrupt_dropped >= 1 and stats.other_key == 0
    assert not reader.contains("doc")  # dropped
    reader.put("doc", _kv(), {"tokens": "256"})  # the reader's own, computed entry
    assert torch.equal(reader.get("doc")["kv"], _kv()["kv"])


@pytest.mark.parametrize("kind", ["disk", "redis"])
def test_another_keys_signed_entry_copied_under_this_key_is_dropped(
    request: pytest.FixtureRequest, tmp_path: Path, kind: str
) -> None:
    url = request.getfixturevalue("redis_server").url if kind == "redis" else None
    open_store = _opener(kind, tmp_path, url)
    open_store(KEY).put("other", {"kv": torch.zeros(3, 2, 2, 256, 16)})
    _store_raw(kind, tmp_path, url, _raw(kind, tmp_path, url, "other"))  # misfiled as "doc"
    reader = open_store(KEY)
    assert reader.get("doc") is None and not reader.contains("doc")
    assert reader.stats().corrupt_dropped >= 1


@pytest.mark.parametrize("kind", ["disk", "redis"])
def test_unsigned_and_older_entries_are_misses_written_over_by_the_readers_own(
    request: pytest.FixtureRequest, tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = request.getfixturevalue("redis_server").url if kind == "redis" else None
    open_store = _opener(kind, tmp_path, url)
    forged = torch.zeros(3, 2, 2, 256, 16)
    open_store(None).put("doc", {"kv": forged})  # written without a key
    reader = open_store(KEY)
    assert reader.get("doc") is None and reader.contains("doc")  # left until written over
    assert reader.stats().corrupt_dropped == 0 and reader.stats().other_key == 1
    reader.put("doc", _kv())
    assert torch.equal(reader.get("doc")["kv"], _kv()["kv"])
    # entries signed before entries named their key (no key id): this key's read correctly,
    # another key's (or a forgery: nothing tells them apart) are misses written over
    sign = StoreKey.sign

    def sign_without_key_id(self: StoreKey, metadata: dict, tags: list) -> None:
        sign(self, metadata, tags)
        del metadata[KEY_ID_ITEM]
        metadata[MAC_ITEM] = self.header_tag(metadata)

    monkeypatch.setattr(StoreKey, "sign", sign_without_key_id)
    open_store(KEY).put("old", _kv(2))
    open_store(OTHER_KEY).put("older", {"kv": forged})
    monkeypatch.setattr(StoreKey, "sign", sign)
    assert KEY_ID_ITEM not in json.dumps(_header(reader, kind, tmp_path, url, "old"))
    assert torch.equal(reader.get("old")["kv"], _kv(2)["kv"])
    assert reader.get("older") is None and reader.stats().corrupt_dropped == 0
    reader.put("older", _kv())
    assert torch.equal(reader.get("older")["kv"], _kv()["kv"])


def test_an_entry_of_another_key_nobody_reads_is_written_over_on_disk(tmp_path: Path) -> None:
    DiskKVStore(tmp_path / "kv", store_key=OTHER_KEY).put("doc", _kv())
    reader = DiskKVStore(tmp_path / "kv", store_key=KEY, other_key_idle_s=3600)
    assert reader.get("doc") is None
    import diskcache

    with diskcache.Cache(str(tmp_path / "kv")) as cache:  # last read by its key 2 hours ago
        cache._sql("UPDATE Cache SET access_time = access_time - 7200")
    for _ in range(3):  # reads by another key do not count as its key's use
        assert reader.get("doc") is None
    reader.put("doc", _kv(1))
    assert torch.equal(reader.get("doc")["kv"], _kv(1)["kv"])


def test_on_redis_another_keys_entry_expires_unless_its_key_reads_it(redis_server) -> None:
    import redis

    client = redis.Redis.from_url(redis_server.url)
    owner = RedisKVStore(redis_server.url, store_key=OTHER_KEY)
    owner.put("doc", _kv())
    assert client.ttl("kvblend:kv:v1:doc") == -1
    reader = RedisKVStore(redis_server.url, store_key=KEY)
    assert reader.get("doc") is None
    assert 86000 < client.ttl("kvblend:kv:v1:doc") <= 86400  # a day, unless its key reads it
    client.expire("kvblend:kv:v1:doc", 100)
    assert reader.get("doc") is None and client.ttl("kvblend:kv:v1:doc") <= 100  # not renewed
    assert owner.get("doc") is not None
    assert client.ttl("kvblend:kv:v1:doc") > 86000  # its key's hit pushes it back to a day
    client.delete("kvblend:kv:v1:doc")  # expired: the slot is free for the reader's entry
    reader.put("doc", _kv(1))
    assert torch.equal(reader.get("doc")["kv"], _kv(1)["kv"])


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
    assert (tier.other_key, tier.hits) == (1, 0)  # unsigned: a miss, written over
    again = reader.prefill(PROMPT, BlendConfig("reuse"))
    assert again.stats.segments_precomputed == 0  # the recomputed entry is signed
    reader.store.close()


@pytest.mark.parametrize("kind", ["disk", "redis"])
def test_an_engine_with_another_key_never_costs_the_owners_entries(
    request: pytest.FixtureRequest, tmp_path: Path, kind: str, monkeypatch, caplog
) -> None:
    url = request.getfixturevalue("redis_server").url if kind == "redis" else None

    def engine(key: str, folder: str) -> BlendEngine:
        monkeypatch.setenv(STORE_KEY_ENV, key)
        store = default_store(tmp_path / folder, redis_url=url)
        return BlendEngine(tiny_model("qwen2"), byte_tokenizer(), store=store)

    owner = engine(KEY, "a")
    owner.precompute([DOC])
    expected = owner.prefill(PROMPT, BlendConfig("reuse")).logits
    owner.store.close()
    written = _raw(kind, tmp_path, url, owner.segment_id(DOC), "a")
    for run in range(3):  # each a new process of the misconfigured worker
        other = engine(OTHER_KEY, "a" if kind == "disk" else f"b{run}")
        other.register([DOC])
        with caplog.at_level("WARNING", logger="kvblend"):
            got = other.prefill(PROMPT, BlendConfig("reuse"))
        assert got.stats.segments_precomputed == 1  # computed, not read
        assert torch.allclose(got.logits, expected, atol=1e-4, rtol=0)
        assert other.prefill(PROMPT, BlendConfig("reuse")).stats.segments_precomputed == 0
        other.store.close()
    assert _raw(kind, tmp_path, url, owner.segment_id(DOC), "a") == written
    assert "another key" in caplog.text and "corrupt" not in caplog.text
    owner = engine(KEY, "a" if kind == "disk" else "c")
    assert owner.prefill(PROMPT, BlendConfig("reuse")).stats.segments_precomputed == 0
    owner.store.close()


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
