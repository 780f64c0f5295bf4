"""Store contract: round trips, metadata, keys, LRU limits, stats, tiers, defaults."""

from __future__ import annotations

import ast
import pathlib

import pytest
import safetensors
import torch

import kvblend.store as store_pkg
from kvblend.store import (
    DiskKVStore,
    KVStore,
    MemoryKVStore,
    StoreStats,
    TieredKVStore,
    default_store,
    default_store_dir,
)
from kvblend.store import memory as memory_module
from kvblend.store.base import EntrySpec

STORE_KINDS = ["memory", "disk", "tiered"]


def make_kv(
    layers: int = 2, heads: int = 2, tokens: int = 8, dim: int = 4, dtype=torch.float16, seed=0
) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for kind in "kv":
            data = torch.randn(heads, tokens, dim, generator=generator)
            tensors[f"{kind}.{layer}"] = data.to(dtype)
    return tensors


def assert_same(entry, expected: dict[str, torch.Tensor]) -> None:
    assert entry is not None
    assert sorted(entry) == sorted(expected)
    for name, tensor in expected.items():
        got = entry[name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        assert torch.equal(got.cpu(), tensor.cpu()), name


@pytest.fixture
def make_store(tmp_path):
    opened: list[KVStore] = []

    def build(kind: str, **kwargs) -> KVStore:
        if kind == "memory":
            store = MemoryKVStore(**kwargs)
        elif kind == "disk":
            store = DiskKVStore(tmp_path / "kv", **kwargs)
        else:
            store = TieredKVStore(MemoryKVStore(), DiskKVStore(tmp_path / "kv"))
        opened.append(store)
        return store

    yield build
    for store in opened:
        store.close()


@pytest.mark.parametrize("kind", STORE_KINDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_round_trip_keeps_dtype_shape_and_values(make_store, kind, dtype):
    store = make_store(kind)
    tensors = make_kv(layers=3, tokens=300, dim=16, dtype=dtype)  # large enough to be a file
    tensors["scalar"] = torch.tensor(2.5, dtype=dtype)
    tensors["empty"] = torch.zeros(2, 0, 16, dtype=dtype)
    store.put("doc-1", tensors, {"model": "tiny", "tokens": "300"})
    assert_same(store.get("doc-1"), tensors)
    assert store.metadata("doc-1") == {"model": "tiny", "tokens": "300"}
    assert store.get("doc-1").metadata == {"model": "tiny", "tokens": "300"}


@pytest.mark.parametrize("kind", STORE_KINDS)
def test_non_contiguous_and_shared_storage_tensors_round_trip(make_store, kind):
    store = make_store(kind)
    fused = torch.randn(2, 2, 5, 4)  # one buffer holding k and v, as a fused cache would
    tensors = {"k.0": fused[0], "v.0": fused[1], "k.1": fused[0].transpose(1, 2)}
    store.put("fused", tensors)
    assert_same(store.get("fused"), tensors)


@pytest.mark.parametrize("kind", STORE_KINDS)
def test_miss_contains_delete_clear(make_store, kind):
    store = make_store(kind)
    assert store.get("absent") is None
    assert store.metadata("absent") is None
    assert not store.contains("absent") and "absent" not in store
    store.put("a", make_kv())
    store.put("b", make_kv(seed=1))
    assert store.contains("a") and "a" in store
    assert store.delete("a") is True
    assert store.delete("a") is False
    assert store.get("a") is None
    store.clear()
    assert store.get("b") is None and store.stats().entries == 0


@pytest.mark.parametrize("kind", STORE_KINDS)
def test_put_replaces_and_metadata_defaults_to_empty(make_store, kind):
    store = make_store(kind)
    store.put("a", make_kv(seed=0), {"v": "1"})
    replacement = make_kv(layers=1, seed=5)
    store.put("a", replacement)
    assert_same(store.get("a"), replacement)
    assert store.metadata("a") == {}


@pytest.mark.parametrize("kind", STORE_KINDS)
def test_put_keeps_its_own_copy(make_store, kind):
    store = make_store(kind)
    original = make_kv(dtype=torch.float32)
    given = {name: tensor.clone() for name, tensor in original.items()}
    store.put("a", given)
    given["k.0"].zero_()  # the caller reuses its buffer after put()
    assert_same(store.get("a"), original)


def test_memory_tier_reads_in_place():
    store = MemoryKVStore()
    store.put("a", make_kv())
    first, second = store.get("a"), store.get("a")
    for name in first:  # no defensive copy: every read hands out the tensor the store holds
        assert first[name].data_ptr() == second[name].data_ptr()
    if torch.cuda.is_available():  # pinned once, when stored
        assert all(first[name].is_pinned() for name in first)


@pytest.mark.parametrize("kind", STORE_KINDS)
def test_get_places_tensors_on_the_requested_device(make_store, kind):
    store = make_store(kind)
    store.put("a", make_kv())
    entry = store.get("a", device="meta")
    assert {entry[name].device.type for name in entry} == {"meta"}
    assert store.get("a", device=torch.device("cpu"))["v.1"].device.type == "cpu"


BAD_KEYS = ["", "a/b", "a b", "ключ", "x" * 201, "../etc", "k\n", None, 5, b"abc"]


@pytest.mark.parametrize("kind", STORE_KINDS)
@pytest.mark.parametrize("key", BAD_KEYS)
def test_invalid_keys_are_rejected_with_a_clear_error(make_store, kind, key):
    store = make_store(kind)
    for call in (
        lambda: store.get(key),
        lambda: store.put(key, make_kv()),
        lambda: store.contains(key),
        lambda: store.delete(key),
        lambda: store.metadata(key),
    ):
        with pytest.raises(ValueError, match="invalid KV store key"):
            call()


@pytest.mark.parametrize("kind", STORE_KINDS)
def test_valid_key_characters_are_accepted(make_store, kind):
    store = make_store(kind)
    key = "sha256-0123456789abcdefABCDEF_v1.2"
    store.put(key, make_kv())
    assert store.contains(key)


@pytest.mark.parametrize(
    ("tensors", "metadata", "error"),
    [
        ({}, None, ValueError),
        ({"k.0": [1, 2]}, None, TypeError),
        ({"__metadata__": torch.zeros(1)}, None, ValueError),
        ({"k.0": torch.zeros(2, dtype=torch.complex64)}, None, ValueError),
        ({"k.0": torch.zeros(2)}, {"kvblend.key": "x"}, ValueError),
        ({"k.0": torch.zeros(2)}, {"n": 3}, TypeError),
    ],
)
@pytest.mark.parametrize("kind", STORE_KINDS)
def test_invalid_entries_are_rejected(make_store, kind, tensors, metadata, error):
    store = make_store(kind)
    with pytest.raises(error):
        store.put("a", tensors, metadata)
    assert not store.contains("a")


@pytest.mark.parametrize("kind", STORE_KINDS)
def test_stats_count_hits_misses_and_hit_rate(make_store, kind):
    store = make_store(kind)
    assert store.stats().hit_rate == 0.0
    store.put("a", make_kv())
    for _ in range(3):
        assert store.get("a") is not None
    assert store.get("b") is None
    stats = store.stats()
    assert (stats.hits, stats.misses, stats.entries) == (3, 1, 1)
    assert stats.hit_rate == pytest.approx(0.75)
    assert stats.bytes > 0


def test_memory_store_evicts_least_recently_used_by_bytes():
    entry_bytes = sum(t.nbytes for t in make_kv().values())
    store = MemoryKVStore(max_bytes=3 * entry_bytes)
    for key in "abc":
        store.put(key, make_kv())
    store.get("a")  # a becomes the most recently used
    store.put("d", make_kv())
    assert [store.contains(k) for k in "abcd"] == [True, False, True, True]
    stats = store.stats()
    assert stats.evictions == 1 and stats.bytes == 3 * entry_bytes == stats.capacity_bytes
    too_big = make_kv(tokens=100)
    store.put("big", too_big)
    assert not store.contains("big") and store.contains("a")


def test_disk_store_evicts_least_recently_used_by_size(tmp_path):
    entry = make_kv(layers=2, tokens=400, dim=16, dtype=torch.float32)  # 200 KiB: a file
    store = DiskKVStore(tmp_path / "kv", size_limit=900 * 1024)
    for index in range(3):
        store.put(f"e{index}", entry)
    assert store.get("e0") is not None  # e0 becomes the most recently used
    for index in range(3, 6):
        store.put(f"e{index}", entry)
    present = [store.contains(f"e{index}") for index in range(6)]
    assert present[0] and present[5], present
    assert not present[1] and not present[2], present
    stats = store.stats()
    assert stats.evictions == present.count(False)
    assert stats.bytes <= store.size_limit
    assert_same(store.get("e5"), entry)
    store.close()


def test_disk_entry_larger_than_the_limit_is_refused(tmp_path):
    store = DiskKVStore(tmp_path / "kv", size_limit=64 * 1024)
    with pytest.raises(store_pkg.StoreError, match="more than the size limit"):
        store.put("big", make_kv(tokens=4000))
    store.close()


def test_disk_entries_are_standard_safetensors_files(tmp_path):
    store = DiskKVStore(tmp_path / "kv")
    tensors = {"kv": torch.randn(2, 2, 4, 500, 16).half()}  # the engine's one tensor
    store.put("doc", tensors, {"model": "m"})
    (path,) = list((tmp_path / "kv").rglob("*.val"))
    with safetensors.safe_open(str(path), framework="pt") as file:
        meta = file.metadata()
        assert meta["model"] == "m" and meta["kvblend.key"] == "doc"
        assert meta["kvblend.layers"] == "2" and meta["kvblend.tokens"] == "500"
        for name, tensor in tensors.items():
            assert torch.equal(file.get_tensor(name), tensor)
    store.close()


def test_tiered_store_promotes_disk_hits_once_fully_read(tmp_path):
    tensors = make_kv(layers=3)
    writer = TieredKVStore(MemoryKVStore(), DiskKVStore(tmp_path / "kv"))
    writer.put("a", tensors, {"m": "1"})
    assert writer.memory.contains("a") and writer.disk.contains("a")

    reader = TieredKVStore(MemoryKVStore(), DiskKVStore(tmp_path / "kv"))
    partial = reader.get("a")
    partial["k.0"]
    assert not reader.memory.contains("a")  # only a part was read: nothing promoted
    entry = reader.get("a")
    assert_same(entry, tensors)
    assert reader.memory.contains("a") and reader.memory.metadata("a") == {"m": "1"}
    assert_same(reader.get("a"), tensors)
    stats = reader.stats()
    assert (stats.hits, stats.misses) == (3, 0)
    assert stats.tiers["memory"].hits == 1 and stats.tiers["disk"].hits == 2
    assert stats.entries == 1 and stats.capacity_bytes == reader.disk.size_limit
    writer.close()
    reader.close()


def test_tiered_memory_only_and_stats_shape():
    store = TieredKVStore(MemoryKVStore(max_bytes=1 << 20), disk=None)
    store.put("a", make_kv())
    assert_same(store.get("a"), make_kv())
    assert store.get("zz") is None
    stats = store.stats()
    assert isinstance(stats, StoreStats) and set(stats.tiers) == {"memory"}
    assert stats.hit_rate == 0.5 and stats.capacity_bytes == 1 << 20


def test_default_store_dir_follows_env_and_platformdirs(monkeypatch, tmp_path):
    monkeypatch.setenv("KVBLEND_STORE_DIR", str(tmp_path / "custom"))
    assert default_store_dir() == tmp_path / "custom"
    monkeypatch.delenv("KVBLEND_STORE_DIR")
    assert default_store_dir().parts[-2:] == ("kvblend", "kv")


def test_default_store_is_tiered_with_documented_budgets(monkeypatch, tmp_path):
    monkeypatch.setenv("KVBLEND_STORE_DIR", str(tmp_path / "env-dir"))
    store = default_store()
    assert isinstance(store, TieredKVStore) and store.disk is not None
    assert store.disk.directory == tmp_path / "env-dir"
    stats = store.stats()
    assert stats.tiers["memory"].capacity_bytes == 2 << 30
    assert stats.tiers["disk"].capacity_bytes == 20 << 30
    store.close()


def _imported_modules(source: str, package: str) -> list[str]:
    """Absolute names of every module ``source`` (a module of ``package``) imports.

    Relative imports are resolved: ``from ..engine import X`` in ``kvblend.store`` is
    ``kvblend.engine`` (and ``kvblend.engine.X``, in case X is a module), ``from .. import
    engine`` is ``kvblend.engine``.
    """
    names: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1]) if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            names += [module] if node.module else []
            names += [f"{module}.{alias.name}" for alias in node.names]
    return names


