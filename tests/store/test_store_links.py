"""Fault injection, hard links: a store file that is also a file elsewhere is never written.

``ln /elsewhere/victim.db STORE/cache.db`` makes the index the very file outside the folder
(one inode, two names), so opening the store would change the victim's mode (``0644`` ->
``0600``) and let SQLite write into it. Any regular file of the folder that the store writes or
chmods (the index and SQLite's files next to it, the record log, the sweep stamp) with more than
one name is refused as a symbolic link is: the index makes `DiskKVStore` raise `StoreError`
(the default store then works from memory, answers right), the record log is kept in memory,
the sweep is skipped. The victim keeps its mode, content and modification time.
"""

from __future__ import annotations

import os
import sqlite3
import stat
from pathlib import Path

import pytest
import torch

from conftest import byte_tokenizer, tiny_model
from kvblend import BlendConfig, BlendEngine
from kvblend.store import DiskKVStore, MemoryKVStore, StoreError, default_store

DOC = "Ines Varga repairs clocks in a workshop under the old bridge every afternoon. "
PROMPT = f"Context: {DOC}\nQuestion: what does Ines repair?"


@pytest.fixture(scope="module")
def expected() -> torch.Tensor:
    engine = BlendEngine(tiny_model("qwen2"), byte_tokenizer(), store=MemoryKVStore())
    engine.precompute([DOC])
    return engine.prefill(PROMPT, BlendConfig("reuse")).logits


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A SQLite database outside the store folder, ``0644`` as SQLite makes them."""
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    path = folder / "victim.db"
    with sqlite3.connect(path) as connection:
        connection.execute("CREATE TABLE mine (x)")
        connection.execute("INSERT INTO mine VALUES ('precious')")
    connection.close()
    path.chmod(0o644)
    old = 1_600_000_000
    os.utime(path, (old, old))
    return path


def _state(path: Path) -> tuple[int, int, bytes, int]:
    info = path.stat()
    return stat.S_IMODE(info.st_mode), info.st_mtime_ns, path.read_bytes(), info.st_nlink


@pytest.mark.parametrize("folder_mode", [0o700, 0o755], ids=["private", "old-0755"])
def test_a_hard_linked_index_is_refused_and_the_victim_untouched(
    tmp_path: Path, victim: Path, expected: torch.Tensor, folder_mode: int, caplog
) -> None:
    folder = tmp_path / "kv"
    folder.mkdir(mode=folder_mode)
    folder.chmod(folder_mode)
    os.link(victim, folder / "cache.db")
    before = _state(victim)
    with pytest.raises(StoreError, match="hard link"):
        DiskKVStore(folder)
    store = default_store(folder)  # works from memory, says why
    assert store.disk is None
    assert any("hard link" in record.getMessage() for record in caplog.records)
    engine = BlendEngine(tiny_model("qwen2"), byte_tokenizer(), store=store)
    engine.precompute([DOC])
    got = engine.prefill(PROMPT, BlendConfig("reuse"))
    assert got.stats.documents_reused == 1 and got.stats.segments_precomputed == 0
    assert torch.allclose(got.logits, expected, atol=1e-5, rtol=0)
    assert store.stats().put_errors == 0 and store.stats().corrupt_dropped == 0
    store.close()
    assert _state(victim) == before  # mode 0644, content and time unchanged


@pytest.mark.parametrize("name", ["cache.db-wal", "cache.db-shm", "cache.db-journal"])
def test_a_hard_linked_sqlite_file_is_refused(tmp_path: Path, victim: Path, name: str) -> None:
    folder = tmp_path / "kv"
    DiskKVStore(folder).close()
    for leftover in folder.glob("cache.db-*"):
        leftover.unlink()
    os.link(victim, folder / name)
    before = _state(victim)
    with pytest.raises(StoreError, match="hard link"):
        DiskKVStore(folder)
    assert _state(victim) == before


def test_a_hard_linked_record_log_is_kept_in_memory(
    tmp_path: Path, victim: Path, expected: torch.Tensor, caplog
) -> None:
    folder = tmp_path / "kv"
    (folder / "records").mkdir(parents=True, mode=0o700)
    os.link(victim, folder / "records" / "records.db")
    before = _state(victim)
    store = DiskKVStore(folder)  # the entries are on disk, the log in memory
    assert any(
        "records.db" in r.getMessage() and "hard link" in r.getMessage() for r in caplog.records
    )
    engine = BlendEngine(tiny_model("qwen2"), byte_tokenizer(), store=store)
    engine.precompute([DOC])
    store.close()
    fresh = BlendEngine(tiny_model("qwen2"), byte_tokenizer(), store=DiskKVStore(folder))
    got = fresh.prefill(PROMPT, BlendConfig("reuse"))  # found from the entries' metadata
    assert got.stats.documents_reused == 1 and got.stats.segments_precomputed == 0
    assert torch.allclose(got.logits, expected, atol=1e-5, rtol=0)
    fresh.store.close()
    assert _state(victim) == before


def test_a_hard_linked_sweep_stamp_is_never_touched(tmp_path: Path, victim: Path, caplog) -> None:
    from kvblend.store.disk.rebuild import SWEEP_STAMP

    folder = tmp_path / "kv"
    with DiskKVStore(folder) as store:
        store.put("a", {"kv": torch.randn(2, 2, 1, 512, 16)})
    (folder / SWEEP_STAMP).unlink()
    os.link(victim, folder / SWEEP_STAMP)  # due: the stamp is 2020's
    before = _state(victim)
    with DiskKVStore(folder) as store:
        assert store.contains("a")
    assert any("not sweeping" in record.getMessage() for record in caplog.records)
    assert _state(victim) == before
