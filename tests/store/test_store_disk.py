"""Disk store robustness: corrupted entries, foreign values, full or read-only disks, processes."""

from __future__ import annotations

import errno
import logging
import multiprocessing
import pathlib
import sqlite3
import time

import diskcache
import pytest
import torch

import kvblend.store.files as files_module
from kvblend.store import (
    CorruptEntryError,
    DiskKVStore,
    MemoryKVStore,
    StoreError,
    TieredKVStore,
    default_store,
)


def make_kv(layers=2, tokens=256, seed=0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        f"{kind}.{layer}": torch.randn(2, tokens, 16, generator=generator).half()
        for layer in range(layers)
        for kind in "kv"
    }


def read_all(entry) -> None:
    for name in entry:
        entry[name]


def entry_file(store: DiskKVStore, key: str) -> pathlib.Path:
    handle = store._cache.get(key, read=True)  # test-only peek at where diskcache put it
    handle.close()
    return pathlib.Path(handle.name)


@pytest.fixture
def store(tmp_path):
    disk = DiskKVStore(tmp_path / "kv")
    yield disk
    disk.close()


def assert_dropped(store: DiskKVStore, key: str, count: int = 1) -> None:
    assert store.stats().corrupt_dropped == count
    assert not store.contains(key)
    assert store.get(key) is None


def test_flipped_tensor_byte_raises_on_access_and_drops_entry(store):
    store.put("a", make_kv())
    path = entry_file(store, "a")
    data = bytearray(path.read_bytes())
    data[-10] ^= 0x01  # inside the last tensor (v.1)
    path.write_bytes(bytes(data))
    entry = store.get("a")
    assert entry is not None  # the header is intact; tensors are verified as read
    assert torch.equal(entry["k.0"], make_kv()["k.0"])
    with pytest.raises(CorruptEntryError, match="checksum") as info:
        entry["v.1"]
    assert info.value.key == "a"
    with pytest.raises(CorruptEntryError):
        entry["v.1"]  # the error stays with that tensor
    assert_dropped(store, "a")


def test_corruption_found_by_prefetch_surfaces_on_access(tmp_path):
    store = DiskKVStore(tmp_path / "kv", prefetch_ahead=3)
    store.put("a", make_kv())
    path = entry_file(store, "a")
    data = bytearray(path.read_bytes())
    data[-10] ^= 0x80
    path.write_bytes(bytes(data))
    entry = store.get("a")
    entry["k.1"]  # schedules v.1 in the background, which finds the damage
    entry.wait()
    assert store.stats().corrupt_dropped == 1 and not store.contains("a")
    with pytest.raises(CorruptEntryError):
        entry["v.1"]
    store.close()


@pytest.mark.parametrize("fraction", [0.0005, 0.01, 0.2, 0.5, 0.9, 0.999])
def test_any_flipped_byte_is_detected(store, fraction):
    store.put("a", make_kv())
    path = entry_file(store, "a")
    data = bytearray(path.read_bytes())
    data[int(len(data) * fraction)] ^= 0x10
    path.write_bytes(bytes(data))
    entry = store.get("a")
    if entry is not None:
        with pytest.raises(CorruptEntryError):
            read_all(entry)
    assert_dropped(store, "a")


@pytest.mark.parametrize("keep", [4, 100, -1, -2000])
def test_truncated_file_is_a_miss(store, keep):
    store.put("a", make_kv())
    path = entry_file(store, "a")
    data = path.read_bytes()
    path.write_bytes(data[:keep])
    assert store.metadata("a") is None
    assert_dropped(store, "a")


def test_trailing_bytes_are_detected(store):
    store.put("a", make_kv())
    path = entry_file(store, "a")
    path.write_bytes(path.read_bytes() + b"\0" * 16)
    assert store.get("a") is None
    assert_dropped(store, "a")


def test_another_entrys_bytes_under_a_key_are_detected(store):
    store.put("a", make_kv(seed=1))
    store.put("b", make_kv(seed=2))
    entry_file(store, "a").write_bytes(entry_file(store, "b").read_bytes())
    assert store.get("a") is None
    assert_dropped(store, "a")
    read_all(store.get("b"))  # the other entry is untouched
    assert store.stats().corrupt_dropped == 1


def test_corrupt_small_entry_kept_in_sqlite_is_detected(store, tmp_path):
    small = {"k.0": torch.arange(8, dtype=torch.float32)}
    store.put("s", small)
    assert not list((tmp_path / "kv").rglob("*.val"))  # under 32 KiB: a SQLite blob
    with sqlite3.connect(tmp_path / "kv" / "cache.db") as connection:
        (blob,) = connection.execute("SELECT value FROM Cache WHERE key = 's'").fetchone()
        damaged = bytearray(blob)
        damaged[-3] ^= 0xFF
        connection.execute("UPDATE Cache SET value = ? WHERE key = 's'", (bytes(damaged),))
    entry = store.get("s")
    with pytest.raises(CorruptEntryError):
        entry["k.0"]
    assert_dropped(store, "s")


def _mark_unpickled(path: str) -> str:
    pathlib.Path(path).write_text("unpickled")
    return "payload"


class _Booby:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return _mark_unpickled, (self.marker,)