def test_import_check_resolves_relative_imports():
    source = "from ..engine import BlendEngine\nfrom .. import engine\nfrom .base import KVStore\n"
    assert _imported_modules(source, "kvblend.store") == [
        "kvblend.engine", "kvblend.engine.BlendEngine", "kvblend.engine",
        "kvblend.store.base", "kvblend.store.base.KVStore",
    ]  # fmt: skip
    assert _imported_modules("import pickle as p", "kvblend.store") == ["pickle"]


def test_store_package_imports_no_engine_framework_or_pickle():
    engine = ("engine", "blend", "prompt", "documents", "models", "decoding", "integrations")
    forbidden = (*(f"kvblend.{name}" for name in engine), "langchain", "llama_index", "pickle",
                 "dill", "cloudpickle")  # fmt: skip
    package_dir = pathlib.Path(store_pkg.__file__).parent
    for path in package_dir.rglob("*.py"):
        parts = path.relative_to(package_dir).parts
        package = ".".join(("kvblend", "store", *parts[:-1]))  # the package holding the file
        for name in _imported_modules(path.read_text(), package):
            assert not name.startswith(forbidden), f"{path} imports {name}"


def test_the_memory_tier_checks_values_as_entries_are_written_never_as_they_are_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    checked: list[torch.Tensor] = []
    real = memory_module.non_finite
    monkeypatch.setattr(memory_module, "non_finite", lambda t: checked.append(t) or real(t))
    store = MemoryKVStore()
    good, bad = torch.ones(2, 3), torch.ones(2, 3)
    bad[1, 2] = float("nan")
    store.put("good", {"kv": good})
    store.put("bad", {"kv": bad})
    assert len(checked) == 2  # at write time
    spec = EntrySpec({"kv": (torch.float32, (2, 3))})
    found = store.get("good", expect=spec)
    assert found is not None and torch.equal(found["kv"], good)
    assert store.get("bad", expect=spec) is None and store.stats().corrupt_dropped == 1
    assert len(checked) == 2  # nothing summed as they were read
    store.insert_owned("owned", {"kv": bad.clone()}, {})  # unchecked: checked here
    assert len(checked) == 3 and store.get("owned", expect=spec) is None
    store.insert_owned("known", {"kv": good.clone()}, {}, finite=True)  # read from bytes
    assert len(checked) == 3 and store.get("known", expect=spec) is not None
