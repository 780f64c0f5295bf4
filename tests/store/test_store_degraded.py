"""Fault injection, degraded cases: what used to cost reuse, a file or a timeout per request.

- A deleted or 0-byte index (``cache.db``), within 10 minutes of the last sweep, is damage like
  any other: rebuilt from the entry files, so nothing is computed again and every file is
  indexed (and counted against the size limit).
- An index row naming another key's file never makes the sweep delete that key's own file: the
  sweep reads each file's header first, and points the wrong row at it.
- A Redis entry replaced (``force=True`` by another process) while it is read is a miss, never
  "corrupt": not counted as damage, not deleted.
- A Redis server that accepts connections and never answers costs one timeout; the tier is
  then skipped (no request reaches it) until a background check sees it answer.

Each checks the answer against a clean run, that no untyped exception escapes and the counters.
"""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path

import pytest
import torch

from conftest import byte_tokenizer, tiny_model
from conftest_redis import stalled_redis  # noqa: F401 - the fixture, used by name
from kvblend import BlendConfig, BlendEngine
from kvblend.documents.blend_plan import open_spans
from kvblend.store import (
    CorruptEntryError,
    DiskKVStore,
    MemoryKVStore,
    RedisKVStore,
    RemoteTieredKVStore,
    default_store,
)
from kvblend.store.base import EntryReplacedError

DOCS = [
    f"Document {index}: the ferry to island {index} carries {index * 13} bicycles at dawn. " * 2
    for index in range(8)
]


def _prompt(doc: str) -> str:
    return f"Context: {doc}\nQuestion: how many bicycles?"


def _filled(folder: Path) -> tuple[BlendEngine, dict[str, torch.Tensor]]:
    """Precompute DOCS into `folder` (one file each); return the engine and reuse answers."""
    engine = BlendEngine(tiny_model("qwen2"), byte_tokenizer(), store=DiskKVStore(folder))
    engine.precompute(DOCS)
    assert len(list(folder.glob("*/*/*.val"))) == len(DOCS)
    answers = {doc: engine.prefill(_prompt(doc), BlendConfig("reuse")).logits for doc in DOCS}
    return engine, answers


def _indexed_files(folder: Path) -> set[str]:
    with sqlite3.connect(folder / "cache.db") as connection:
        rows = connection.execute("SELECT filename FROM Cache WHERE filename IS NOT NULL")
        named = {row[0] for row in rows}
    connection.close()
    return named


def _files(folder: Path) -> set[str]:
    return {str(path.relative_to(folder)) for path in folder.glob("*/*/*.val")}


def _assert_reuses_every_document(engine: BlendEngine, answers: dict[str, torch.Tensor]) -> None:
    engine.register(DOCS)
    for doc in DOCS:
        got = engine.prefill(_prompt(doc), BlendConfig("reuse"))
        assert got.stats.segments_precomputed == 0 and got.stats.documents_reused == 1
        assert torch.allclose(got.logits, answers[doc], atol=1e-5, rtol=0)


# --------------------------------------------------------------------------- a lost index
@pytest.mark.parametrize("how", ["deleted", "emptied", "deleted-while-open"])
def test_a_lost_index_is_rebuilt_from_the_entry_files(tmp_path: Path, how: str) -> None:
    folder = tmp_path / "kv"
    writer, answers = _filled(folder)  # swept just now: the next sweep is 10 minutes away
    files, volume = _files(folder), writer.store.stats().bytes
    if how != "deleted-while-open":
        writer.store.close()
    for path in folder.glob("cache.db*"):
        if how == "emptied" and path.name == "cache.db":
            path.write_bytes(b"")
        else:
            path.unlink()
    engine = writer if how == "deleted-while-open" else None
    if engine is None:
        engine = BlendEngine(tiny_model("qwen2"), byte_tokenizer(), store=DiskKVStore(folder))
    _assert_reuses_every_document(engine, answers)  # nothing computed again
    stats = engine.store.stats()
    assert stats.entries == len(DOCS) and stats.corrupt_dropped == 0
    assert stats.bytes >= sum(os.path.getsize(folder / name) for name in files)  # counted
    assert abs(stats.bytes - volume) < 64 << 10  # as before, but the index's own pages
    assert _indexed_files(folder) == _files(folder) == files  # no file left unindexed
    report = engine.store.repair()
    assert report.index_rebuilt and report.files_adopted == len(DOCS)
    assert (report.orphans_deleted, report.rows_dropped) == (0, 0)
    engine.store.close()


