"""The Redis tier against a real `redis-server`: format, lazy reads, record logs, failures.

Every test starts its own server (tests/conftest_redis.py); failures are produced for real:
the server is killed (down, then restarted empty), frozen with SIGSTOP (slow: socket timeouts)
or started with a tiny ``maxmemory`` and ``noeviction`` (full: OOM errors on writes).
"""

from __future__ import annotations

import json
import logging
import time

import pytest
import redis
import safetensors.torch
import torch

from kvblend.store import (
    CorruptEntryError,
    DiskKVStore,
    MemoryKVStore,
    RedisKVStore,
    RemoteTieredKVStore,
    StoreError,
    default_store,
)
from kvblend.store.entry_format import encode_entry


def make_kv(seed: int = 0, layers: int = 3, tokens: int = 16) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    kv = {}
    for layer in range(layers):
        for kind in "kv":
            tensor = torch.randn(2, tokens, 8, generator=generator)
            kv[f"{kind}.{layer}"] = tensor.to(torch.bfloat16)
    return kv


def assert_same(entry, expected) -> None:
    assert entry is not None
    assert sorted(entry) == sorted(expected)
    for name, tensor in expected.items():
        got = entry[name]
        assert got.dtype == tensor.dtype and torch.equal(got, tensor), name


def header_of(value: bytes) -> dict:
    """The safetensors header (JSON): same header, same entry as the disk tier writes."""
    size = int.from_bytes(value[:8], "little")
    assert len(value) > 8 + size
    return json.loads(value[8 : 8 + size])


def raw(server) -> redis.Redis:
    return redis.Redis.from_url(server.url)


def wait_until_available(store: RedisKVStore) -> None:
    deadline = time.monotonic() + 30
    while not store.available:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_round_trip_stores_the_disk_format_under_a_versioned_key(redis_server):
    store = RedisKVStore(redis_server.url)
    kv = make_kv()
    store.put("doc-1", kv, {"model": "tiny"})
    value = raw(redis_server).get("kvblend:kv:v1:doc-1")
    assert header_of(value) == header_of(encode_entry("doc-1", kv, {"model": "tiny"}))
    assert torch.equal(safetensors.torch.load(value)["k.2"], kv["k.2"])
    assert_same(store.get("doc-1"), kv)
    assert store.metadata("doc-1") == {"model": "tiny"}
    assert store.contains("doc-1") and not store.contains("doc-2")
    assert store.get("doc-2") is None
    stats = store.stats()
    assert (stats.entries, stats.bytes, stats.hits, stats.misses) == (1, len(value), 1, 1)
    assert store.delete("doc-1") and not store.delete("doc-1")
    assert store.get("doc-1") is None
    store.close()


def test_tensors_are_fetched_one_by_one_on_access(redis_server):
    store = RedisKVStore(redis_server.url, prefetch_ahead=0)
    kv = make_kv(tokens=4096)  # 128 KiB per tensor: beyond the head fetched by get()
    store.put("big", kv)
    entry = store.get("big")
    assert entry.loaded == frozenset()
    assert torch.equal(entry["k.0"], kv["k.0"])
    assert entry.loaded == {"k.0"}  # layer 0 is usable before the last layer has arrived
    raw(redis_server).delete("kvblend:kv:v1:big")  # gone (evicted) while being read
    with pytest.raises(StoreError, match="evicted or replaced"):
        entry["v.2"]
    assert store.stats().corrupt_dropped == 0  # not mistaken for damage


def test_ttl_and_prefix(redis_server):
    store = RedisKVStore(redis_server.url, ttl_s=100, prefix="app1:")
    other = RedisKVStore(redis_server.url, prefix="app2:")
    store.put("doc", make_kv())
    assert 0 < raw(redis_server).ttl("app1:kv:v1:doc") <= 100
    assert other.get("doc") is None
    other.put("doc", make_kv(1))
    store.clear()
    assert store.get("doc") is None
    assert_same(other.get("doc"), make_kv(1))


