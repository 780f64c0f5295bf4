"""Disk store against its folder's readers and writers: private modes, confined file names,
crafted entries, and damage anywhere in an entry (always a `CorruptEntryError`, entry dropped).
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import sqlite3
import stat
import threading

import diskcache
import pytest
import torch

from kvblend.store import CorruptEntryError, DiskKVStore, MemoryKVStore, TieredKVStore
from kvblend.store.entry_format import CHECKSUM_ALGORITHM, _header_checksum, checksum

SHARED_ENV = "KVBLEND_STORE_SHARED"

LAYERS = 5  # tensors k.0 v.0 ... k.4 v.4: first, middle and last are distinct layers


def make_kv(layers=LAYERS, tokens=256, seed=0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        f"{kind}.{layer}": torch.randn(2, tokens, 16, generator=generator).half()
        for layer in range(layers)
        for kind in "kv"
    }


def mode_of(path: pathlib.Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def value_files(folder: pathlib.Path) -> list[pathlib.Path]:
    return sorted(folder.glob("*/*/*.val"))


@pytest.fixture
def umask_022():
    previous = os.umask(0o022)  # the usual default, under which files come out 0644
    yield
    os.umask(previous)


# --- private by default ----------------------------------------------------------------------


def test_store_folder_and_files_are_private_by_default(tmp_path, umask_022, monkeypatch):
    monkeypatch.delenv(SHARED_ENV, raising=False)
    folder = tmp_path / "kv"
    with DiskKVStore(folder) as store:
        store.put("big", make_kv())  # a file of its own
        store.put("small", make_kv(layers=1, tokens=4))  # a blob in the index
        store.append_records("registry", [b"record"])
        store.metadata("small")
        store.read_records("registry")
        # while open, SQLite keeps its -wal and -shm files next to each index
        sqlite_files = [*folder.rglob("cache.db*"), *folder.rglob("records.db*")]
        names = {str(p.relative_to(folder)) for p in sqlite_files}
        assert names >= {"cache.db", "cache.db-wal", "cache.db-shm", "records/records.db-wal"}
        assert all(mode_of(p) == 0o600 for p in sqlite_files), [
            (p.name, oct(mode_of(p))) for p in sqlite_files
        ]
    assert mode_of(folder) == 0o700 and mode_of(folder / "records") == 0o700
    files = value_files(folder)
    assert files
    for path in files:
        assert mode_of(path) == 0o600, path
        assert mode_of(path.parent) == 0o700 and mode_of(path.parent.parent) == 0o700, path


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_shared_store_gives_the_group_access(tmp_path, umask_022, monkeypatch, how):
    folder = tmp_path / "kv"
    if how == "environment":
        monkeypatch.setenv(SHARED_ENV, "1")
        store = DiskKVStore(folder)
    else:
        monkeypatch.delenv(SHARED_ENV, raising=False)
        store = DiskKVStore(folder, shared=True)
    with store:
        store.put("big", make_kv())
        assert mode_of(folder / "cache.db") == mode_of(folder / "cache.db-wal") == 0o660
    assert mode_of(folder) == 0o770 and mode_of(folder / "records") == 0o770
    assert value_files(folder)
    for path in value_files(folder):
        assert mode_of(path) == 0o660 and mode_of(path.parent) == 0o770, path


def test_an_unknown_shared_setting_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv(SHARED_ENV, "maybe")
    with pytest.raises(ValueError, match=SHARED_ENV):
        DiskKVStore(tmp_path / "kv")


def test_an_old_world_readable_store_folder_is_made_private(tmp_path, umask_022, monkeypatch):
    monkeypatch.delenv(SHARED_ENV, raising=False)
    folder = tmp_path / "kv"
    with diskcache.Cache(str(folder)) as old:  # what an older version left: 0755 / 0644
        old.set("x", b"1")
    assert mode_of(folder) == 0o755 and mode_of(folder / "cache.db") == 0o644
    DiskKVStore(folder).close()
    assert mode_of(folder) == 0o700 and mode_of(folder / "cache.db") == 0o600


def test_a_group_shared_store_folder_is_left_to_its_group_with_a_warning(
    tmp_path, umask_022, monkeypatch, caplog
):
    monkeypatch.delenv(SHARED_ENV, raising=False)
    folder = tmp_path / "kv"
    DiskKVStore(folder, shared=True).close()
    with caplog.at_level(logging.WARNING, logger="kvblend.store"):
        DiskKVStore(folder).close()  # a process that forgot KVBLEND_STORE_SHARED=1
    assert mode_of(folder) == 0o770
    assert any("open to other users" in r.getMessage() for r in caplog.records)


def test_a_readable_folder_that_is_no_store_is_left_alone_with_a_warning(
    tmp_path, umask_022, monkeypatch, caplog
):
    monkeypatch.delenv(SHARED_ENV, raising=False)
    folder = tmp_path / "documents"
    folder.mkdir(mode=0o755)
    (folder / "notes.txt").write_text("mine")
    with caplog.at_level(logging.WARNING, logger="kvblend.store"):
        DiskKVStore(folder).close()
    assert mode_of(folder) == 0o755
    assert any("open to other users" in r.getMessage() for r in caplog.records)


# --- file names in the index stay inside the folder -------------------------------------------


def point_row_at(folder: pathlib.Path, key: str, filename: str) -> None:
    with sqlite3.connect(folder / "cache.db") as connection:
        connection.execute("UPDATE Cache SET filename = ? WHERE key = ?", (filename, key))


@pytest.fixture
def victim(tmp_path) -> pathlib.Path:
    path = tmp_path / "victim.txt"
    path.write_text("a file outside the store folder")
    return path


@pytest.mark.parametrize("style", ["absolute", "dotdot"])
def test_an_index_row_naming_a_file_outside_the_folder_is_never_opened_or_deleted(
    tmp_path, victim, style
):
    folder = tmp_path / "kv"
    store = DiskKVStore(folder)
    store.put("a", make_kv())
    name = str(victim) if style == "absolute" else os.path.join("..", victim.name)
    point_row_at(folder, "a", name)
    assert store.get("a") is None  # treated as corrupt: dropped, counted
    assert store.stats().corrupt_dropped == 1 and not store.contains("a")
    assert victim.read_text() == "a file outside the store folder"
    store.close()


def test_eviction_and_clear_never_delete_outside_the_folder(tmp_path, victim):
    folder = tmp_path / "kv"
    entry_bytes = sum(tensor.nbytes for tensor in make_kv().values())
    store = DiskKVStore(folder, size_limit=3 * entry_bytes + (64 << 10))
    store.put("a", make_kv())
    point_row_at(folder, "a", str(victim))
    for index in range(6):  # "a" is the least recently used and gets evicted
        store.put(f"b{index}", make_kv(seed=index))
    assert not store.contains("a") and store.stats().evictions >= 4
    store.put("c", make_kv())
    point_row_at(folder, "c", str(victim))
    store.clear()
    assert victim.exists()
    store.close()


def test_a_value_file_reached_through_a_symbolic_link_is_refused(tmp_path):
    folder = tmp_path / "kv"
    store = DiskKVStore(folder)
    store.put("a", make_kv())
    (path,) = value_files(folder)
    outside = tmp_path / "outside"
    outside.mkdir()
    top = path.parent.parent
    top.rename(outside / top.name)
    top.symlink_to(outside / top.name)
    assert store.get("a") is None and not store.contains("a")
    assert (outside / top.name / path.parent.name / path.name).exists()
    store.close()


# --- crafted entries -------------------------------------------------------------------------


def crafted(
    key: str,
    tensors: list[tuple[str, str, list, list[int]]],
    data: bytes,
    algorithm: str = CHECKSUM_ALGORITHM,
) -> bytes:
    """A kvblend entry with valid checksums whose tensor table is whatever the test says."""
    listing = [
        [name, dtype, shape, checksum(data[b:e], algorithm)]
        for name, dtype, shape, (b, e) in tensors
    ]
    metadata = {
        "kvblend.format": "1",
        "kvblend.key": key,
        "kvblend.checksum": algorithm,
        "kvblend.tensors": json.dumps(listing),
    }
    metadata["kvblend.header_checksum"] = _header_checksum(metadata)
    header = {"__metadata__": metadata}
    for name, dtype, shape, offsets in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": offsets}
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + data


def plant(folder: pathlib.Path, key: str, data: bytes) -> None:
    """Write `data` under `key` the way another writer of the folder would (plain diskcache)."""
    with diskcache.Cache(str(folder)) as cache:
        cache.set(key, data)


def read_everything(store, key: str) -> None:
    """Open and read every tensor; a damaged entry must surface as CorruptEntryError only."""
    entry = store.get(key)
    if entry is None:
        return
    for name in entry:
        entry[name]


def nested_listing_entry(key: str) -> bytes:
    data = crafted(key, [("k.0", "U8", [4], [0, 4])], b"abcd")
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    metadata = header["__metadata__"]
    metadata["kvblend.tensors"] = "[" * 100_000 + "]" * 100_000  # RecursionError in json
    metadata["kvblend.header_checksum"] = _header_checksum(metadata)
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + b"abcd"


CRAFTED = {
    # json.loads of a deeply nested list raises RecursionError
    "recursion": nested_listing_entry,
    # a shape of 1e400 parses as float infinity: int() raises OverflowError
    "overflow": lambda key: crafted(key, [("k.0", "U8", [1e400], [0, 4])], b"abcd"),
    # negative sizes whose product is right: reshape raises RuntimeError on access
    "negative-shape": lambda key: crafted(key, [("k.0", "F16", [-2, -2], [0, 8])], bytes(8)),
    # a header that is not UTF-8: a ValueError (UnicodeDecodeError) from the JSON parser
    "not-utf8": lambda key: (7).to_bytes(8, "little") + b"{\xff\xfe}   " + b"abcd",
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_any_decoding_failure_is_a_corrupt_entry_and_the_entry_is_dropped(tmp_path, case):
    folder = tmp_path / "kv"
    store = DiskKVStore(folder)
    plant(folder, "a", CRAFTED[case]("a"))
    try:
        read_everything(store, "a")
    except CorruptEntryError:
        pass  # found while reading a tensor: the only error type allowed out
    assert store.stats().corrupt_dropped == 1
    assert not store.contains("a") and store.get("a") is None
    store.put("a", make_kv(layers=1))  # the next writer stores a good entry again
    read_everything(store, "a")
    store.close()


def test_tensors_pointing_at_the_same_bytes_are_rejected(tmp_path):
    folder = tmp_path / "kv"
    store = DiskKVStore(folder)
    size = 1 << 20
    data = bytes(range(256)) * (size // 256)
    tensors = [(f"k.{index}", "U8", [size], [0, size]) for index in range(40)]
    plant(folder, "a", crafted("a", tensors, data))
    assert store.get("a") is None  # 40 MiB of reads from a 1 MiB file would be accepted
    assert store.stats().corrupt_dropped == 1 and not store.contains("a")
    store.close()


def test_a_gap_between_tensors_is_rejected(tmp_path):
    folder = tmp_path / "kv"
    store = DiskKVStore(folder)
    tensors = [("k.0", "U8", [4], [0, 4]), ("v.0", "U8", [4], [8, 12])]
    plant(folder, "a", crafted("a", tensors, bytes(12)))
    assert store.get("a") is None and store.stats().corrupt_dropped == 1
    store.close()


# --- damage at the first, a middle and the last layer -----------------------------------------


def damage_tensor(folder: pathlib.Path, store: DiskKVStore, key: str, name: str) -> None:
    """Flip one byte in the middle of tensor `name`'s data, wherever the entry is kept."""
    entry = store.get(key)
    entry.close()
    with sqlite3.connect(folder / "cache.db") as connection:
        filename, blob = connection.execute(
            "SELECT filename, value FROM Cache WHERE key = ?", (key,)
        ).fetchone()
    data = bytearray((folder / filename).read_bytes() if filename else blob)
    header_size = int.from_bytes(data[:8], "little")
    begin, end = json.loads(data[8 : 8 + header_size])[name]["data_offsets"]
    data[8 + header_size + (begin + end) // 2] ^= 0x10
    if filename:
        (folder / filename).write_bytes(bytes(data))
    else:
        with sqlite3.connect(folder / "cache.db") as connection:
            connection.execute("UPDATE Cache SET value = ? WHERE key = ?", (bytes(data), key))


@pytest.mark.parametrize("where", ["file", "index-blob"])
@pytest.mark.parametrize("layer", [0, LAYERS // 2, LAYERS - 1])
@pytest.mark.parametrize("through", ["disk", "tiered"])
def test_damage_at_any_layer_raises_corrupt_entry_and_drops_it(tmp_path, where, layer, through):
    folder = tmp_path / "kv"
    disk = DiskKVStore(folder)
    kv = make_kv(tokens=256 if where == "file" else 4)
    disk.put("a", kv)
    assert bool(value_files(folder)) == (where == "file")
    damaged = f"v.{layer}"
    damage_tensor(folder, disk, "a", damaged)
    store = disk if through == "disk" else TieredKVStore(MemoryKVStore(), disk)
    entry = store.get("a")
    assert entry is not None  # the header is intact: damage shows when the tensor is read
    for name in kv:
        if name == damaged:
            with pytest.raises(CorruptEntryError, match="checksum"):
                entry[name]
        else:
            try:
                assert torch.equal(entry[name], kv[name])
            except CorruptEntryError:
                assert list(kv).index(name) > list(kv).index(damaged)  # dropped already
    assert disk.stats().corrupt_dropped == 1
    assert not store.contains("a") and store.get("a") is None  # the next call recomputes
    store.put("a", kv)
    fresh = store.get("a")
    assert all(torch.equal(fresh[name], kv[name]) for name in kv)
    store.close()


def test_a_fifo_in_place_of_a_value_file_is_dropped_without_blocking(tmp_path):
    folder = tmp_path / "kv"
    store = DiskKVStore(folder)
    store.put("a", make_kv())
    (path,) = value_files(folder)
    path.unlink()
    os.mkfifo(path)  # opening it for reading would wait for a writer forever
    outcome = []
    reader = threading.Thread(target=lambda: outcome.append(store.get("a")), daemon=True)
    reader.start()
    reader.join(timeout=60)
    if reader.is_alive():  # unblock the reader so that the failure is reported, not a hang
        with open(path, "wb"):
            pass
        reader.join()
        pytest.fail("get() blocked on a FIFO")
    assert outcome == [None] and store.stats().corrupt_dropped == 1
    assert not store.contains("a")
    store.close()


def test_entries_checksummed_with_crc32_are_still_read(tmp_path):
    folder = tmp_path / "kv"
    store = DiskKVStore(folder)
    data = torch.arange(6, dtype=torch.float32).numpy().tobytes()
    plant(folder, "old", crafted("old", [("x", "F32", [6], [0, 24])], data, "crc32"))
    entry = store.get("old")
    assert entry is not None and torch.equal(entry["x"], torch.arange(6, dtype=torch.float32))
    damaged = bytearray(crafted("bad", [("x", "F32", [6], [0, 24])], data, "crc32"))
    damaged[-1] ^= 1
    plant(folder, "bad", bytes(damaged))
    with pytest.raises(CorruptEntryError, match="checksum"):
        read_everything(store, "bad")
    store.close()


def test_an_unknown_checksum_algorithm_is_a_corrupt_entry(tmp_path):
    folder = tmp_path / "kv"
    store = DiskKVStore(folder)
    entry = crafted("odd", [("x", "U8", [4], [0, 4])], b"abcd", "crc32")
    plant(folder, "odd", entry.replace(b'"crc32"', b'"md5xx"'))
    assert store.get("odd") is None and store.stats().corrupt_dropped == 1
    store.close()