# ------------------------------------------------------------------- the sweep reads headers
@pytest.mark.parametrize("other_row", ["kept", "lost"])
def test_a_row_naming_another_keys_file_never_costs_the_first_keys_file(
    tmp_path: Path, other_row: str
) -> None:
    from kvblend.store.disk.rebuild import SWEEP_STAMP

    folder = tmp_path / "kv"
    writer, answers = _filled(folder)
    first, second = (writer.segment_id(doc) for doc in DOCS[:2])
    writer.store.close()
    with sqlite3.connect(folder / "cache.db") as connection:
        own, other = (
            connection.execute("SELECT filename FROM Cache WHERE key = ?", (key,)).fetchone()[0]
            for key in (first, second)
        )
        connection.execute("UPDATE Cache SET filename = ? WHERE key = ?", (other, first))
        if other_row == "lost":
            connection.execute("DELETE FROM Cache WHERE key = ?", (second,))
    connection.close()
    long_ago = time.time() - 3600
    for path in folder.glob("*/*/*.val"):  # old enough for the sweep to judge them
        os.utime(path, (long_ago, long_ago))
    (folder / SWEEP_STAMP).unlink()  # the sweep is due when the folder is next opened

    engine = BlendEngine(tiny_model("qwen2"), byte_tokenizer(), store=DiskKVStore(folder))
    assert (folder / own).exists() and (folder / other).exists()  # neither file deleted
    assert _indexed_files(folder) == _files(folder)
    _assert_reuses_every_document(engine, answers)
    assert engine.store.stats().corrupt_dropped == 0 and engine.library.segment_kv.dropped == 0
    engine.store.close()


# ------------------------------------------------------------- Redis: replaced while read
def _entry(seed: int, tokens: int = 2048) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"kv": torch.randn(4, 2, 2, tokens, 8, generator=generator)}  # 1 MiB: past the head


@pytest.mark.parametrize("replacement", ["same-size", "shorter", "deleted"])
def test_a_redis_entry_replaced_while_read_is_a_miss_not_damage(
    redis_server, replacement: str, caplog
) -> None:
    reader = RedisKVStore(redis_server.url, prefetch_ahead=0)
    writer = RedisKVStore(redis_server.url)
    writer.put("doc", _entry(0))
    entry = reader.get("doc")  # the header is read, the tensor not yet
    assert entry is not None
    if replacement == "deleted":
        writer.delete("doc")  # evicted
    else:
        writer.put("doc", _entry(1, 2048 if replacement == "same-size" else 1024))  # force=True
    with pytest.raises(EntryReplacedError) as raised:
        entry["kv"]
    assert not isinstance(raised.value, CorruptEntryError)
    stats = reader.stats()
    assert (stats.hits, stats.misses, stats.corrupt_dropped) == (0, 1, 0)
    assert "corrupt" not in caplog.text
    if replacement != "deleted":  # the new entry is not dropped: the next read gets it
        again = reader.get("doc")
        new = _entry(1, 2048 if replacement == "same-size" else 1024)
        assert again is not None and torch.equal(again["kv"], new["kv"])
        assert reader.stats().hits == 1


