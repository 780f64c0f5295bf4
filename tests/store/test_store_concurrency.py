"""Four real processes writing one store folder at once lose no write and see no put error.

Each worker keeps some entries and writes-then-deletes others. The churned entries' files all go
to one sub-folder (`ab/cd`), so that sub-folder is emptied and removed over and over while the
other workers create it and open new files in it: the race in which a write used to fail with
ENOENT. The file names stay diskcache's own random ones; only their sub-folder is chosen.
"""

from __future__ import annotations

import multiprocessing
import os
import pathlib
import time

import diskcache
import pytest
import torch

from kvblend.store import DiskKVStore, StoreError

WORKERS = 4
PUTS = 400  # per worker: a quarter kept, the rest written, read back and deleted


def make_kv(worker: int, index: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * worker + index)
    return {name: torch.randn(2, 272, 16, generator=generator).half() for name in ("k.0", "v.0")}


def _churn_in_one_sub_folder(self, key=diskcache.UNKNOWN, value=diskcache.UNKNOWN):
    filename, full_path = original_filename(self, key, value)
    if isinstance(key, str) and key.startswith("churn"):
        parts = filename.split(os.sep)
        filename = os.path.join("00", "00", parts[-1])
        full_path = os.path.join(self._directory, filename)
    return filename, full_path


original_filename = diskcache.Disk.filename


def _worker(directory: str, worker: int) -> tuple[int, int, list[str]]:
    """Return (puts that raised, churned entries not read back intact, kept keys)."""
    diskcache.Disk.filename = _churn_in_one_sub_folder
    store = DiskKVStore(directory)
    gate = pathlib.Path(directory).parent
    (gate / f"ready-{worker}").touch()
    deadline = time.monotonic() + 120
    while len(list(gate.glob("ready-*"))) < WORKERS and time.monotonic() < deadline:
        time.sleep(0.01)  # start together so that the writers really overlap
    failed_puts = unread = 0
    kept = []
    for index in range(PUTS):
        key = f"{'keep' if index % 4 == 0 else 'churn'}-{worker}-{index}"
        kv = make_kv(worker, index)
        try:
            store.put(key, kv)
        except StoreError:
            failed_puts += 1
            continue
        if key.startswith("keep"):
            kept.append(key)
            continue
        entry = store.get(key)
        if entry is None or not all(torch.equal(entry[n], kv[n]) for n in kv):
            unread += 1
        if entry is not None:
            entry.close()
        store.delete(key)
    store.close()
    return failed_puts, unread, kept


@pytest.mark.slow  # four processes
def test_four_processes_writing_one_folder_lose_no_write(tmp_path):
    directory = str(tmp_path / "kv")
    DiskKVStore(directory).close()
    context = multiprocessing.get_context("spawn")
    with context.Pool(WORKERS) as pool:
        results = pool.starmap(_worker, [(directory, worker) for worker in range(WORKERS)])
    assert [failed for failed, _, _ in results] == [0] * WORKERS
    assert [unread for _, unread, _ in results] == [0] * WORKERS
    store = DiskKVStore(directory)
    kept = [key for _, _, keys in results for key in keys]
    assert len(kept) == WORKERS * PUTS // 4
    for key in kept:
        worker, index = (int(part) for part in key.split("-")[1:])
        expected = make_kv(worker, index)
        entry = store.get(key)
        assert entry is not None, key
        assert all(torch.equal(entry[name], expected[name]) for name in expected), key
    stats = store.stats()
    assert stats.entries == len(kept) and stats.corrupt_dropped == 0
    store.close()


def test_a_sub_folder_removed_before_its_file_is_opened_is_made_again(tmp_path, monkeypatch):
    """The race above, made certain: another process removes the emptied sub-folder right after
    this one created it, three times in a row; the write still succeeds."""
    folder = tmp_path / "kv"
    store = DiskKVStore(folder)
    real_mkdir = os.mkdir
    removed = []

    def mkdir_then_lose_it(path, *args, **kwargs):
        real_mkdir(path, *args, **kwargs)
        leaf = pathlib.Path(path)
        if leaf.parent.parent == folder and len(removed) < 3:
            leaf.rmdir()  # what the other process's delete of its last file there does
            removed.append(leaf.name)

    monkeypatch.setattr(os, "mkdir", mkdir_then_lose_it)
    store.put("a", make_kv(0, 0))
    monkeypatch.undo()
    assert len(removed) == 3
    entry = store.get("a")
    assert all(torch.equal(entry[name], make_kv(0, 0)[name]) for name in entry)
    store.close()
