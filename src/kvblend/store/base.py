"""The store contract: the `KVStore` interface, its errors, its statistics and input checks.

A store maps a caller-given key (a content hash) to a dictionary of named tensors plus string
metadata. It knows bytes and keys only, nothing of models: the engine decides what the tensors
mean. Every store validates keys, tensor names and metadata the same way, so that switching
from one store to another never changes which inputs are accepted.
"""

from __future__ import annotations

import abc
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType

import torch

from kvblend.store.record_logs import MemoryRecordLogs

#: Prefix of the metadata entries the store writes itself; callers may not use it.
RESERVED_METADATA_PREFIX = "kvblend."

_KEY_PATTERN = re.compile(r"[0-9A-Za-z_.-]{1,200}")
_MAX_KEY_LENGTH = 200

#: Tensor dtypes a store accepts, with their safetensors names.
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


class StoreError(Exception):
    """A store operation failed for a reason outside the caller's control (disk, folder)."""


class CorruptEntryError(StoreError):
    """A stored entry is damaged, truncated, or holds another key's bytes.

    The store has already dropped the entry and counted it when this is raised.
    """

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"corrupt KV store entry {key!r}: {reason}")
        self.key = key
        self.reason = reason


class OtherStoreKeyError(StoreError):
    """An entry this store cannot verify because another store key, or none, signed it.

    Not damage: with ``$KVBLEND_STORE_KEY`` set, an entry written by a process with another key
    (or, `replaceable`, without one, or by a version whose entries did not name their key) is a
    miss for this store, left in place for the processes it belongs to, and never counted as
    corrupt (`StoreStats.other_key` counts it). `put()` raises it when the entry it would
    replace is one of another key still in use (`replaceable` False).
    """

    def __init__(self, key: str, reason: str, *, replaceable: bool = False) -> None:
        super().__init__(f"KV store entry {key!r} {reason}")
        self.key = key
        self.reason = reason
        #: Whether this store may write over the entry (unsigned, or of an earlier version).
        self.replaceable = replaceable


class EntryReplacedError(StoreError):
    """An entry was replaced or evicted while it was read (another process wrote the key).

    Not damage: the lookup counts as a miss, nothing is dropped, and the caller computes the
    entry (or reads it again).
    """

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"KV store entry {key!r} {reason}")
        self.key = key


class RemoteUnavailableError(StoreError):
    """A remote store cannot reach its server, or skips it while backing off.

    The remote store logs the outage itself, so the tiered store only counts these.
    """


@dataclass(frozen=True)
class StoreStats:
    """A snapshot of a store's counters.

    `hits`, `misses`, `evictions`, `corrupt_dropped`, `put_errors` and `other_key` count what
    this store object saw since it was built (per process); `other_key` counts the lookups (and
    refused writes) that found an entry signed with another store key or none
    (`OtherStoreKeyError`): misses, and the entry left in place. `entries` and `bytes` describe
    the current content, which for a disk store includes what other processes wrote. `hit_rate` is
    `hits / (hits + misses)`, 0.0 before the first lookup. A tiered store fills `tiers` with
    one `StoreStats` per tier ("memory", "disk"). `read_only`: the store (a tiered store: its
    disk tier) was opened read-only, its entries are read and writes fail.
    """

    entries: int
    bytes: int
    hits: int
    misses: int
    evictions: int
    corrupt_dropped: int
    put_errors: int = 0
    capacity_bytes: int | None = None
    tiers: Mapping[str, StoreStats] = field(default_factory=dict)
    read_only: bool = False
    other_key: int = 0
    hit_rate: float = field(init=False)

    def __post_init__(self) -> None:
        lookups = self.hits + self.misses
        object.__setattr__(self, "hit_rate", self.hits / lookups if lookups else 0.0)


@dataclass(frozen=True)
class EntrySpec:
    """What a caller expects an entry to hold, checked by the store as it opens and reads it.

    `tensors` maps every expected name to its dtype and shape: an entry with other names, a
    tensor of another dtype or shape, is corrupt. With `finite`, a floating tensor holding NaN
    or infinity is corrupt too; that is checked on the bytes as they are read, in the same pass
    as their checksum. A corrupt entry is dropped and counted like a damaged one.
    """

    tensors: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]
    finite: bool = True

    def mismatch(self, found: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]) -> str | None:
        """Say how `found` (name -> dtype, shape) differs from the spec; None when it matches."""
        if found.keys() != self.tensors.keys():
            missing = sorted(self.tensors.keys() - found.keys(), key=layer_order)
            extra = sorted(found.keys() - self.tensors.keys(), key=layer_order)
            return (
                f"holds {len(found)} tensors, expected {len(self.tensors)} "
                f"(missing {missing[:3]}, unexpected {extra[:3]})"
            )
        for name, (dtype, shape) in self.tensors.items():
            found_dtype, found_shape = found[name]
            if found_dtype != dtype or tuple(found_shape) != tuple(shape):
                return (
                    f"tensor {name!r} is {found_dtype} {list(found_shape)}, "
                    f"expected {dtype} {list(shape)}"
                )
        return None


def non_finite(tensor: torch.Tensor) -> bool:
    """Whether a floating `tensor` holds NaN or infinity (other dtypes never do).

    One sum with no temporary of the tensor's size (a few microseconds per 100k values): NaN
    and infinity propagate through it, so a finite sum proves every value finite. Only a sum
    that overflows (a float16 sum past 65504) costs the exact element-wise check; 16-bit
    tensors are summed natively, which is 2-4x faster than asking for a float32 result.
    """
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return False
    if tensor.dtype.itemsize == 1:  # float8: no fast sum
        tensor = tensor.to(torch.float16)
    if math.isfinite(float(tensor.sum())):
        return False
    return not bool(torch.isfinite(tensor).all())