def test_an_engine_recomputes_a_redis_entry_replaced_mid_prompt(
    redis_server, tmp_path: Path, caplog
) -> None:
    doc = DOCS[0] * 2  # 300 tokens: the entry is larger than the head get() fetches
    prompt = _prompt(doc)
    writer = BlendEngine(
        tiny_model("qwen2"),
        byte_tokenizer(),
        store=default_store(tmp_path / "a", redis_url=redis_server.url),
    )
    writer.precompute([doc])
    writer.store.wait_for_promotions()
    clean = writer.store.get(writer.segment_id(doc))
    clean_kv = clean["kv"].clone()
    reader = BlendEngine(
        tiny_model("qwen2"),
        byte_tokenizer(),
        store=default_store(tmp_path / "b", redis_url=redis_server.url),
    )
    reader.register([doc])
    spans, computed = open_spans(reader.library.segment_kv, reader.plan(prompt))
    assert computed == 0 and len(spans) == 1
    key = writer.segment_id(doc)
    replaced = {"kv": clean_kv + 1e-7}  # another process's force=True rewrite, other bits
    writer.store.remote.put(key, replaced, writer.store.metadata(key))
    kv = spans[0].source.layers()  # read now: replaced on the server since it was opened
    assert spans[0].source.recomputed  # computed again, within the same call
    assert torch.allclose(kv, clean_kv[:, :, :, spans[0].source.rows], atol=1e-5, rtol=0)
    redis_tier = reader.store.stats().tiers["redis"]
    assert redis_tier.corrupt_dropped == 0 and redis_tier.misses == 1
    summary = reader.store.stats()  # the tiered store's own count: a miss, not a hit
    assert (summary.hits, summary.misses) == (0, 1)
    assert "corrupt" not in caplog.text
    expected = writer.prefill(prompt, BlendConfig("reuse")).logits
    got = reader.prefill(prompt, BlendConfig("reuse"))
    assert torch.allclose(got.logits, expected, atol=1e-4, rtol=0)


# ---------------------------------------------------------------------- a stalled Redis
def test_a_stalled_redis_costs_one_timeout_then_is_skipped(stalled_redis) -> None:  # noqa: F811
    remote = RedisKVStore(
        stalled_redis.url, socket_timeout_s=0.5, retry_after_s=3600, max_retry_after_s=3600
    )
    store = RemoteTieredKVStore(MemoryKVStore(), None, remote=remote)
    kv = _entry(0, 16)
    store.put("local", kv)  # the first request: it times out, the tier is taken out
    assert store.stats().put_errors == 1 and not remote.available
    sent = stalled_redis.commands()
    assert sent and stalled_redis.connections == 1
    for _ in range(3):  # the next queries: answered locally, nothing sent to the server
        assert store.get("missing") is None
        entry = store.get("local")
        assert entry is not None and torch.equal(entry["kv"], kv["kv"])
        assert not store.contains("missing") and store.metadata("missing") is None
        assert store.read_records("documents", 0) == ([], 0)
        store.append_records("documents", [b"x"])
        store.put("other", kv)
    assert stalled_redis.commands() == sent and stalled_redis.connections == 1
    stats = store.stats()
    assert (stats.hits, stats.misses, stats.put_errors) == (3, 3, 4)
    assert remote.health.outages == 1 and remote.health.recoveries == 0
    store.close()


def test_a_stalled_redis_is_used_again_once_it_answers(redis_server, tmp_path: Path) -> None:
    remote = RedisKVStore(
        redis_server.url, socket_timeout_s=1.0, retry_after_s=0.05, max_retry_after_s=0.1
    )
    store = RemoteTieredKVStore(MemoryKVStore(), None, remote=remote)
    kv = _entry(0, 16)
    RedisKVStore(redis_server.url).put("doc", kv)
    redis_server.pause()  # SIGSTOP: connections are accepted, nothing is answered
    try:
        assert store.get("doc") is None  # one timeout: a miss, the tier is taken out
        assert not remote.available
        assert store.get("doc") is None and store.stats().tiers.get("redis") is None
    finally:
        redis_server.resume()
    deadline = time.monotonic() + 60
    while not remote.available:  # the background check brings the tier back
        assert time.monotonic() < deadline, "the tier never came back"
        time.sleep(0.02)
    entry = store.get("doc")
    assert entry is not None and torch.equal(entry["kv"], kv["kv"])
    assert (remote.health.outages, remote.health.recoveries) == (1, 1)
    store.close()
