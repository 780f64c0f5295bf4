"""Registry loss in every form costs one rebuild from the store's entries, never all reuse.

On disk (garbage in ``records.db``, the records folder gone, a log replaced under a running
engine) and against a real ``redis-server`` (a flush, an evicted log, a garbage or wrongly typed
``:head`` key, an ACL user without scripting): a new engine, with no call to `register`, finds
every precomputed document, reads its KV (nothing precomputed again) and the log is whole again
for the next one.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import redis
import torch

from conftest import byte_tokenizer, tiny_model
from kvblend import BlendConfig, BlendEngine
from kvblend.documents.registry_records import text_digest
from kvblend.store import DiskKVStore, MemoryKVStore, RedisKVStore, default_store

A = "Marta Quill is a beekeeper who lives in Lisbon."
B = "Tomas Elm is a violin maker who lives in Cremona."
PROMPT = f"Docs: {A}\n\n{B}\nWho keeps bees?"


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2")


def engine_over(model, store, system_prompt: str = "Answer briefly.") -> BlendEngine:
    return BlendEngine(model, byte_tokenizer(), store=store, system_prompt=system_prompt)


def assert_reuses_both(engine: BlendEngine) -> None:
    stats = engine.prefill(PROMPT, BlendConfig("reuse")).stats
    assert (stats.documents_found, stats.documents_reused) == (2, 2)
    assert stats.segments_precomputed == 0 and stats.reused_tokens > 0


# ---------------------------------------------------------------------------- disk
def test_a_new_store_is_rebuilt_once_and_then_marked_whole(model, tmp_path: Path) -> None:
    first = engine_over(model, DiskKVStore(tmp_path))
    first.precompute([A, B])
    assert first.is_known(A) and first.library.registry.rebuilds == 1  # a new log: marked once
    second = engine_over(model, DiskKVStore(tmp_path))
    assert_reuses_both(second)
    assert second.library.registry.rebuilds == 0


@pytest.mark.parametrize("damage", ["garbage", "truncated", "deleted"])
def test_a_damaged_records_file_costs_one_rebuild(model, tmp_path: Path, damage: str) -> None:
    engine_over(model, DiskKVStore(tmp_path)).precompute([A, B])
    records = tmp_path / "records"
    if damage == "deleted":
        shutil.rmtree(records)
    else:
        for path in records.glob("records.db*"):
            path.write_bytes(b"\x13garbage" * 4096 if damage == "garbage" else b"SQLite format")
    second = engine_over(model, DiskKVStore(tmp_path), system_prompt="Another head.")
    assert_reuses_both(second)
    assert second.library.registry.rebuilds == 1
    # the heads came back too (entry metadata): a question naming A's first words is no near miss
    assert second.library.registry.anchor_in(f"{A[:16]} what?") is None
    assert second.library.registry.anchor_in(f"{A[:40]} what?") == (0, len(A))
    third = engine_over(model, DiskKVStore(tmp_path))
    assert third.is_known(A) and third.is_known(B) and third.library.registry.rebuilds == 0
    assert third.library.registry.anchor_in(f"{A[:16]} what?") is None


def test_a_log_replaced_under_a_running_engine_is_rebuilt(model, tmp_path: Path) -> None:
    writer = engine_over(model, DiskKVStore(tmp_path))
    writer.precompute([A])
    reader = engine_over(model, DiskKVStore(tmp_path))
    assert reader.is_known(A)
    for path in (tmp_path / "records").glob("records.db*"):
        path.unlink()  # the file is replaced: its sequence starts again
    fresh = engine_over(model, DiskKVStore(tmp_path))
    fresh.precompute([B])  # written to the new file, behind numbers the reader has passed
    assert reader.is_known(B)
    assert_reuses_both(reader)


def test_entries_not_of_this_model_or_naming_no_document_are_skipped(model) -> None:
    store = MemoryKVStore()
    engine = engine_over(model, store)
    engine.precompute([A])
    engine.prefill(engine.rag_segments("Q?", [B]), BlendConfig("reuse"))  # computed, unnamed
    other = engine_over(tiny_model("qwen2", seed=1), store)
    assert len(other.library.registry) == 0
    store._memory_record_logs.clear()
    again = engine_over(model, store)
    assert again.is_known(A) and not again.is_known(B) and again.library.registry.rebuilds == 1


def test_entries_computed_in_a_prefill_or_healed_name_their_documents(
    model, tmp_path: Path
) -> None:
    first = engine_over(model, DiskKVStore(tmp_path))
    first.register([A, B])  # nothing precomputed: the prefill computes both entries
    assert first.prefill(PROMPT, BlendConfig("reuse")).stats.segments_precomputed == 2
    key = first.segment_id(B)
    first.store.put(key, {"k.0": torch.zeros(2, 3)}, {"tokens": "6"})  # damaged, unnamed
    healer = engine_over(model, DiskKVStore(tmp_path))
    stats = healer.prefill(PROMPT, BlendConfig("reuse")).stats
    assert stats.segments_precomputed == 1  # a miss: the store dropped it and counted it
    assert healer.store.stats().corrupt_dropped == 1 and healer.library.segment_kv.dropped == 0
    assert healer.store.metadata(key)["document.digest"] == text_digest(B).hex()
    shutil.rmtree(tmp_path / "records")  # the registry is lost: only the entries name them
    fresh = engine_over(model, DiskKVStore(tmp_path))
    assert_reuses_both(fresh)
    assert fresh.library.registry.rebuilds == 1


def test_a_segment_passed_in_a_list_and_never_registered_stays_unnamed(model) -> None:
    engine = engine_over(model, MemoryKVStore())
    engine.prefill(engine.rag_segments("Q?", [B]), BlendConfig("reuse"))
    assert "document.digest" not in engine.store.metadata(engine.segment_id(B))


# ---------------------------------------------------------------------------- redis
def redis_engine(model, url: str, folder: Path | None = None, **kwargs) -> BlendEngine:
    if folder is None:
        return engine_over(model, RedisKVStore(url), **kwargs)
    return engine_over(model, default_store(folder, redis_url=url), **kwargs)


def log_keys(server) -> list[bytes]:
    return sorted(redis.Redis.from_url(server.url).scan_iter(match="kvblend:log:*"))


def test_a_flushed_server_costs_one_rebuild_from_the_local_tiers(
    model, redis_server, tmp_path: Path
) -> None:
    redis_engine(model, redis_server.url, tmp_path / "a").precompute([A, B])
    redis.Redis.from_url(redis_server.url).flushall()
    second = redis_engine(model, redis_server.url, tmp_path / "a")
    assert_reuses_both(second)
    assert second.library.registry.rebuilds == 1 and log_keys(redis_server)


def test_an_evicted_log_costs_one_rebuild_from_the_servers_entries(
    model, redis_server, tmp_path: Path
) -> None:
    redis_engine(model, redis_server.url).precompute([A, B])
    client = redis.Redis.from_url(redis_server.url)
    client.delete(*log_keys(redis_server))
    second = redis_engine(model, redis_server.url, system_prompt="Another head.")
    assert_reuses_both(second)
    assert second.library.registry.rebuilds == 1
    assert redis_engine(model, redis_server.url).library.registry.rebuilds == 0


@pytest.mark.parametrize("garbage", ["text", "negative", "wrong type", "longer list"])
def test_a_damaged_head_key_is_replaced_not_trusted(model, redis_server, garbage: str) -> None:
    first = redis_engine(model, redis_server.url)
    first.precompute([A, B])
    client = redis.Redis.from_url(redis_server.url)
    head = next(key for key in log_keys(redis_server) if key.endswith(b":head"))
    if garbage == "text":
        client.set(head, b"not a number \xff")
    elif garbage == "negative":
        client.set(head, b"-5")
    elif garbage == "wrong type":
        client.delete(head)
        client.hset(head, "x", "y")
    else:
        client.set(head, b"1")
    second = redis_engine(model, redis_server.url)
    assert_reuses_both(second)
    assert second.library.registry.rebuilds == 1
    assert int(client.get(head)) > 0  # replaced by a whole log
    assert redis_engine(model, redis_server.url).library.registry.rebuilds == 0
    # re-precomputing works against the repaired log
    first.precompute(["A third document, long enough to count."])
    assert redis_engine(model, redis_server.url).is_known("A third document, long enough to count.")


def test_an_acl_user_without_scripting_still_finds_every_document(
    model, redis_server, caplog: pytest.LogCaptureFixture
) -> None:
    redis_engine(model, redis_server.url).precompute([A, B])
    client = redis.Redis.from_url(redis_server.url)
    client.execute_command("ACL", "SETUSER", "noscript", "on", ">pw", "~*", "+@all", "-@scripting")
    url = redis_server.url.replace("redis://", "redis://noscript:pw@", 1)
    with pytest.raises(redis.exceptions.NoPermissionError):
        redis.Redis.from_url(url).eval("return 1", 0)
    engine = redis_engine(model, url)
    assert_reuses_both(engine)
    assert engine.library.registry.rebuilds == 1
    assert "store's entries instead" in caplog.text
    assert_reuses_both(engine)  # no rebuild per call
    assert engine.library.registry.rebuilds == 1


def test_the_documented_acl_is_enough_for_the_registry(model, redis_server) -> None:
    rule = (Path(__file__).parents[2] / "docs" / "deployment.md").read_text()
    rule = rule.split("ACL SETUSER kvblend ", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    client = redis.Redis.from_url(redis_server.url)
    client.execute_command("ACL", "SETUSER", "kvblend", *rule.replace(">PASSWORD", ">pw").split())
    url = redis_server.url.replace("redis://", "redis://kvblend:pw@", 1)
    redis_engine(model, url).precompute([A, B])
    second = redis_engine(model, url)
    assert_reuses_both(second)
    assert second.library.registry.rebuilds == 0 and second.library.registry._unusable_since is None
    client.delete(*log_keys(redis_server))  # the rebuild needs nothing more
    third = redis_engine(model, url)
    assert_reuses_both(third)
    assert third.library.registry.rebuilds == 1
