"""Fault injection, crafted entries: stored KV that does not fit the model is never used.

An entry under the right key, with valid checksums, can still hold the wrong thing: more or
fewer tokens than the document, another head dimension, a 2-D tensor, fp16 in an fp32 store, a
single layer of three, keys without values, the per-layer tensors of the layout before the
one-tensor entry, NaN or infinity. Each is written through the store's own `put()` (so
every checksum is right), and each must give the answer of a clean run, never an exception,
be dropped and counted, and be replaced by an intact entry: by the prefill that met it, and by
`precompute()`, which must never count it intact. Every store kind is tried, Redis included
(a real ``redis-server``, `conftest_redis`).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from conftest import byte_tokenizer, tiny_model
from kvblend import BlendConfig, BlendEngine
from kvblend.documents.blend_plan import open_spans
from kvblend.store import DiskKVStore, KVStore, MemoryKVStore, default_store
from read_only_folder import read_only_folder as _read_only

DOC = "Marta Quill keeps forty hives on the roof of an old printing house. "
PROMPT = f"Context: {DOC}\nQuestion: where are the hives?"

Tensors = dict[str, torch.Tensor]


def _poison(tensors: Tensors, value: float) -> Tensors:
    crafted = {name: tensor.clone() for name, tensor in tensors.items()}
    crafted["kv"][1, 1, 1, 3, 5] = value  # one value of a middle layer's values
    return crafted


CRAFTED: dict[str, Callable[[Tensors], Tensors]] = {
    "more-tokens": lambda ts: {n: torch.cat([t, t[..., :4, :]], dim=3) for n, t in ts.items()},
    "fewer-tokens": lambda ts: {n: t[..., :-4, :].contiguous() for n, t in ts.items()},
    "wrong-head-dim": lambda ts: {n: t[..., :8].contiguous() for n, t in ts.items()},
    "2-d": lambda ts: {n: t.reshape(-1, t.shape[-1]) for n, t in ts.items()},
    "fp16": lambda ts: {n: t.half() for n, t in ts.items()},
    "one-of-three-layers": lambda ts: {n: t[:1].contiguous() for n, t in ts.items()},
    "keys-only": lambda ts: {n: t[:, :1].contiguous() for n, t in ts.items()},
    "per-layer-names": lambda ts: {
        f"{kind}.{layer}": t[layer, index].contiguous()
        for t in ts.values()
        for layer in range(t.shape[0])
        for index, kind in enumerate("kv")
    },
    "nan": lambda ts: _poison(ts, float("nan")),
    "inf": lambda ts: _poison(ts, float("inf")),
}


@pytest.fixture(scope="module")
def clean() -> tuple[Tensors, torch.Tensor]:
    """The entry a clean run stores for DOC, and the logits of a reuse prefill over it."""
    engine = BlendEngine(tiny_model("qwen2"), byte_tokenizer(), store=MemoryKVStore())
    engine.precompute([DOC])
    entry = engine.store.get(engine.segment_id(DOC))
    assert entry is not None
    tensors = {name: entry[name].clone() for name in entry}
    return tensors, engine.prefill(PROMPT, BlendConfig("reuse")).logits


def _stores(kind: str, tmp_path: Path, redis_url: str | None) -> Callable[[], KVStore]:
    """A factory of store objects over one place (each call: as a new process would open it)."""
    memory = MemoryKVStore()
    factories: dict[str, Callable[[], KVStore]] = {
        "memory": lambda: memory,
        "disk": lambda: DiskKVStore(tmp_path / "kv"),
        "tiered": lambda: default_store(tmp_path / "kv"),
        "redis": lambda: default_store(tmp_path / f"kv{id(object())}", redis_url=redis_url),
    }
    return factories[kind]


def _corrupt_dropped(store: KVStore) -> int:
    stats = store.stats()
    return stats.corrupt_dropped + sum(tier.corrupt_dropped for tier in stats.tiers.values())


def _fits(tensors: Tensors, reference: Tensors) -> bool:
    """Same names, shapes and dtypes, and values within float rounding.

    A segment recomputed inside a prefill goes through the blend loop, whose fused products
    round differently from precompute's batched forward in the last bit.
    """
    return tensors.keys() == reference.keys() and all(
        tensors[name].shape == reference[name].shape
        and tensors[name].dtype == reference[name].dtype
        and torch.allclose(tensors[name], reference[name], atol=1e-5, rtol=0)
        for name in reference
    )


@pytest.mark.parametrize("kind", ["memory", "disk", "tiered", "redis"])
@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_a_crafted_entry_is_dropped_recomputed_and_never_used(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    clean: tuple[Tensors, torch.Tensor],
    kind: str,
    case: str,
) -> None:
    tensors, expected = clean
    redis_url = request.getfixturevalue("redis_server").url if kind == "redis" else None
    open_store = _stores(kind, tmp_path, redis_url)
    engine = BlendEngine(tiny_model("qwen2"), byte_tokenizer(), store=open_store())
    engine.register([DOC])
    key = engine.segment_id(DOC)
    metadata = {"tokens": str(tensors["kv"].shape[3])}
    writer = open_store()
    writer.put(key, CRAFTED[case](tensors), metadata)
    writer.close()

    reader = BlendEngine(tiny_model("qwen2"), byte_tokenizer(), store=open_store())
    reader.register([DOC])
    plan = reader.plan(PROMPT)
    spans, computed = open_spans(reader.library.segment_kv, plan)
    for index in range(reader.decoder.shape.num_layers):  # as the blend loop reads them
        for span in spans:
            span.source.layer(index)
    # found at opening (a miss, computed now) or while reading (recomputed in place)
    assert computed + sum(span.source.recomputed for span in spans) == 1
    got = reader.prefill(PROMPT, BlendConfig("reuse"))  # never raises
    assert got.stats.documents_found == 1
    error = (got.logits - expected).abs().max().item()
    assert torch.allclose(got.logits, expected, atol=1e-4, rtol=0), f"max error {error:.3g}"
    assert _corrupt_dropped(reader.store) + reader.library.segment_kv.dropped >= 1
    stored = reader.store.get(key)
    assert stored is not None and _fits({n: stored[n] for n in stored}, tensors)  # healed

    # precompute() over the crafted entry again: never counted intact, always rewritten
    writer = open_store()
    writer.put(key, CRAFTED[case](tensors), metadata)
    writer.close()
    fresh = BlendEngine(tiny_model("qwen2"), byte_tokenizer(), store=open_store())
    assert not fresh.library.segment_kv.intact(key, len(fresh.library.segment_kv.layout(DOC).ids))
    fresh.precompute([DOC])
    assert fresh.library.segment_kv.intact(key, len(fresh.library.segment_kv.layout(DOC).ids))
    again = fresh.prefill(PROMPT, BlendConfig("reuse"))
    assert again.stats.segments_precomputed == 0  # reuse is back after one rebuild
    assert torch.allclose(again.logits, expected, atol=1e-4, rtol=0)


# ---------------------------------------------------------------------------------- Redis access


def _acl_user(server, rules: str) -> str:
    """Create the ACL user ``kv`` (password ``pw``) with `rules`; return its URL."""
    import redis

    admin = redis.Redis.from_url(server.url)
    admin.execute_command("ACL", "SETUSER", "kv", "reset", "on", ">pw", *rules.split())
    admin.close()
    return f"redis://kv:pw@127.0.0.1:{server.port}/0"


def test_the_documented_acl_is_all_a_redis_tier_needs(
    redis_server, tmp_path: Path, clean: tuple[Tensors, torch.Tensor], caplog
) -> None:
    import redis

    from kvblend.store import RedisKVStore
    from kvblend.store.redis.access import required_acl

    rules = required_acl()
    assert rules in (Path(__file__).parents[2] / "docs" / "deployment.md").read_text("utf-8")
    url = _acl_user(redis_server, rules)
    store = RedisKVStore(url)
    tensors, _ = clean
    store.put("doc", tensors, {"tokens": "5"})
    entry = store.get("doc")
    assert entry is not None and _fits({n: entry[n] for n in entry}, tensors)
    assert store.contains("doc") and store.metadata("doc") == {"tokens": "5"}
    store.append_records("documents", [b"a", b"b"])
    assert store.read_records("documents") == ([b"a", b"b"], 2)
    assert store.stats().entries == 1
    admin = redis.Redis.from_url(redis_server.url)
    admin.set("kvblend:kv:v1:bad", b"\x10" + b"\x00" * 7 + b"not a kvblend entry....")
    assert store.get("bad") is None and store.stats().corrupt_dropped == 1  # the drop script ran
    assert not admin.exists("kvblend:kv:v1:bad")
    assert store.delete("doc") and not store.contains("doc")
    store.clear()
    assert admin.dbsize() == 0

    # a whole engine over the ACL user: precompute, then reuse, without a single refusal
    engine = BlendEngine(
        tiny_model("qwen2"), byte_tokenizer(), store=default_store(tmp_path / "a", redis_url=url)
    )
    engine.precompute([DOC])
    engine.store.wait_for_promotions()
    reader = BlendEngine(
        tiny_model("qwen2"), byte_tokenizer(), store=default_store(tmp_path / "b", redis_url=url)
    )
    got = reader.prefill(PROMPT, BlendConfig("reuse"))
    assert got.stats.documents_reused == 1 and got.stats.segments_precomputed == 0
    assert reader.store.stats().put_errors == 0 and engine.store.stats().put_errors == 0
    assert "NOPERM" not in caplog.text and "without a password" not in caplog.text


def test_a_user_without_scripting_is_refused_not_silently_half_working(redis_server) -> None:
    from kvblend.store import RedisKVStore, StoreError
    from kvblend.store.redis.access import required_acl

    rules = required_acl().replace("+evalsha", "").replace("+eval", "")
    store = RedisKVStore(_acl_user(redis_server, rules))
    with pytest.raises(StoreError, match="(?i)noperm|permission"):
        store.append_records("documents", [b"a"])


def test_an_open_remote_redis_is_warned_about_once(caplog) -> None:
    from kvblend.store import RedisKVStore

    caplog.set_level("WARNING", logger="kvblend.store.redis.access")
    RedisKVStore("redis://10.255.1.2:6390/0")  # building does not connect
    RedisKVStore("redis://10.255.1.2:6390/1")
    warnings = [r for r in caplog.records if "without a password" in r.getMessage()]
    assert len(warnings) == 1 and "10.255.1.2:6390" in warnings[0].getMessage()
    caplog.clear()
    for url in (
        "redis://:secret@10.255.1.3:6379/0",
        "redis://user:secret@10.255.1.4:6379/0",
        "redis://127.0.0.1:6379/0",
        "redis://localhost:6379/0",
        "redis://[::1]:6379/0",
        "unix:///tmp/redis.sock",
    ):
        RedisKVStore(url)
    assert "without a password" not in caplog.text


# ------------------------------------------------------------------------------------ disk index

DOCS = [
    "Lena Park tunes the old violin every morning before the market opens on the square. " * 2,
    "The ferry to the northern island leaves at dawn and returns before the evening storms. " * 2,
]


def _question(doc: str) -> str:
    return f"Context: {doc}\nQuestion: what happens?"


def _filled(folder: Path) -> dict[str, torch.Tensor]:
    """Precompute DOCS into a disk store at `folder`; return each prompt's reuse logits."""
    engine = BlendEngine(tiny_model("qwen2"), byte_tokenizer(), store=DiskKVStore(folder))
    engine.precompute(DOCS)
    assert len(list(folder.glob("*/*/*.val"))) == len(DOCS)  # entry files, not index blobs
    answers = {doc: engine.prefill(_question(doc), BlendConfig("reuse")).logits for doc in DOCS}
    engine.store.close()
    return answers


