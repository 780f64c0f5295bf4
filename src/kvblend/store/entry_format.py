"""The on-disk format of one entry: safetensors bytes with integrity metadata, read per tensor.

An entry is a standard safetensors file (`safetensors.torch.save`), so any safetensors reader can
open it. The engine stores one tensor per document, ``kv``: every layer's un-rotated keys and
values laid out as its prompt buffer holds them, ``[layers, 2, kv_heads, tokens, head_dim]``
(`kvblend.documents.segment_kv`), so a read is one contiguous run of bytes into one buffer,
checksummed as it lands. The store itself accepts any names. It adds these `__metadata__`
items next to the caller's own:

- ``kvblend.format``: format version (``"1"``).
- ``kvblend.key``: the store key the entry was written under, so bytes found under another key
  (a swapped or misfiled entry) are detected.
- ``kvblend.checksum``: the checksum algorithm: ``"xxh3-64"`` (written), or ``"crc32"``
  (entries of earlier versions, still read).
- ``kvblend.tensors``: JSON list of ``[name, dtype, shape, checksum]`` in layer order.
- ``kvblend.layers`` / ``kvblend.tokens``: layer and token counts when the entry is the
  engine's: one tensor ``kv`` of ``[layers, 2, kv_heads, tokens, head_dim]``.
- ``kvblend.header_checksum``: checksum of all the other metadata items, canonically encoded.
- ``kvblend.macs`` / ``kvblend.key_id`` / ``kvblend.mac``: with a store key
  (``$KVBLEND_STORE_KEY``), keyed MACs of each tensor and of the metadata, and the key's
  fingerprint (`entry_mac`); a reader with the key uses only entries whose MACs verify.

The header is parsed here (8-byte length, then JSON) rather than by safetensors, so that a
tensor is read straight from an open file into its own buffer and checked as it lands. The
checksum (XXH3, 64 bits, ~10 GB/s on one core) finds accidental damage (bit flips,
truncation); only the MACs stop someone who can write the folder.
"""

from __future__ import annotations

import hmac
import io
import json
import os
import threading
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import safetensors.torch
import torch
import xxhash

from kvblend.store.base import (
    SAFETENSORS_DTYPES,
    CorruptEntryError,
    EntrySpec,
    OtherStoreKeyError,
    StoreError,
    layer_order,
    non_finite,
)
from kvblend.store.entry_mac import OtherKeyEntry, StoreKey, verify_header
from kvblend.store.transfer import HOST_TO_DEVICE, PendingCopy

FORMAT_VERSION = "1"
#: The checksum written into new entries; every algorithm of `_CHECKSUMS` is read.
CHECKSUM_ALGORITHM = "xxh3-64"
_TORCH_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}
_MAX_HEADER_BYTES = 64 << 20
#: The name of the engine's one tensor per entry (`kvblend.prompt.segments.KV_NAME`).
KV_BLOB = "kv"


def _crc32(data: bytes | memoryview) -> str:
    return f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"


_CHECKSUMS: dict[str, Callable[[bytes | memoryview], str]] = {
    "xxh3-64": xxhash.xxh3_64_hexdigest,
    "crc32": _crc32,
}


def checksum(data: bytes | memoryview, algorithm: str = CHECKSUM_ALGORITHM) -> str:
    """Return the checksum of `data` by `algorithm` (default: the one written), as hex digits."""
    return _CHECKSUMS[algorithm](data)


def _header_checksum(metadata: Mapping[str, str]) -> str:
    """Return the checksum of every other metadata item, by the algorithm the metadata names."""
    items = {k: v for k, v in metadata.items() if k != "kvblend.header_checksum"}
    encoded = json.dumps(items, sort_keys=True, ensure_ascii=True).encode()
    return checksum(encoded, metadata.get("kvblend.checksum", CHECKSUM_ALGORITHM))


def _as_bytes_view(tensor: torch.Tensor) -> memoryview:
    """Return a view of a contiguous CPU tensor's bytes."""
    return tensor.reshape(-1).view(torch.uint8).numpy().data