@pytest.mark.parametrize("value_kind", ["pickled", "text", "number"])
def test_foreign_values_are_never_unpickled(store, tmp_path, value_kind):
    marker = tmp_path / "unpickled"
    value = {"pickled": _Booby(str(marker)), "text": "x" * 50_000, "number": 7}[value_kind]
    with diskcache.Cache(str(tmp_path / "kv")) as foreign:  # plain diskcache, same folder
        foreign.set("a", value)
    assert store.get("a") is None
    assert not marker.exists()
    assert_dropped(store, "a")


def test_the_store_serializer_refuses_to_pickle(tmp_path):
    disk = files_module.BytesOnlyDisk(str(tmp_path))
    with pytest.raises(TypeError, match="only stores bytes"):
        disk.store({"a": 1}, read=False)
    with pytest.raises(TypeError, match="str keys"):
        disk.put(("tuple", "key"))


def test_a_folder_that_cannot_be_created_gives_a_clear_store_error(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a regular file")
    with pytest.raises(StoreError, match="not-a-folder"):
        DiskKVStore(blocker / "kv")


def test_default_store_falls_back_to_memory_with_one_warning(tmp_path, caplog):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a regular file")
    with caplog.at_level(logging.WARNING, logger="kvblend.store"):
        store = default_store(blocker / "kv")
    assert store.disk is None
    assert [r for r in caplog.records if r.levelno == logging.WARNING]
    store.put("a", make_kv())
    read_all(store.get("a"))
    assert store.stats().hits == 1


def _fail_file_write(directory, filename, data, modes):
    raise OSError(errno.ENOSPC, "No space left on device", filename)


def _fail_sqlite_set(self, *args, **kwargs):
    raise sqlite3.OperationalError("database or disk is full")


@pytest.mark.parametrize("failure", ["file", "sqlite"])
def test_full_disk_gives_store_error_and_tiered_keeps_working(
    tmp_path, monkeypatch, caplog, failure
):
    if failure == "file":
        monkeypatch.setattr(files_module, "write_value_file", _fail_file_write)
    else:
        monkeypatch.setattr(diskcache.Cache, "set", _fail_sqlite_set)
    disk = DiskKVStore(tmp_path / "kv")
    with pytest.raises(StoreError, match=r"write entry 'a'.*(No space|disk is full)") as info:
        disk.put("a", make_kv())
    assert str(tmp_path / "kv") in str(info.value)

    tiered = TieredKVStore(MemoryKVStore(), disk)
    with caplog.at_level(logging.WARNING, logger="kvblend.store"):
        tiered.put("a", make_kv(seed=1))
        tiered.put("b", make_kv(seed=2))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "disk tier write failed" in warnings[0].getMessage()
    assert tiered.stats().put_errors == 2
    entry = tiered.get("b")
    assert torch.equal(entry["v.1"], make_kv(seed=2)["v.1"])
    assert not disk.contains("b")
    tiered.close()


def test_failed_file_write_leaves_no_partial_file(tmp_path):
    name = "ab/cd/" + "0" * 28 + ".val"
    target = tmp_path / name
    with pytest.raises(TypeError):  # fails after the file is opened
        files_module.write_value_file(str(tmp_path), name, "not bytes", files_module.PRIVATE)
    assert target.parent.is_dir() and not target.exists()


def _share_worker(directory: str, worker: int, count: int) -> int:
    """Write own entries and shared ones, read the other worker's; return entries verified."""
    store = DiskKVStore(directory)
    other = 1 - worker
    gate = pathlib.Path(directory).parent
    (gate / f"ready-{worker}").touch()
    deadline = time.monotonic() + 60
    while not (gate / f"ready-{other}").exists() and time.monotonic() < deadline:
        time.sleep(0.01)  # start writing together so the two processes really overlap
    verified = 0
    for index in range(count):
        store.put(f"w{worker}-{index}", make_kv(seed=100 * worker + index))
        store.put(f"shared-{index % 4}", make_kv(seed=999 + index % 4))
        entry = store.get(f"w{other}-{index // 2}")
        if entry is not None:
            expected = make_kv(seed=100 * other + index // 2)
            assert all(torch.equal(entry[name], expected[name]) for name in expected)
            verified += 1
    assert store.stats().corrupt_dropped == 0
    store.close()
    return verified


@pytest.mark.slow  # two processes that import torch
def test_two_processes_share_one_folder_without_losing_entries(tmp_path):
    directory = str(tmp_path / "kv")
    DiskKVStore(directory).close()  # create the folder and database once
    count = 20
    context = multiprocessing.get_context("spawn")
    with context.Pool(2) as pool:
        results = pool.starmap(_share_worker, [(directory, 0, count), (directory, 1, count)])
    del results  # each worker checked every entry it read back; a failure re-raises in starmap
    store = DiskKVStore(directory)
    for worker in (0, 1):
        for index in range(count):
            entry = store.get(f"w{worker}-{index}")
            assert entry is not None, (worker, index)
            expected = make_kv(seed=100 * worker + index)
            assert all(torch.equal(entry[name], expected[name]) for name in expected)
    for index in range(4):
        read_all(store.get(f"shared-{index}"))
    stats = store.stats()
    assert stats.entries == 2 * count + 4 and stats.corrupt_dropped == 0
    store.close()