def validate_key(key: object) -> str:
    """Return `key` if it is a valid store key, else raise `ValueError` saying why."""
    if not isinstance(key, str) or not _KEY_PATTERN.fullmatch(key):
        raise ValueError(
            f"invalid KV store key {key!r}: a key must be a string of 1 to {_MAX_KEY_LENGTH} "
            "characters from [0-9A-Za-z_.-] (for example a hex content hash)"
        )
    return key


def validate_entry(
    tensors: object, metadata: object
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Check the tensors and metadata of a `put()`; return them as plain dicts.

    Raises `ValueError` or `TypeError` with a message naming the offending item.
    """
    return _checked_tensors(tensors), _checked_metadata(metadata)


def _checked_tensors(tensors: object) -> dict[str, torch.Tensor]:
    if not isinstance(tensors, Mapping) or not tensors:
        raise ValueError("tensors must be a non-empty dict of name -> torch.Tensor")
    checked: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if not isinstance(name, str) or not name or name.startswith("__"):
            raise ValueError(f"invalid tensor name {name!r}: use a non-empty str not starting '__'")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        if tensor.layout != torch.strided:
            raise ValueError(f"tensor {name!r} has layout {tensor.layout}; only dense tensors")
        if tensor.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {name!r} has unsupported dtype {tensor.dtype}")
        checked[name] = tensor
    return checked


def _checked_metadata(metadata: object) -> dict[str, str]:
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise TypeError("metadata must be a dict of str -> str or None")
    for meta_key, value in metadata.items():
        if not isinstance(meta_key, str) or not isinstance(value, str):
            raise TypeError(f"metadata entry {meta_key!r}: keys and values must be str")
        if meta_key.startswith(RESERVED_METADATA_PREFIX):
            raise ValueError(
                f"metadata key {meta_key!r} uses the reserved prefix {RESERVED_METADATA_PREFIX!r}"
            )
    return dict(metadata)


def layer_order(name: str) -> tuple[tuple[int, ...], str]:
    """Sort key that puts tensor names in layer order: k.0, v.0, k.1, v.1, ..., k.10.

    Names are ordered by the integers they contain, then by the name itself, so names without
    a number come first. This is the order in which lazy entries prefetch.
    """
    return tuple(int(number) for number in re.findall(r"\d+", name)), name


class KVStore(abc.ABC):
    """A key -> named tensors store. Implementations are thread safe.

    `get()` may return a lazy mapping (`LazyTensors`) that reads each tensor on first access
    and prefetches the next ones in layer order. Its tensors are for reading: a memory tier hands
    out the tensors it holds (no defensive copy), so writing into one would change the store; a
    caller that needs to modify one clones it first. `put()` always keeps its own copy, so the
    caller may reuse what it passed. Stores are context managers; `close()` releases threads
    and handles but leaves the store usable.
    """

    @abc.abstractmethod
    def get(
        self,
        key: str,
        device: torch.device | str | None = None,
        *,
        expect: EntrySpec | None = None,
    ) -> Mapping[str, torch.Tensor] | None:
        """Return the tensors stored under `key`, or None on a miss.

        With `device`, tensors are returned on that device. With `expect`, an entry that does
        not hold exactly the expected tensors (names, dtypes, shapes) is corrupt, and so is a
        floating tensor with NaN or infinity (`EntrySpec.finite`). A corrupt entry found while
        opening is dropped, counted and reported as a miss; one found while reading a tensor
        raises `CorruptEntryError` from the mapping access.
        """

    @abc.abstractmethod
    def put(
        self, key: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
    ) -> None:
        """Store `tensors` and string `metadata` under `key`, replacing any previous entry."""

    @abc.abstractmethod
    def contains(self, key: str) -> bool:
        """Return True if `key` has an entry (without reading or verifying it)."""

    @abc.abstractmethod
    def delete(self, key: str) -> bool:
        """Remove the entry under `key`; return True if there was one."""

    @abc.abstractmethod
    def stats(self) -> StoreStats:
        """Return a snapshot of the store's counters."""

    @abc.abstractmethod
    def clear(self) -> None:
        """Remove every entry (counters are kept)."""

    @abc.abstractmethod
    def metadata(self, key: str) -> dict[str, str] | None:
        """Return the caller's metadata of `key` without loading tensors, or None on a miss."""

    def keys(self) -> list[str]:
        """Return the keys of every entry (unverified), for rebuilding what points at them.

        Stores that cannot list their entries raise `NotImplementedError`.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot list its entries")

    def close(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Release background threads and open handles; the store stays usable."""

    # Record logs (see `kvblend.store.record_logs`): small byte records every user of the store
    # reads, such as the engine's registry of known documents. Stores whose entries other
    # processes see keep their logs where those processes see them too; the default keeps them
    # in this process.
    def append_records(self, log: str, records: Sequence[bytes]) -> None:
        """Append byte ``records`` to the record log ``log``."""
        self._record_logs().append(log, records)

    def read_records(self, log: str, cursor: int = 0) -> tuple[list[bytes], int]:
        """Return the records of ``log`` after sequence number ``cursor`` and the new cursor."""
        return self._record_logs().read(log, cursor)

    def _record_logs(self) -> MemoryRecordLogs:
        logs = self.__dict__.get("_memory_record_logs")
        if logs is None:
            logs = self.__dict__.setdefault("_memory_record_logs", MemoryRecordLogs())
        return logs

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.contains(key)

    def __enter__(self) -> KVStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