def encode_entry(
    key: str,
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str],
    mac_key: StoreKey | None = None,
) -> bytes:
    """Serialize one entry to safetensors bytes carrying the integrity metadata.

    `tensors` and `metadata` must already be validated (`base.validate_entry`). With `mac_key`,
    the entry carries its MACs (`entry_mac`).
    """
    cpu_tensors: dict[str, torch.Tensor] = {}
    seen_storage: set[int] = set()
    for name, tensor in tensors.items():
        tensor = tensor.detach().to("cpu")
        storage = tensor.untyped_storage()
        shared = storage.data_ptr() in seen_storage and tensor.numel() > 0
        if shared or not tensor.is_contiguous() or storage.nbytes() != tensor.nbytes:
            tensor = tensor.clone(memory_format=torch.contiguous_format)
        seen_storage.add(tensor.untyped_storage().data_ptr())
        cpu_tensors[name] = tensor
    names = sorted(cpu_tensors, key=layer_order)
    listing = [
        [
            name,
            SAFETENSORS_DTYPES[cpu_tensors[name].dtype],
            list(cpu_tensors[name].shape),
            checksum(_as_bytes_view(cpu_tensors[name])),
        ]
        for name in names
    ]
    full = dict(metadata)
    full.update(
        {
            "kvblend.format": FORMAT_VERSION,
            "kvblend.key": key,
            "kvblend.checksum": CHECKSUM_ALGORITHM,
            "kvblend.tensors": json.dumps(listing, separators=(",", ":")),
        }
    )
    blob = cpu_tensors.get(KV_BLOB)
    if len(cpu_tensors) == 1 and blob is not None and blob.dim() == 5 and blob.shape[1] == 2:
        full["kvblend.layers"] = str(blob.shape[0])
        full["kvblend.tokens"] = str(blob.shape[3])
    if mac_key is not None:
        views = (_as_bytes_view(cpu_tensors[name]) for name in names)
        mac_key.sign(full, [mac_key.tensor_tag(n, v) for n, v in zip(names, views, strict=True)])
    full["kvblend.header_checksum"] = _header_checksum(full)
    return safetensors.torch.save(cpu_tensors, metadata=full)


class Payload:
    """Random access to one stored entry: an open file (read per tensor) or in-memory bytes.

    An open handle keeps the file readable even if another process evicts it meanwhile.
    Reads are serialized by a lock so the caller and prefetch threads can share one handle.
    `identity` tells two stored values apart (file path, or the bytes' checksum).
    """

    def __init__(self, source: io.BufferedIOBase | bytes) -> None:
        self._lock = threading.Lock()
        self._handle: io.BufferedIOBase | None = None
        self._data: bytes | None = None
        if isinstance(source, bytes):
            self._data = source
            self.size = len(source)
            self.identity = "bytes:" + checksum(source)
        else:
            self._handle = source
            self.size = os.fstat(source.fileno()).st_size
            self.identity = "file:" + str(getattr(source, "name", ""))
        self._closed = False

    def read_into(self, offset: int, buffer: memoryview) -> int:
        """Fill `buffer` from `offset`; return how many bytes were available (short at EOF)."""
        with self._lock:
            if self._closed:
                raise StoreError("read from a closed KV store entry")
            if self._data is not None:
                chunk = self._data[offset : offset + len(buffer)]
                buffer[: len(chunk)] = chunk
                return len(chunk)
            assert self._handle is not None
            self._handle.seek(offset)
            filled = 0
            while filled < len(buffer):
                count = self._handle.readinto(buffer[filled:])
                if not count:
                    break
                filled += count
            return filled

    def read(self, offset: int, size: int) -> bytes:
        """Return up to `size` bytes from `offset`."""
        buffer = bytearray(size)
        return bytes(buffer[: self.read_into(offset, memoryview(buffer))])

    def close(self) -> None:
        """Close the file handle (idempotent)."""
        with self._lock:
            self._closed = True
            handle, self._handle, self._data = self._handle, None, None
        if handle is not None:
            handle.close()


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies in an entry and what it must hash to."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    checksum: str
    algorithm: str = CHECKSUM_ALGORITHM  # how `checksum` was computed
    mac: str | None = None  # the tensor's MAC, checked instead of `checksum` when set
    mac_key: StoreKey | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class EntryHeader:
    """The parsed and verified header of an entry: tensors in layer order, caller metadata."""

    key: str
    tensors: tuple[TensorInfo, ...]
    metadata: dict[str, str]