def test_damage_is_detected_and_dropped(redis_server):
    store = RedisKVStore(redis_server.url)
    client = raw(redis_server)
    kv = make_kv(tokens=4096)
    store.put("a", kv)
    size = client.strlen("kvblend:kv:v1:a")
    client.setrange("kvblend:kv:v1:a", size - 10, b"\xff" * 4)  # a bit flip in the last tensor
    entry = store.get("a")
    with pytest.raises(CorruptEntryError):
        entry["v.2"]
    assert not client.exists("kvblend:kv:v1:a")
    store.put("b", kv)
    client.setrange("kvblend:kv:v1:b", 20, b"#")  # damaged header
    assert store.get("b") is None and not client.exists("kvblend:kv:v1:b")
    client.set("kvblend:kv:v1:c", b"not an entry")
    assert store.get("c") is None
    assert store.stats().corrupt_dropped == 3


def test_record_logs_are_shared_bounded_and_restart(redis_server):
    writer = RedisKVStore(redis_server.url, max_records=5)
    reader = RedisKVStore(redis_server.url, max_records=5)
    assert reader.read_records("docs") == ([], 0)
    writer.append_records("docs", [b"a", b"b", b"c"])
    records, cursor = reader.read_records("docs")
    assert (records, cursor) == ([b"a", b"b", b"c"], 3)
    assert reader.read_records("docs", cursor) == ([], 3)
    writer.append_records("docs", [b"d", b"e", b"f", b"g"])
    assert reader.read_records("docs", cursor) == ([b"d", b"e", b"f", b"g"], 7)
    assert reader.read_records("docs", 0) == ([b"c", b"d", b"e", b"f", b"g"], 7)  # bounded
    assert reader.read_records("other") == ([], 0)
    with pytest.raises(ValueError):
        writer.append_records("bad name", [b"x"])
    writer.clear()
    writer.append_records("docs", [b"new"])
    assert reader.read_records("docs", 7) == ([b"new"], 1)  # a cleared log restarts
    redis_server.kill()
    redis_server.start()
    wait_until_available(reader)
    assert reader.read_records("docs", 1) == ([], 0)  # restarted empty: the log restarts too


def test_down_server_costs_one_timeout_per_back_off_and_reconnects(redis_server, caplog):
    remote = RedisKVStore(redis_server.url, retry_after_s=0.2, max_retry_after_s=0.4)
    store = RemoteTieredKVStore(MemoryKVStore(), None, remote=remote)
    kv = make_kv()
    store.put("kept", kv)
    redis_server.kill()
    caplog.set_level(logging.WARNING)
    store.put("new", make_kv(1))  # memory only; counted
    assert not remote.available
    for _ in range(20):  # fail fast while backing off: no exception, answers from memory
        assert_same(store.get("kept"), kv)
        assert store.get("missing") is None
        assert not store.contains("missing")
        assert store.read_records("docs", 4) == ([], 4)
        store.append_records("docs", [b"x"])
    assert store.stats().put_errors == 1
    assert "redis" not in store.stats().tiers
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]  # one outage, one warning
    redis_server.start()  # restarted empty, same port
    wait_until_available(remote)
    store.put("after", kv)
    fresh = RemoteTieredKVStore(MemoryKVStore(), None, remote=RedisKVStore(redis_server.url))
    assert_same(fresh.get("after"), kv)
    assert fresh.get("kept") is None  # lost with the restart: a miss, the caller recomputes
    assert "redis" in store.stats().tiers


def test_frozen_server_times_out_into_misses(redis_server):
    remote = RedisKVStore(redis_server.url, socket_timeout_s=0.3, retry_after_s=0.2)
    store = RemoteTieredKVStore(MemoryKVStore(), None, remote=remote)
    kv = make_kv()
    remote.put("doc", kv)
    redis_server.pause()
    try:
        assert store.get("doc") is None  # one timeout, then fail fast
        assert store.get("doc") is None
        store.put("other", kv)
        assert store.stats().put_errors == 1
    finally:
        redis_server.resume()
    wait_until_available(remote)
    assert_same(store.get("doc"), kv)


def test_full_server_refuses_writes_without_failing_the_caller(make_redis_server, tmp_path):
    server = make_redis_server("--maxmemory", "2mb", "--maxmemory-policy", "noeviction")
    remote = RedisKVStore(server.url)
    big = make_kv(tokens=16384)  # 3 MiB
    with pytest.raises(StoreError, match="maxmemory"):
        remote.put("big", big)
    store = RemoteTieredKVStore(MemoryKVStore(), DiskKVStore(tmp_path / "disk"), remote=remote)
    store.put("big", big)
    assert store.stats().put_errors == 1
    assert_same(store.get("big"), big)  # from the local tiers
    assert remote.available  # a refusal is not an outage: no back-off
    assert not remote.contains("big")


