"""Copies of stored KV onto the compute device (`kvblend.store.transfer`).

On the CPU a copy is the plain ``tensor.to(...)`` it always was; on CUDA it is issued on a side
stream from pinned memory, and what the stores hand out must still equal what was put.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvblend.store import DiskKVStore, MemoryKVStore, TieredKVStore
from kvblend.store.transfer import HostToDevice, PendingCopy

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def entry(layers: int = 3) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(layers):
        for name in ("k", "v"):
            tensors[f"{name}.{layer}"] = torch.randn(2, 37, 16, generator=generator)
    return tensors


def test_cpu_copy_is_a_plain_copy() -> None:
    copier = HostToDevice()
    source = torch.arange(12.0).reshape(3, 4)
    copied = copier.copy(source, torch.device("cpu"))
    assert type(copied) is torch.Tensor
    assert torch.equal(copied, source) and copied.data_ptr() != source.data_ptr()
    same = copier.copy(source, torch.device("cpu"), copy=False)
    assert same is source
    kept_here = copier.copy(source, None)
    assert isinstance(kept_here, torch.Tensor) and kept_here.data_ptr() != source.data_ptr()
    assert not copier._streams  # no CUDA stream is ever made for CPU copies


def test_cpu_stores_hand_out_equal_tensors_read_in_place(tmp_path: Path) -> None:
    tensors = entry()
    memory = MemoryKVStore()
    tiered = TieredKVStore(MemoryKVStore(), DiskKVStore(tmp_path / "disk"))
    for store in (memory, tiered):
        store.put("a" * 64, tensors)
    tiered.memory.clear()  # read from the disk tier
    for store in (memory, tiered):
        got = store.get("a" * 64, device="cpu")
        assert got is not None
        for name, tensor in tensors.items():
            assert type(got[name]) is torch.Tensor and got[name].device.type == "cpu"
            assert torch.equal(got[name], tensor)
        again = store.get("a" * 64)
        assert again is not None and all(torch.equal(again[n], t) for n, t in tensors.items())
    for name in tensors:  # the memory tier hands out what it holds: no copy per read
        assert memory.get("a" * 64)[name].data_ptr() == memory.get("a" * 64)[name].data_ptr()
    tiered.close()


@needs_cuda
def test_cuda_copy_runs_on_a_side_stream_and_waits_for_it() -> None:
    copier = HostToDevice()
    source = torch.randn(64, 1024)
    pending = copier.copy(source, torch.device("cuda"))
    assert isinstance(pending, PendingCopy)
    tensor = pending.ready()
    assert tensor.device.type == "cuda"
    assert torch.equal((tensor * 2).cpu(), source * 2)  # read on the current stream
    assert len(copier._streams) == 1


@needs_cuda
def test_rows_loaded_onto_cuda_equal_the_source(tmp_path: Path) -> None:
    tensors = entry(layers=8)
    memory = MemoryKVStore()
    disk = DiskKVStore(tmp_path / "disk")
    tiered = TieredKVStore(MemoryKVStore(), DiskKVStore(tmp_path / "tiered"))
    stores = (memory, disk, tiered)
    for store in stores:
        store.put("b" * 64, tensors)
    tiered.memory.clear()
    for store in stores:
        got = store.get("b" * 64, device="cuda")
        assert got is not None
        for name in sorted(tensors):  # layer order, as the blend loop reads them
            assert got[name].device.type == "cuda"
            assert torch.equal(got[name].cpu(), tensors[name]), f"{type(store).__name__} {name}"
    disk.close()
    tiered.close()