def read_header(payload: Payload, key: str, mac_key: StoreKey | None = None) -> EntryHeader:
    """Parse and verify the header of `payload` stored under `key`.

    With `mac_key`, the entry must carry MACs made with that key (`entry_mac`); each tensor is
    then verified by its MAC as it is read. An entry of another key (or none) raises
    `OtherStoreKeyError`, not damage.

    Raises `CorruptEntryError` if the bytes are not a kvblend entry for `key`, the header is
    damaged, tensors overlap or leave gaps, the payload is truncated or has trailing bytes, or
    decoding fails in any other way (a crafted header may make the JSON parser or an integer
    conversion raise anything): whatever the bytes, no other error leaves this function, except
    `OtherStoreKeyError` and `StoreError` for a payload that was already closed.
    """
    try:
        return _parse_header(payload, key, mac_key)
    except (CorruptEntryError, OtherStoreKeyError, StoreError):
        raise
    except Exception as error:  # noqa: BLE001 - any decoding failure means a damaged entry
        reason = f"undecodable header ({type(error).__name__}: {error})"
        raise CorruptEntryError(key, reason) from error


def _parse_header(payload: Payload, key: str, mac_key: StoreKey | None) -> EntryHeader:
    """Read and check an entry's header: its metadata, then its tensors' listing and layout."""
    header, metadata, data_start = _read_header(payload, key)
    algorithm = _check_metadata(metadata, key)
    try:
        listing = json.loads(metadata["kvblend.tensors"])
        macs = verify_header(mac_key, metadata, len(listing)) if mac_key else [None] * len(listing)
    except OtherKeyEntry as other:
        raise OtherStoreKeyError(key, str(other), replaceable=other.replaceable) from None
    except (ValueError, KeyError, TypeError) as error:
        raise CorruptEntryError(key, str(error)) from None
    try:
        infos = [
            _tensor_info(header, listed, data_start, algorithm, mac, mac_key)
            for listed, mac in zip(listing, macs, strict=True)
        ]
    except (ValueError, KeyError, TypeError) as error:
        raise CorruptEntryError(key, f"inconsistent tensor listing ({error})") from None
    if header:
        raise CorruptEntryError(key, f"unlisted tensors {sorted(header)[:3]}")
    _check_tiling(infos, data_start, payload.size, key)
    user = {k: v for k, v in metadata.items() if not k.startswith("kvblend.")}
    return EntryHeader(key, tuple(infos), user)


def _read_header(payload: Payload, key: str) -> tuple[dict[str, Any], dict[str, str], int]:
    """Return the safetensors header's tensors, its metadata and where the data section starts."""
    prefix = payload.read(0, 8)
    if len(prefix) < 8:
        raise CorruptEntryError(key, f"truncated: {payload.size} bytes")
    header_size = int.from_bytes(prefix, "little")
    if header_size > min(_MAX_HEADER_BYTES, payload.size - 8):
        raise CorruptEntryError(key, "header length is out of range (truncated or not safetensors)")
    try:
        header = json.loads(payload.read(8, header_size))
        metadata = header.pop("__metadata__")
        if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
        ):
            raise ValueError("metadata is not a str -> str map")
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise CorruptEntryError(key, f"unreadable header ({error})") from None
    return header, metadata, 8 + header_size


