"""`kvblend store stats|clear|repair`: real folders, one clear line and exit status 2 on errors."""

from __future__ import annotations

import os
import pathlib
import time

import pytest
import torch

from kvblend.cli.main import main
from kvblend.store import DiskKVStore


def make_kv(seed=0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {f"{kind}.0": torch.randn(2, 256, 16, generator=generator).half() for kind in "kv"}


@pytest.fixture
def folder(tmp_path) -> pathlib.Path:
    path = tmp_path / "kv"
    with DiskKVStore(path) as store:
        store.put("a", make_kv())
        store.put("b", make_kv(1))
    return path


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["store", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_error(err: str, message: str) -> None:
    assert "Traceback" not in err
    assert err.startswith("kvblend: error: ") and message in err
    assert err.strip().count("\n") == 0, err


def test_stats_shows_the_folder_without_a_per_process_hit_rate(folder, capsys):
    code, out, _ = run(capsys, "stats", "--store-dir", str(folder))
    assert code == 0
    assert "entries: 2" in out and "private to the owner" in out
    assert "hit rate" not in out  # a fresh process has no lookups: it would always say 0%


@pytest.mark.parametrize("action", ["stats", "clear", "repair"])
def test_a_damaged_index_is_rebuilt_instead_of_a_traceback(folder, capsys, action):
    (folder / "cache.db").write_bytes(os.urandom(8192))
    code, out, err = run(capsys, action, "--store-dir", str(folder))
    assert code == 0 and "Traceback" not in err
    assert (folder / "cache.db.damaged").exists()
    if action == "stats":
        assert "entries: 2" in out and "cache.db.damaged" in out  # rebuilt, not wiped
    elif action == "repair":
        assert "index: set aside as cache.db.damaged and rebuilt" in out
    with DiskKVStore(folder) as store:
        store.put("c", make_kv(2))
        assert store.contains("c")


def test_repair_reports_what_it_fixed(folder, capsys):
    orphan = folder / "ab" / "cd" / ("0" * 28 + ".val")
    orphan.parent.mkdir(parents=True)
    orphan.write_bytes(b"x" * 500)
    os.utime(orphan, (time.time() - 3600, time.time() - 3600))
    code, out, _ = run(capsys, "repair", "--store-dir", str(folder))
    assert code == 0
    assert (
        "index: ok" in out
        and "unusable files deleted (partial, damaged or duplicate): 1 (500 bytes)" in out
    )
    assert "entry files taken back into the index: 0" in out
    assert "entries: 2" in out and not orphan.exists()


def test_repair_takes_back_a_whole_entry_no_row_names(folder, capsys):
    import sqlite3

    with sqlite3.connect(folder / "cache.db") as db:  # a writer killed before its row
        (filename,) = db.execute("SELECT filename FROM Cache WHERE key = 'b'").fetchone()
        db.execute("DELETE FROM Cache WHERE key = 'b'")
    db.close()
    entry = folder / filename
    os.utime(entry, (time.time() - 3600, time.time() - 3600))
    code, out, _ = run(capsys, "repair", "--store-dir", str(folder))
    assert code == 0 and entry.exists()
    assert "entry files taken back into the index: 1" in out
    assert "unusable files deleted (partial, damaged or duplicate): 0 (0 bytes)" in out
    with DiskKVStore(folder) as store:
        assert torch.equal(store.get("b")["k.0"], make_kv(1)["k.0"])


def test_clear_empties_the_folder(folder, capsys):
    code, out, _ = run(capsys, "clear", "--store-dir", str(folder))
    assert code == 0 and "cleared 2 entries" in out
    with DiskKVStore(folder) as store:
        assert store.stats().entries == 0


def test_clearing_a_missing_folder_has_nothing_to_do(tmp_path, capsys):
    code, out, _ = run(capsys, "clear", "--store-dir", str(tmp_path / "none"))
    assert code == 0 and "nothing to clear" in out
    assert not (tmp_path / "none").exists()


@pytest.mark.parametrize("action", ["stats", "repair"])
def test_a_missing_folder_is_one_line(tmp_path, capsys, action):
    code, _, err = run(capsys, action, "--store-dir", str(tmp_path / "none"))
    assert code == 2
    assert_one_line_error(err, "no KV store at")
    assert not (tmp_path / "none").exists()


def test_a_file_instead_of_a_folder_is_one_line(tmp_path, capsys):
    path = tmp_path / "file"
    path.write_text("x")
    code, _, err = run(capsys, "stats", "--store-dir", str(path))
    assert code == 2
    assert_one_line_error(err, "is not a folder")


def test_a_folder_that_is_no_store_is_refused_and_left_alone(tmp_path, capsys):
    documents = tmp_path / "documents"
    documents.mkdir()
    (documents / "notes.txt").write_text("mine")
    for action in ("stats", "clear", "repair"):
        code, _, err = run(capsys, action, "--store-dir", str(documents))
        assert code == 2
        assert_one_line_error(err, "is not a KV store folder")
    assert sorted(p.name for p in documents.iterdir()) == ["notes.txt"]


def test_an_unusable_folder_is_one_line(folder, capsys):
    (folder / "cache.db").unlink()
    (folder / "cache.db").mkdir()  # SQLite cannot open its index
    code, _, err = run(capsys, "stats", "--store-dir", str(folder))
    assert code == 2
    assert_one_line_error(err, str(folder))


def test_a_bad_sharing_setting_is_one_line(folder, capsys, monkeypatch):
    monkeypatch.setenv("KVBLEND_STORE_SHARED", "perhaps")
    code, _, err = run(capsys, "stats", "--store-dir", str(folder))
    assert code == 2
    assert_one_line_error(err, "KVBLEND_STORE_SHARED")


def test_repair_reads_every_indexed_entry_and_deletes_a_truncated_one(folder, capsys):
    import sqlite3

    with sqlite3.connect(folder / "cache.db") as db:
        (filename,) = db.execute("SELECT filename FROM Cache WHERE key = 'a'").fetchone()
    db.close()
    entry = folder / filename
    size = entry.stat().st_size
    with open(entry, "r+b") as handle:  # indexed, then cut short: repair used to call it sound
        handle.truncate(1000)
    code, out, _ = run(capsys, "repair", "--store-dir", str(folder))
    assert code == 0
    assert (
        "indexed entries read whole (size, header, checksums): 2; damaged ones deleted: 1 "
        f"({size:,} bytes)" in out
    )
    assert "entries: 1," in out and not entry.exists()
    with DiskKVStore(folder) as store:
        assert store.get("a") is None and store.stats().corrupt_dropped == 0  # already gone
        assert torch.equal(store.get("b")["k.0"], make_kv(1)["k.0"])
    code, out, _ = run(capsys, "repair", "--store-dir", str(folder))  # nothing left to fix
    assert "read whole (size, header, checksums): 1; damaged ones deleted: 0" in out


def test_clear_other_keys_keeps_only_the_entries_of_this_key(tmp_path, capsys, monkeypatch):
    mine, theirs = "a" * 64, "b" * 64
    path = tmp_path / "kv"
    for name, key in (("mine", mine), ("theirs", theirs), ("unsigned", "")):
        with DiskKVStore(path, store_key=key) as store:
            store.put(name, make_kv())
    code, _, err = run(capsys, "clear", "--other-keys", "--store-dir", str(path))
    assert code == 2
    assert_one_line_error(err, "no store key: set $KVBLEND_STORE_KEY")
    monkeypatch.setenv("KVBLEND_STORE_KEY", theirs)
    code, out, _ = run(capsys, "repair", "--store-dir", str(path))
    assert "entries of another store key (or none), kept: 2" in out
    monkeypatch.setenv("KVBLEND_STORE_KEY", mine)
    code, out, _ = run(capsys, "clear", "--other-keys", "--store-dir", str(path))
    assert code == 0 and "cleared 2 entries of another store key (or none)" in out
    with DiskKVStore(path, store_key=mine) as store:
        assert store.keys() == ["mine"] and store.get("mine") is not None