def test_remote_hits_are_copied_into_the_local_tiers(redis_server, tmp_path):
    writer = default_store(tmp_path / "writer", redis_url=redis_server.url)
    kv = make_kv()
    writer.put("doc", kv, {"model": "tiny"})
    reader = default_store(tmp_path / "reader", redis_url=redis_server.url)
    assert isinstance(reader, RemoteTieredKVStore)
    assert reader.memory.get("doc") is None and reader.disk.get("doc") is None
    entry = reader.get("doc")
    assert entry.metadata == {"model": "tiny"}
    assert_same(entry, kv)
    reader.wait_for_promotions()
    assert_same(reader.memory.get("doc"), kv)
    assert_same(reader.disk.get("doc"), kv)
    stats = reader.stats()
    assert set(stats.tiers) == {"memory", "disk", "redis"}
    assert (stats.hits, stats.entries) == (1, 1)
    assert_same(reader.get("doc"), kv)


def test_default_store_reads_the_url_from_the_environment(redis_server, tmp_path, monkeypatch):
    monkeypatch.setenv("KVBLEND_REDIS_URL", redis_server.url)
    store = default_store(tmp_path / "kv")
    assert isinstance(store, RemoteTieredKVStore) and store.remote.url == redis_server.url
    monkeypatch.delenv("KVBLEND_REDIS_URL")
    assert not isinstance(default_store(tmp_path / "kv"), RemoteTieredKVStore)


def test_password_is_kept_out_of_messages(make_redis_server):
    server = make_redis_server("--requirepass", "s3cret")
    url = f"redis://:s3cret@127.0.0.1:{server.port}/0"
    store = RedisKVStore(url)
    store.put("doc", make_kv())
    assert store.contains("doc")
    assert "s3cret" not in store.url
    wrong = RedisKVStore(f"redis://:wrong@127.0.0.1:{server.port}/0")
    with pytest.raises(StoreError) as raised:
        wrong.get("doc")
    assert "wrong" not in str(raised.value)


class _EvictedAfterOpening(RedisKVStore):
    """A real Redis store whose entries disappear (as if evicted) right after `get()`."""

    def get(self, key, device=None, *, expect=None):
        entry = super().get(key, device, expect=expect)
        self.client.delete(self._entry_key(key))
        return entry


def test_an_entry_lost_mid_prompt_is_recomputed_not_raised(redis_server, caplog):
    from conftest import byte_tokenizer, tiny_model
    from kvblend import BlendEngine

    # ~250 byte tokens: 190 KB of KV each, more than get()'s first read, so tensors are fetched
    # after the entry is gone.
    docs = ["Lena Park plays the violin. " * 9, "Marta Quill lives in Lisbon. " * 9]
    reference = BlendEngine(tiny_model("llama"), byte_tokenizer(), store=MemoryKVStore())
    reference.precompute(docs)
    expected = reference.generate(reference.rag_segments("Who?", docs[::-1]), max_new_tokens=6)
    remote = _EvictedAfterOpening(redis_server.url, prefetch_ahead=0)
    store = RemoteTieredKVStore(MemoryKVStore(0), None, remote=remote)
    engine = BlendEngine(tiny_model("llama"), byte_tokenizer(), store=store)
    engine.precompute(docs)
    caplog.set_level(logging.WARNING)
    out = engine.generate(engine.rag_segments("Who?", docs[::-1]), max_new_tokens=6)
    assert out.text == expected.text
    assert any("recomputing the segment" in record.getMessage() for record in caplog.records)


def test_cli_store_stats_shows_the_redis_tier(redis_server, tmp_path, monkeypatch, capsys):
    from kvblend.cli.main import main

    RedisKVStore(redis_server.url).put("doc", make_kv())
    DiskKVStore(tmp_path / "kv").close()  # `store stats` reads an existing store folder
    monkeypatch.setenv("KVBLEND_REDIS_URL", redis_server.url)
    assert main(["store", "stats", "--store-dir", str(tmp_path / "kv")]) == 0
    out = capsys.readouterr().out
    assert f"redis: {redis_server.url}" in out
    assert "redis entries: 1" in out


def test_the_core_package_does_not_import_redis():
    import subprocess
    import sys

    code = "import sys, kvblend, kvblend.store; print('redis' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"  # redis-py is an optional extra
