"""CRC-32 of every fixed-length window of a text, vectorised (the registry's anchor hashes).

The document registry knows a document by the ``zlib.crc32`` of the UTF-8 of its first
characters (its anchor); finding documents in a prompt needs that hash at every position.
CRC-32 is affine over GF(2) for a fixed message length ``b``: ``crc(x) = crc(0^b) XOR
XOR_j T_b[j][x_j]``, where ``T_b[j][v]`` is the CRC of byte ``v`` at position ``j`` of ``b``
zeros (minus ``crc(0^b)``). So the hash of every window is ``b`` table gathers over numpy
arrays, not one Python call per character. Windows of ``width`` characters take different
byte lengths where the text is not ASCII; each byte length is one group.
"""

from __future__ import annotations

import functools
import zlib

import numpy as np

__all__ = ["window_crc32"]


@functools.lru_cache(maxsize=64)
def _tables(length: int) -> tuple[np.ndarray, int]:
    """``T_length`` (``[length, 256]`` uint32) and ``crc32`` of ``length`` zero bytes."""
    base = zlib.crc32(bytes(length))
    bits = np.empty((length, 8), dtype=np.uint32)
    for position in range(length):
        message = bytearray(length)
        for bit in range(8):
            message[position] = 1 << bit
            bits[position, bit] = zlib.crc32(message) ^ base
    values = np.arange(256, dtype=np.uint32)
    table = np.zeros((length, 256), dtype=np.uint32)
    for bit in range(8):
        table ^= np.where((values >> bit) & 1, bits[:, bit : bit + 1], 0).astype(np.uint32)
    return table, base


@functools.lru_cache(maxsize=4)
def _pair_tables(length: int) -> np.ndarray:
    """``[length // 2, 65536]``: the contribution of bytes ``2k, 2k + 1`` as one 16-bit value."""
    table, _ = _tables(length)
    pairs = length // 2
    low, high = table[0 : 2 * pairs : 2], table[1 : 2 * pairs : 2]
    return (low[:, None, :] ^ high[:, :, None]).reshape(pairs, 65536)


def _crc_ascii(raw: np.ndarray, count: int, length: int) -> np.ndarray:
    """CRCs of the ``count`` windows of ``length`` bytes starting at every byte of ``raw``."""
    table, base = _tables(length)
    pair_table = _pair_tables(length)
    pairs = raw[:-1].astype(np.uint16) | (raw[1:].astype(np.uint16) << 8)
    crc = np.full(count, base, dtype=np.uint32)
    for pair in range(length // 2):
        crc ^= pair_table[pair][pairs[2 * pair : 2 * pair + count]]
    if length % 2:
        crc ^= table[length - 1][raw[length - 1 : length - 1 + count]]
    return crc


def _crc_at(raw: np.ndarray, starts: np.ndarray, length: int) -> np.ndarray:
    table, base = _tables(length)
    crc = np.full(starts.shape, base, dtype=np.uint32)
    for position in range(length):
        crc ^= table[position][raw[starts + position]]
    return crc


def window_crc32(text: str, width: int) -> np.ndarray:
    """``zlib.crc32(text[i:i + width].encode("utf-8", "surrogatepass"))`` for every ``i``."""
    count = len(text) - width + 1
    if count <= 0 or width <= 0:
        return np.empty(0, dtype=np.uint32)
    data = text.encode("utf-8", "surrogatepass")
    raw = np.frombuffer(data, dtype=np.uint8)
    if len(data) == len(text):  # ASCII: one byte a character, two bytes a lookup
        return _crc_ascii(raw, count, width) if width > 1 else _crc_at(raw, np.arange(count), 1)
    codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    sizes = 1 + (codes >= 0x80).astype(np.int64) + (codes >= 0x800) + (codes >= 0x10000)
    byte_starts = np.concatenate(([0], np.cumsum(sizes)))
    starts = byte_starts[:count]
    lengths = byte_starts[width : width + count] - starts
    out = np.empty(count, dtype=np.uint32)
    for length in np.unique(lengths).tolist():
        group = np.flatnonzero(lengths == length)
        out[group] = _crc_at(raw, starts[group], length)
    return out


def non_overlapping(found: list[tuple[int, int, bytes]]) -> list[tuple[int, int]]:
    """Longest matches first, earlier first among equals; drop any that overlaps a kept one."""
    kept: list[tuple[int, int]] = []
    for start, end, _ in sorted(found, key=lambda item: (item[0] - item[1], item[0])):
        if all(end <= other_start or start >= other_end for other_start, other_end in kept):
            kept.append((start, end))
    return sorted(kept)