def _check_metadata(metadata: dict[str, str], key: str) -> str:
    """Check the format, header checksum and key an entry's metadata names; return its checksum."""
    if metadata.get("kvblend.format") != FORMAT_VERSION:
        raise CorruptEntryError(key, f"not a kvblend entry of format {FORMAT_VERSION}")
    algorithm = metadata.get("kvblend.checksum", "")
    if algorithm not in _CHECKSUMS:
        raise CorruptEntryError(key, f"unknown checksum {algorithm!r}")
    if metadata.get("kvblend.header_checksum") != _header_checksum(metadata):
        raise CorruptEntryError(key, "header checksum mismatch")
    if metadata.get("kvblend.key") != key:
        raise CorruptEntryError(key, f"holds the entry of key {metadata.get('kvblend.key')!r}")
    return algorithm


def _tensor_info(
    header: dict[str, Any],
    listed: Any,
    data_start: int,
    algorithm: str,
    mac: Any,
    mac_key: StoreKey | None,
) -> TensorInfo:
    """Return one listed tensor's `TensorInfo`, taken out of ``header`` (``ValueError`` if off)."""
    name, dtype_name, shape, tensor_checksum = listed
    described = header.pop(name)
    begin, end = described["data_offsets"]
    dtype = _TORCH_DTYPES[dtype_name]
    if described["dtype"] != dtype_name or described["shape"] != shape:
        raise ValueError(f"tensor {name!r} does not match its listing")
    numel = 1
    for size in shape:
        numel *= int(size)
    if end - begin != numel * dtype.itemsize or not 0 <= begin <= end:
        raise ValueError(f"tensor {name!r} has inconsistent offsets")
    shape = tuple(int(size) for size in shape)
    key = mac_key if mac is not None else None
    return TensorInfo(
        name, dtype, shape, data_start + begin, end - begin, tensor_checksum, algorithm, mac, key
    )


def _check_tiling(infos: list[TensorInfo], data_start: int, size: int, key: str) -> None:
    """Refuse tensors that do not tile the data section exactly, as safetensors requires.

    A crafted header pointing many tensors at the same bytes would otherwise cost their sum in
    memory.
    """
    data_end = 0
    for info in sorted(infos, key=lambda info: (info.offset, info.nbytes)):
        if info.offset != data_start + data_end:
            raise CorruptEntryError(key, f"tensor {info.name!r} overlaps another or leaves a gap")
        data_end += info.nbytes
    if data_start + data_end != size:
        raise CorruptEntryError(key, f"size {size} bytes, expected {data_start + data_end}")


def check_expected(header: EntryHeader, expect: EntrySpec | None) -> None:
    """Raise `CorruptEntryError` if the tensors `header` lists are not those `expect` names."""
    if expect is None:
        return
    reason = expect.mismatch({info.name: (info.dtype, info.shape) for info in header.tensors})
    if reason is not None:
        raise CorruptEntryError(header.key, f"does not fit the reader's model: {reason}")


def read_tensor(
    payload: Payload,
    info: TensorInfo,
    key: str,
    device: torch.device | None = None,
    *,
    finite: bool = False,
) -> torch.Tensor | PendingCopy:
    """Read one tensor from `payload`, verify its checksum (or MAC), return it on `device`.

    With `finite`, a floating tensor holding NaN or infinity is corrupt: checked on the host
    buffer right after the checksum, before any copy to `device`. For a CUDA `device` the copy
    from the pinned buffer is issued on a side stream: the result is a `PendingCopy`
    (`kvblend.store.transfer`).

    The bytes go straight from the file into the tensor's own buffer, and the checksum is
    computed over that buffer: no intermediate copy. The buffer is pinned when CUDA is
    available and the target is a CUDA device or the host (the memory tier keeps host KV
    pinned, and a host read there is on its way to the GPU). Raises `CorruptEntryError` on a
    short read, a checksum mismatch, a read error or any other failure to decode the bytes;
    allocating the buffer and moving to `device` are not decoding, so an out-of-memory error
    there is raised as it is.
    """
    target = device.type if device is not None else "cpu"
    pin = target in ("cpu", "cuda") and torch.cuda.is_available()
    buffer = torch.empty(info.nbytes, dtype=torch.uint8, pin_memory=pin)
    try:
        tensor = _decode_tensor(payload, info, key, buffer)
        if finite and non_finite(tensor):
            raise CorruptEntryError(key, f"tensor {info.name!r} holds NaN or infinity")
    except (CorruptEntryError, StoreError):
        raise
    except Exception as error:  # noqa: BLE001 - an unreadable tensor means a damaged entry
        raise CorruptEntryError(
            key, f"tensor {info.name!r} unreadable ({type(error).__name__}: {error})"
        ) from error
    return HOST_TO_DEVICE.copy(tensor, device, copy=False)


