"""Lazy per-tensor reads and background prefetch of store entries."""

from __future__ import annotations

import os
import random
import threading
from collections import Counter

import pytest
import torch

import kvblend.store.lazy as lazy_module
from kvblend.store import DiskKVStore, LazyTensors, MemoryKVStore, StoreError
from kvblend.store.base import layer_order


def make_kv(layers: int, tokens: int = 64) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(layers)
    return {
        f"{kind}.{layer}": torch.randn(2, tokens, 8, generator=generator)
        for layer in range(layers)
        for kind in "kv"
    }


@pytest.fixture
def reads(monkeypatch):
    """Record (tensor name, thread name) for every tensor the disk store reads."""
    log: list[tuple[str, str]] = []
    lock = threading.Lock()
    real_read = lazy_module.read_tensor

    def counting_read(payload, info, key, device=None, **options):
        with lock:
            log.append((info.name, threading.current_thread().name))
        return real_read(payload, info, key, device, **options)

    monkeypatch.setattr(lazy_module, "read_tensor", counting_read)
    return log


def test_layer_order_is_numeric_with_k_before_v():
    names = ["v.10", "k.2", "v.2", "k.10", "k.0", "v.0", "extra"]
    assert sorted(names, key=layer_order) == ["extra", "k.0", "v.0", "k.2", "v.2", "k.10", "v.10"]


def test_get_reads_nothing_until_a_tensor_is_accessed(tmp_path, reads):
    store = DiskKVStore(tmp_path / "kv", prefetch_ahead=0)
    tensors = make_kv(layers=6)
    store.put("a", tensors)
    entry = store.get("a")
    assert isinstance(entry, LazyTensors) and len(entry) == 12 and "k.5" in entry
    assert reads == [] and entry.loaded == frozenset()
    assert torch.equal(entry["k.3"], tensors["k.3"])
    assert [name for name, _ in reads] == ["k.3"] and entry.loaded == {"k.3"}
    assert entry["k.3"] is entry["k.3"]  # read once, then kept
    assert len(reads) == 1
    store.close()


def test_access_prefetches_the_next_layers_in_background(tmp_path, reads):
    store = DiskKVStore(tmp_path / "kv", prefetch_ahead=3)
    tensors = make_kv(layers=6)
    store.put("a", tensors)
    entry = store.get("a")
    entry["k.0"]
    entry.wait(timeout=10)
    by_name = dict(reads)
    assert set(by_name) == {"k.0", "v.0", "k.1", "v.1"}  # not the whole entry
    assert by_name["k.0"] == threading.current_thread().name
    assert all(by_name[name].startswith("kvblend-prefetch") for name in ("v.0", "k.1", "v.1"))
    assert entry.loaded == {"k.0", "v.0", "k.1", "v.1"}
    entry["k.1"]  # already there; schedules up to v.2
    entry.wait(timeout=10)
    assert entry.loaded == {"k.0", "v.0", "k.1", "v.1", "k.2", "v.2"}
    assert len(reads) == 6
    for name in ("v.0", "k.1", "v.1", "k.2", "v.2"):
        assert torch.equal(entry[name], tensors[name])
    store.close()


@pytest.mark.parametrize("store_kind", ["disk", "memory"])
def test_concurrent_out_of_order_access_reads_each_tensor_once(tmp_path, reads, store_kind):
    store = DiskKVStore(tmp_path / "kv") if store_kind == "disk" else MemoryKVStore()
    tensors = make_kv(layers=8)
    store.put("a", tensors)
    entry = store.get("a")
    failures: list[str] = []

    def reader(seed: int) -> None:
        names = list(tensors)
        random.Random(seed).shuffle(names)
        for name in names:
            if not torch.equal(entry[name], tensors[name]):
                failures.append(name)

    threads = [threading.Thread(target=reader, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert failures == []
    assert entry.loaded == set(tensors)
    if store_kind == "disk":
        assert Counter(name for name, _ in reads) == Counter(set(tensors))  # each exactly once
    store.close()


def test_prefetch_threads_are_bounded_and_stop_on_close(tmp_path):
    def prefetch_threads() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.startswith("kvblend-prefetch")}

    before = prefetch_threads()
    store = DiskKVStore(tmp_path / "kv", prefetch_ahead=4)
    tensors = make_kv(layers=4)
    for index in range(5):
        store.put(f"e{index}", tensors)
    for _ in range(6):
        entries = [store.get(f"e{index}") for index in range(5)]
        for entry in entries:
            entry["k.0"]
    assert len(prefetch_threads() - before) <= 2
    store.close()
    assert prefetch_threads() - before == set()
    entry = store.get("e0")  # a closed store still works; its pool restarts on demand
    assert torch.equal(entry["v.3"], tensors["v.3"])
    store.close()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_entries_release_their_file_when_read_or_dropped(tmp_path):
    def open_entry_files() -> int:
        count = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            count += target.startswith(str(tmp_path)) and target.endswith(".val")
        return count

    store = DiskKVStore(tmp_path / "kv", prefetch_ahead=2)
    tensors = make_kv(layers=2, tokens=2048)  # a file, not a SQLite blob
    store.put("a", tensors)
    for _ in range(10):
        entry = store.get("a")
        assert open_entry_files() == 1
        for name in entry:
            entry[name]
        assert open_entry_files() == 0  # closed once fully read
    opened = [store.get("a") for _ in range(5)]
    assert open_entry_files() == 5
    for entry in opened:
        entry.close()
    assert open_entry_files() == 0
    with pytest.raises(StoreError, match="closed"):
        opened[0]["k.0"]
    store.get("a")  # dropped unread: closed when collected
    assert open_entry_files() == 0
    store.close()


def test_memory_store_entries_are_lazy_copies(reads):
    store = MemoryKVStore(prefetch_ahead=0)
    tensors = make_kv(layers=3)
    store.put("a", tensors)
    entry = store.get("a", device="meta")
    assert entry.loaded == frozenset()
    assert entry["v.2"].device.type == "meta" and entry.loaded == {"v.2"}
    store.close()
