"""A damaged index, orphan files and an unusable folder never turn the disk tier off for good."""

from __future__ import annotations

import logging
import os
import pathlib
import shutil
import sqlite3
import time

import pytest
import torch

from kvblend.store import DiskKVStore, StoreError, default_store


def make_kv(seed=0, tokens=256) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {f"{kind}.0": torch.randn(2, tokens, 16, generator=generator).half() for kind in "kv"}


def value_files(folder: pathlib.Path) -> list[pathlib.Path]:
    return sorted(folder.glob("*/*/*.val"))


def fill(folder: pathlib.Path, count: int = 6) -> None:
    with DiskKVStore(folder) as store:
        for index in range(count):
            store.put(f"e{index}", make_kv(index, tokens=256 if index % 2 else 4))
        store.append_records("registry", [b"known document"])


def damage_index(folder: pathlib.Path, how: str) -> None:
    index = folder / "cache.db"
    if how == "truncated":
        with index.open("r+b") as file:
            file.truncate(index.stat().st_size // 2)
    else:
        index.write_bytes(os.urandom(8192))


@pytest.mark.parametrize("how", ["truncated", "garbage"])
def test_a_damaged_index_is_set_aside_and_rebuilt_on_open(tmp_path, caplog, how):
    folder = tmp_path / "kv"
    fill(folder)
    assert len(value_files(folder)) == 3
    damage_index(folder, how)
    with caplog.at_level(logging.WARNING, logger="kvblend.store"):
        store = DiskKVStore(folder)
    assert any("set aside" in record.getMessage() for record in caplog.records)
    assert (folder / "cache.db.damaged").exists()
    # rebuilt from the entry files' headers: the three entries kept as files are back (the
    # three small ones lived inside the damaged index as blobs)
    assert store.stats().entries == 3 and len(value_files(folder)) == 3
    for index in (1, 3, 5):
        assert torch.equal(store.get(f"e{index}")["k.0"], make_kv(index)["k.0"])
    store.put("a", make_kv())
    assert torch.equal(store.get("a")["v.0"], make_kv()["v.0"])
    assert store.read_records("registry")[0] == [b"known document"]  # a folder of its own
    store.close()


def test_a_damaged_record_log_index_is_rebuilt_too(tmp_path):
    folder = tmp_path / "kv"
    fill(folder)
    (folder / "records" / "records.db").write_bytes(os.urandom(8192))
    with DiskKVStore(folder) as store:
        assert store.contains("e0")
        assert store.read_records("registry") == ([], 0)
        store.append_records("registry", [b"again"])
        assert store.read_records("registry")[0] == [b"again"]


def test_an_index_damaged_while_open_heals_on_the_next_call(tmp_path):
    folder = tmp_path / "kv"
    store = DiskKVStore(folder)
    store.put("a", make_kv())
    store.close()  # another program damages the index between two uses
    damage_index(folder, "garbage")
    with pytest.raises(StoreError, match="not a database|malformed"):
        store.put("b", make_kv(1))  # the call that finds the damage
    store.put("c", make_kv(2))
    assert store.contains("c") and (folder / "cache.db.damaged").exists()
    assert torch.equal(store.get("c")["k.0"], make_kv(2)["k.0"])
    store.close()


def test_a_store_follows_an_index_another_process_rebuilt(tmp_path):
    folder = tmp_path / "kv"
    first = DiskKVStore(folder)
    first.put("a", make_kv())  # its connection stays open on the index file
    garbage = tmp_path / "garbage"
    garbage.write_bytes(os.urandom(8192))
    os.replace(garbage, folder / "cache.db")  # another program replaces the index file
    second = DiskKVStore(folder)  # sets the damaged index aside, starts a new one
    first.put("b", make_kv(1))
    assert second.contains("b")  # the write went to the index every process uses now
    first.close()
    second.close()


def test_a_store_folder_deleted_while_open_is_made_again(tmp_path):
    folder = tmp_path / "kv"
    store = DiskKVStore(folder)
    store.put("a", make_kv())
    shutil.rmtree(folder)  # an operator "clears the cache" under a running service
    assert not store.contains("a")
    store.put("b", make_kv(1))
    assert torch.equal(store.get("b")["v.0"], make_kv(1)["v.0"])
    assert (folder / "cache.db").exists()
    store.close()


def test_repair_collects_orphans_and_drops_rows_without_a_file(tmp_path):
    folder = tmp_path / "kv"
    fill(folder)
    store = DiskKVStore(folder)
    old, young = (folder / "ab" / "cd" / f"{digit * 28}.val" for digit in "01")
    old.parent.mkdir(parents=True)
    old.write_bytes(b"x" * 1000)
    young.write_bytes(b"y" * 10)  # may be an entry another process is writing: kept
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    (folder / "notes.txt").write_text("not the store's: left alone")
    with sqlite3.connect(folder / "cache.db") as connection:
        (victim,) = connection.execute("SELECT filename FROM Cache WHERE key = 'e1'").fetchone()
    (folder / victim).unlink()
    report = store.repair()
    assert (report.orphans_deleted, report.orphan_bytes, report.rows_dropped) == (1, 1000, 1)
    assert not report.index_set_aside
    assert not old.exists() and young.exists() and (folder / "notes.txt").exists()
    assert not store.contains("e1") and store.contains("e3") and report.entries == 5
    assert store.read_records("registry")[0] == [b"known document"]
    store.close()


def test_repair_sets_aside_an_index_damaged_inside(tmp_path):
    folder = tmp_path / "kv"
    fill(folder, count=40)
    store = DiskKVStore(folder)
    store.close()
    with (folder / "cache.db").open("r+b") as file:  # damage pages past the header
        file.seek(3 * 4096)
        file.write(os.urandom(4 * 4096))
    report = store.repair()
    assert report.index_set_aside and report.files_adopted == 20 and report.entries == 20
    assert len(value_files(folder)) == 20 and report.orphans_deleted == 0
    store.put("a", make_kv())
    assert store.contains("a")
    store.close()


def test_the_disk_tier_is_tried_again_after_the_back_off(tmp_path, caplog):
    blocker = tmp_path / "kv"
    blocker.write_text("a file where the store folder should be")
    store = default_store(blocker, disk_retry_s=0)
    assert store.disk is None
    store.put("a", make_kv())  # memory only for now
    blocker.unlink()  # the operator fixes the folder
    with caplog.at_level(logging.WARNING, logger="kvblend.store"):
        store.put("b", make_kv(1))
    assert store.disk is not None and store.disk.contains("b")
    assert any("available again" in record.getMessage() for record in caplog.records)
    store.close()


def test_the_disk_tier_is_not_tried_before_the_back_off(tmp_path):
    blocker = tmp_path / "kv"
    blocker.write_text("a file where the store folder should be")
    store = default_store(blocker, disk_retry_s=3600)
    blocker.unlink()
    store.put("a", make_kv())
    assert store.disk is None and store.contains("a")
    store.close()