def _decode_tensor(
    payload: Payload, info: TensorInfo, key: str, buffer: torch.Tensor
) -> torch.Tensor:
    view = buffer.numpy().data
    filled = payload.read_into(info.offset, view)
    if filled != info.nbytes:
        raise CorruptEntryError(key, f"tensor {info.name!r} truncated")
    if info.mac is not None and info.mac_key is not None:
        if not hmac.compare_digest(info.mac_key.tensor_tag(info.name, view), info.mac):
            raise CorruptEntryError(key, f"tensor {info.name!r} MAC mismatch")
    elif checksum(view, info.algorithm) != info.checksum:
        raise CorruptEntryError(key, f"tensor {info.name!r} checksum mismatch")
    return buffer.view(info.dtype).reshape(info.shape)


class _Crc32:
    """`zlib.crc32` fed in pieces, shaped like `xxhash`'s streaming digests."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: bytes | memoryview) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value & 0xFFFFFFFF:08x}"


def verify_tensors(payload: Payload, header: EntryHeader, piece: int = 16 << 20) -> None:
    """Read every tensor of an entry in pieces of `piece` bytes and check it, keeping none.

    Each tensor against its MAC when the header gave one (`read_header` with the store key),
    else its checksum; raises `CorruptEntryError` on a mismatch or a short read. What
    `kvblend store repair` reads every indexed entry with: memory stays at one piece whatever
    the entry's size.
    """
    buffer = bytearray(piece)
    view = memoryview(buffer)
    for info in header.tensors:
        hasher: Any
        if info.mac is not None and info.mac_key is not None:
            hasher = info.mac_key.tensor_mac(info.name)
        elif info.algorithm == "crc32":
            hasher = _Crc32()
        else:
            hasher = xxhash.xxh3_64()
        done = 0
        while done < info.nbytes:
            size = min(piece, info.nbytes - done)
            if payload.read_into(info.offset + done, view[:size]) != size:
                raise CorruptEntryError(header.key, f"tensor {info.name!r} truncated")
            hasher.update(view[:size])
            done += size
        expected = info.mac if info.mac is not None and info.mac_key is not None else info.checksum
        if not hmac.compare_digest(hasher.hexdigest(), expected):
            kind = "MAC" if info.mac is not None and info.mac_key is not None else "checksum"
            raise CorruptEntryError(header.key, f"tensor {info.name!r} {kind} mismatch")


def entry_key(payload: Payload) -> str | None:
    """Return the key `payload` was written under if it is a whole, intact-looking entry.

    The key comes from the entry's own header, which is then verified as `read_header` does
    for a reader (header checksum, tensor listing, size); tensor bytes are not read. None for
    anything else: a partial file, a damaged header, bytes kvblend did not write.
    """
    try:
        prefix = payload.read(0, 8)
        header_size = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
        if not 0 < header_size <= min(_MAX_HEADER_BYTES, payload.size - 8):
            return None
        key = json.loads(payload.read(8, header_size))["__metadata__"]["kvblend.key"]
        if not isinstance(key, str):
            return None
        read_header(payload, key)
    except (CorruptEntryError, StoreError, ValueError, KeyError, TypeError):
        return None
    return key