def _damage_index(folder: Path, how: str) -> None:
    index = folder / "cache.db"
    if how == "truncated":
        with index.open("r+b") as file:
            file.truncate(index.stat().st_size // 2)
    elif how == "garbage":
        index.write_bytes(os.urandom(16384))
    else:  # garbage pages past the header: opens, and fails on the first full read
        with index.open("r+b") as file:
            file.seek(2 * 4096)
            file.write(os.urandom(3 * 4096))


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("how", ["garbage", "truncated", "pages"])
def test_index_damage_keeps_every_intact_entry(tmp_path: Path, how: str, capsys) -> None:
    from kvblend.cli.main import main

    folder = tmp_path / "kv"
    answers = _filled(folder)
    files = sorted(p.read_bytes() for p in folder.glob("*/*/*.val"))
    _damage_index(folder, how)
    assert main(["store", "stats", "--store-dir", str(folder)]) == 0  # no wipe on a look
    assert f"entries: {len(DOCS)}" in capsys.readouterr().out
    assert sorted(p.read_bytes() for p in folder.glob("*/*/*.val")) == files
    engine = BlendEngine(tiny_model("qwen2"), byte_tokenizer(), store=DiskKVStore(folder))
    engine.register(DOCS)
    for doc in DOCS:
        got = engine.prefill(_question(doc), BlendConfig("reuse"))
        assert got.stats.segments_precomputed == 0 and got.stats.documents_reused == 1
        assert torch.allclose(got.logits, answers[doc], atol=1e-5, rtol=0)


def test_two_rows_naming_one_file_never_delete_the_file_the_other_owns(tmp_path: Path) -> None:
    folder = tmp_path / "kv"
    answers = _filled(folder)
    engine = BlendEngine(tiny_model("qwen2"), byte_tokenizer(), store=DiskKVStore(folder))
    first, second = (engine.segment_id(doc) for doc in DOCS)
    with sqlite3.connect(folder / "cache.db") as connection:  # the second row -> first's file
        (owned,) = connection.execute(
            "SELECT filename FROM Cache WHERE key = ?", (first,)
        ).fetchone()
        connection.execute("UPDATE Cache SET filename = ? WHERE key = ?", (owned, second))
    engine.register(DOCS)
    for doc in reversed(DOCS):  # the second first: its row is dropped, the file is kept
        got = engine.prefill(_question(doc), BlendConfig("reuse"))
        assert torch.allclose(got.logits, answers[doc], atol=1e-5, rtol=0)
    assert (folder / owned).exists() and engine.library.segment_kv.intact(first)
    assert engine.store.stats().corrupt_dropped == 1
    assert engine.library.segment_kv.intact(second)  # recomputed and stored again


def test_a_killed_writer_leaves_nothing_once_the_store_opens_again(tmp_path: Path) -> None:
    from kvblend.store.disk.rebuild import SWEEP_STAMP

    folder = tmp_path / "kv"
    answers = _filled(folder)
    whole = next(folder.glob("*/*/*.val"))
    with sqlite3.connect(folder / "cache.db") as connection:  # killed before its row committed
        connection.execute(
            "DELETE FROM Cache WHERE filename = ?", (str(whole.relative_to(folder)),)
        )
    free = [f"{n:02x}" for n in range(256) if not (folder / f"{n:02x}").exists()]
    partial = folder / free[0] / "ff" / ("1" * 28 + ".val")  # killed while writing the file
    partial.parent.mkdir(parents=True)
    partial.write_bytes(whole.read_bytes()[:5000])
    empty = folder / free[1] / "cc"  # killed after making its folders
    empty.mkdir(parents=True)
    long_ago = time.time() - 3600
    for path in (whole, partial, partial.parent, partial.parent.parent, empty, empty.parent):
        os.utime(path, (long_ago, long_ago))
    (folder / SWEEP_STAMP).unlink()  # no sweep for ten minutes, as the last opening was then

    engine = BlendEngine(tiny_model("qwen2"), byte_tokenizer(), store=DiskKVStore(folder))
    assert not partial.exists() and not (folder / free[0]).exists()
    assert not (folder / free[1]).exists()
    assert whole.exists() and engine.store.stats().entries == len(DOCS)  # taken back in
    engine.register(DOCS)
    for doc in DOCS:
        got = engine.prefill(_question(doc), BlendConfig("reuse"))
        assert got.stats.segments_precomputed == 0
        assert torch.allclose(got.logits, answers[doc], atol=1e-5, rtol=0)


@contextlib.contextmanager
def _full_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs (root with mount only), for a store folder to be filled and then opened."""
    disk = tmp_path / "small-disk"
    disk.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], check=False
        ).returncode
    ):
        pytest.skip("a full disk is made with a small tmpfs: needs root with mount")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "--lazy", str(disk)], check=False)


@pytest.mark.parametrize("fault", ["read-only", "full"])
def test_a_read_only_or_full_disk_still_serves_what_it_can_read(
    tmp_path: Path, caplog, fault: str
) -> None:
    with contextlib.ExitStack() as stack:
        if fault == "full":
            folder = stack.enter_context(_full_disk(tmp_path)) / "kv"
            answers = _filled(folder)
            with contextlib.suppress(OSError), (folder.parent / "ballast").open("wb") as file:
                while True:
                    file.write(b"\0" * (64 << 10))
            view = folder
        else:
            folder = tmp_path / "kv"
            answers = _filled(folder)
            view = stack.enter_context(_read_only(folder))
        before = _snapshot(view)
        store = default_store(view)
        assert store.disk is not None and store.disk.read_only
        engine = BlendEngine(tiny_model("qwen2"), byte_tokenizer(), store=store)
        engine.register(DOCS)
        for doc in DOCS:
            got = engine.prefill(_question(doc), BlendConfig("reuse"))
            assert got.stats.segments_precomputed == 0  # read from the read-only disk
            assert torch.allclose(got.logits, answers[doc], atol=1e-5, rtol=0)
        caplog.clear()
        engine.precompute(["A document the read-only disk cannot take. " * 3] * 1)
        engine.precompute(["Another document it cannot take either. " * 3])
        failures = [r for r in caplog.records if "write failed" in r.getMessage()]
        assert len(failures) == 1 and store.stats().put_errors == 2  # one line, then counted
        after = _snapshot(view)
        for name in list(after) + list(before):  # SQLite's own -shm/-wal, left as it could
            if name.endswith(("-shm", "-wal")):
                after.pop(name, None), before.pop(name, None)
        assert after == before
        store.close()


# -------------------------------------------------------------------------------------- symlinks


def _tree(folder: Path) -> dict[str, tuple[int, bytes]]:
    """Every path under `folder` with its mode and (for files) its bytes."""
    found = {}
    for path in [folder, *folder.rglob("*")]:
        info = path.lstat()
        found[str(path.relative_to(folder))] = (
            info.st_mode,
            path.read_bytes() if path.is_file() and not path.is_symlink() else b"",
        )
    return found


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A folder outside the store, with a file and a database-looking file in it."""
    folder = tmp_path / "outside"
    folder.mkdir(mode=0o755)
    (folder / "notes.txt").write_text("not the store's")
    (folder / "cache.db").write_bytes(b"")
    (folder / "records").mkdir()
    return folder


@pytest.mark.parametrize("name", ["cache.db", "cache.db-wal", "records", "records/records.db"])
def test_no_index_or_log_is_followed_out_of_the_folder(
    tmp_path: Path, outside: Path, name: str, caplog
) -> None:
    from kvblend.store import StoreError

    folder = tmp_path / "kv"
    folder.mkdir(mode=0o700)
    if name != "records":
        (folder / "records").mkdir(mode=0o700)
    target = outside / ("records" if name == "records" else "cache.db")
    (folder / name).symlink_to(target)
    before = _tree(outside)
    if name.startswith("cache.db"):
        with pytest.raises(StoreError, match="symbolic link"):
            DiskKVStore(folder)
    store = default_store(folder)
    engine = BlendEngine(tiny_model("qwen2"), byte_tokenizer(), store=store)
    engine.precompute([DOC])
    got = engine.prefill(PROMPT, BlendConfig("reuse"))
    assert got.stats.documents_reused == 1 and got.stats.segments_precomputed == 0
    assert any("symbolic link" in r.getMessage() for r in caplog.records)
    store.close()
    assert _tree(outside) == before


def _one_place(monkeypatch: pytest.MonkeyPatch) -> str:
    """Make every new value file go to ab/cd/ (diskcache picks a random folder otherwise)."""
    from kvblend.store import files

    counter = iter(range(10**6))

    def filename(self, key=None, value=None):
        name = os.path.join("ab", "cd", f"{next(counter):028x}.val")
        return name, os.path.join(self._directory, name)

    monkeypatch.setattr(files.BytesOnlyDisk, "filename", filename)
    return os.path.join("ab", "cd")


@pytest.mark.parametrize("link", ["ab", "ab/cd"])
def test_no_entry_is_written_through_a_linked_sub_folder(
    tmp_path: Path, outside: Path, link: str, monkeypatch, caplog
) -> None:
    _one_place(monkeypatch)
    folder = tmp_path / "kv"
    folder.mkdir(mode=0o700)
    if link != "ab":
        (folder / "ab").mkdir(mode=0o700)
    (folder / link).symlink_to(outside)
    before = _tree(outside)
    store = default_store(folder)
    engine = BlendEngine(tiny_model("qwen2"), byte_tokenizer(), store=store)
    engine.precompute([DOC])  # the disk write is refused; memory keeps the entry
    expected = engine.prefill(PROMPT, BlendConfig("reuse"))
    failures = [r for r in caplog.records if "write failed" in r.getMessage()]
    assert len(failures) == 1 and "symbolic link" in failures[0].getMessage()
    fresh = BlendEngine(tiny_model("qwen2"), byte_tokenizer(), store=DiskKVStore(folder))
    fresh.register([DOC])
    got = fresh.prefill(PROMPT, BlendConfig("reuse"))  # nothing on disk: computed, not raised
    assert torch.allclose(got.logits, expected.logits, atol=1e-5, rtol=0)
    store.close()
    assert _tree(outside) == before


def test_an_entry_whose_sub_folder_became_a_link_is_neither_read_nor_deleted(
    tmp_path: Path, outside: Path, monkeypatch
) -> None:
    sub = _one_place(monkeypatch)
    folder = tmp_path / "kv"
    writer = BlendEngine(tiny_model("qwen2"), byte_tokenizer(), store=DiskKVStore(folder))
    writer.precompute([DOC])
    expected = writer.prefill(PROMPT, BlendConfig("reuse"))
    writer.store.close()
    os.replace(folder / sub, outside / "moved")  # the entry's folder now lives outside
    (folder / sub).symlink_to(outside / "moved")
    before = _tree(outside)
    reader = BlendEngine(tiny_model("qwen2"), byte_tokenizer(), store=DiskKVStore(folder))
    reader.register([DOC])
    got = reader.prefill(PROMPT, BlendConfig("reuse"))
    assert torch.allclose(got.logits, expected.logits, atol=1e-5, rtol=0)
    assert reader.store.stats().corrupt_dropped == 1  # a foreign value: its row is dropped
    reader.store.close()
    assert _tree(outside) == before


# ------------------------------------------------------------------------------------- Redis tier


def _redis_engine(folder: Path, url: str) -> BlendEngine:
    """An engine over a fresh local tier (a new machine) in front of the Redis server at `url`."""
    return BlendEngine(
        tiny_model("qwen2"), byte_tokenizer(), store=default_store(folder, redis_url=url)
    )


def _garbage(server, engine: BlendEngine) -> None:
    import redis

    client = redis.Redis.from_url(server.url)
    (entry_key,) = [k for k in client.keys("kvblend:kv:*") if engine.segment_id(DOC).encode() in k]
    client.set(entry_key, b"\x20" + b"\x00" * 7 + b"{not a header}" + os.urandom(64))
    client.close()


def _flush(server, engine: BlendEngine) -> None:
    import redis

    client = redis.Redis.from_url(server.url)
    client.flushall()
    client.close()


def _restart(server, engine: BlendEngine) -> None:
    server.kill()  # SIGKILL, no save: the restarted server is empty
    server.start()


REDIS_FAULTS = {"garbage-value": _garbage, "flushall": _flush, "restart": _restart}


@pytest.mark.parametrize("fault", sorted(REDIS_FAULTS))
def test_a_redis_fault_costs_one_rebuild_never_an_answer(
    redis_server, tmp_path: Path, fault: str
) -> None:
    writer = _redis_engine(tmp_path / "a", redis_server.url)
    writer.precompute([DOC])
    writer.store.wait_for_promotions()
    segments = writer.rag_segments("Where are the hives?", [DOC])
    expected = writer.prefill(segments, BlendConfig("reuse")).logits
    REDIS_FAULTS[fault](redis_server, writer)

    reader = _redis_engine(tmp_path / "b", redis_server.url)  # another machine: nothing local
    got = reader.prefill(segments, BlendConfig("reuse"))  # never raises
    assert torch.allclose(got.logits, expected, atol=1e-5, rtol=0)
    assert got.stats.segments_precomputed >= 1  # the document's entry was rebuilt
    if fault == "garbage-value":
        assert reader.store.stats().tiers["redis"].corrupt_dropped == 1
    reader.store.wait_for_promotions()

    third = _redis_engine(tmp_path / "c", redis_server.url)  # reuse is back on the server
    again = third.prefill(segments, BlendConfig("reuse"))
    assert again.stats.segments_precomputed == 0
    assert torch.allclose(again.logits, expected, atol=1e-5, rtol=0)


def test_a_full_redis_refuses_writes_and_answers_stay_right(make_redis_server, tmp_path) -> None:
    server = make_redis_server("--maxmemory", "1mb", "--maxmemory-policy", "noeviction")
    import redis

    client = redis.Redis.from_url(server.url)
    with pytest.raises(redis.exceptions.OutOfMemoryError):  # fill the server first
        for index in range(64):
            client.set(f"ballast:{index}", os.urandom(64 << 10))
    reference = BlendEngine(tiny_model("qwen2"), byte_tokenizer(), store=MemoryKVStore())
    segments = reference.rag_segments("Where are the hives?", [DOC])
    expected = reference.prefill(segments, BlendConfig("reuse")).logits
    engine = _redis_engine(tmp_path / "a", server.url)
    engine.precompute([DOC])
    got = engine.prefill(segments, BlendConfig("reuse"))
    assert torch.allclose(got.logits, expected, atol=1e-5, rtol=0)
    assert engine.store.stats().put_errors >= 1  # counted, not raised
    client.close()
