"""Quantized codecs for stored K/V: keys per channel, values per token, decoded as they are placed.

A codec turns a document's K/V ``[layers, 2, kv_heads, tokens, head_dim]`` (keys before RoPE)
into the tensors one store entry holds, and back, inside the copy that places the document's
rows in the blend loop's buffer (`kvblend.blend.kv_buffer`): a layer group's codes are read
(and, on CUDA, moved to the device) as bytes and written into the buffer as values, with no
full-precision copy of the entry in between.

The scheme is KIVI's (Liu et al., 2024, "KIVI: a tuning-free asymmetric 2bit quantization for
KV cache"), without its full-precision residual: asymmetric round-to-nearest codes, ``value =
minimum + code * scale``, where

- **keys** are quantized **per channel**: one minimum and scale per layer, KV head and channel,
  over every token of the document. Keys are stored before RoPE, where a channel's outliers sit
  in the same channel for every token, so a per-channel range fits them;
- **values** are quantized **per token**: one minimum and scale per layer, KV head and token,
  over its channels.

8-bit ranges are each slice's whole range; a 4-bit range is shrunk about its middle to the
factor that gives the slice the least squared error (`CLIP_FACTORS`), at precompute only.

``k8v4`` (version 2) codes its values as the rotation-based schemes do (QuaRot, TurboQuant):
each token's values are first turned by an orthonormal Hadamard transform over ``head_dim``
(`hadamard`; one per block of the largest power of two dividing it), which spreads an outlier
channel over all of them and leaves a near-Gaussian spread, then coded on the 16 levels of a
Gaussian's Lloyd-Max quantizer (`GAUSSIAN_LEVELS`) instead of an evenly spaced grid: a lower
squared error of 4-bit values at the same bytes (``scripts/codec_value_error.py`` measures it;
the figures are in benchmarks/codecs.md); decoding adds a table lookup and one
``head_dim x head_dim`` product per layer group. Keys keep the plain per-channel scheme (they
are re-rotated by RoPE after decoding, and 8 bits are already within 0.5 of a step).

Codecs (`CODECS`): ``none`` (full precision in the engine's ``kv_dtype``, the default and the
format of every entry written before codecs existed), ``int8`` (8-bit keys and values),
``k8v4`` (8-bit keys, 4-bit values) and ``int4`` (4-bit keys and values). Two 4-bit codes
share a byte: channel ``c`` in the low nibble, channel ``c + head_dim / 2`` in the high one, so
each half decodes into a contiguous half of the buffer's rows.

An entry of a quantized codec holds two tensors, both in the one blob the store keeps per
document: ``kv.<codec>``, the codes, ``uint8 [layers, code bytes of a layer]``, and
``kv.<codec>.scales``, ``float16 [layers, scale values of a layer]``. A layer's codes are its
keys' ``[kv_heads, tokens, key bytes]`` then its values' ``[kv_heads, tokens, value bytes]``; a
layer's scales are the keys' scale and minimum ``[kv_heads, head_dim]`` each, then the values'
scale and minimum ``[kv_heads, tokens]`` each. Every layer's bytes are contiguous, so a group
of layers is one contiguous range of each tensor. The codec's name is in both tensor names
(a reader expecting another codec finds other names: the entry does not fit) and in the key
(`KVCodec.fingerprint`: entries of another codec are never found), and scales are floating
point, so the store's finite check covers them.

Bytes per token, layer and KV head, with ``D = head_dim`` and ``T`` tokens in the document:
fp16 ``4D``; ``int8`` ``2D + 4 + 4D/T``; ``k8v4`` ``1.5D + 4 + 4D/T``; ``int4`` ``D + 4 + 4D/T``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import Any

import torch

__all__ = [
    "CODECS",
    "NO_CODEC",
    "EncodedKV",
    "KVCodec",
    "kv_codec",
    "move",
]

#: Floating-point type of stored scales and minimums.
SCALE_DTYPE = torch.float16
_SCALE_MAX = torch.finfo(SCALE_DTYPE).max


@dataclass(frozen=True)
class KVCodec:
    """How an entry's K/V is stored: full precision (``none``) or quantized codes and scales."""

    name: str
    key_bits: int = 0  # 0: full precision
    value_bits: int = 0
    version: int = 1  # part of the key: a changed scheme is never read as the old one
    rotate_values: bool = False  # values turned by `hadamard` before coding, back after
    value_grid: str = "uniform"  # 4-bit value levels: "uniform" or "gaussian" (Lloyd-Max)

    def __post_init__(self) -> None:
        if self.value_grid not in ("uniform", "gaussian"):
            raise ValueError(f"value_grid must be 'uniform' or 'gaussian', not {self.value_grid!r}")
        if self.value_grid == "gaussian" and self.value_bits != 4:
            raise ValueError("the gaussian grid is a grid of 4-bit values")

    @property
    def quantized(self) -> bool:
        """Whether entries hold codes and scales (not the K/V itself)."""
        return self.key_bits > 0

    @property
    def codes_name(self) -> str:
        """Name of the codes tensor of an entry (``kv`` for ``none``; the version after 1)."""
        if not self.quantized:
            return "kv"
        return f"kv.{self.name}" if self.version == 1 else f"kv.{self.name}.v{self.version}"

    @property
    def scales_name(self) -> str:
        """Name of the scales tensor of an entry."""
        return f"{self.codes_name}.scales"

    def fingerprint(self, model_fingerprint: str) -> str:
        """Return the fingerprint segment keys are made with (the model's own for ``none``).

        Entries of another codec get other keys, so a reader never finds (let alone misreads)
        them; full-precision entries keep the keys they had before codecs existed.
        """
        if not self.quantized:
            return model_fingerprint
        mixed = f"{model_fingerprint}|kv-codec={self.name}/{self.version}"
        return hashlib.sha256(mixed.encode()).hexdigest()[:32]

    def layer_bytes(self, heads: int, tokens: int, head_dim: int) -> tuple[int, int]:
        """Code bytes and scale values of one layer of a ``tokens``-token entry."""
        key_bytes = heads * tokens * _packed(head_dim, self.key_bits)
        value_bytes = heads * tokens * _packed(head_dim, self.value_bits)
        return key_bytes + value_bytes, 2 * heads * head_dim + 2 * heads * tokens

    def stored_tensors(
        self, kv_dtype: torch.dtype, shape: tuple[int, ...]
    ) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """Name -> (dtype, shape) of what an entry of K/V ``shape`` holds under this codec."""
        if not self.quantized:
            return {"kv": (kv_dtype, tuple(shape))}
        layers, _, heads, tokens, head_dim = shape
        codes, scales = self.layer_bytes(heads, tokens, head_dim)
        return {
            self.codes_name: (torch.uint8, (layers, codes)),
            self.scales_name: (SCALE_DTYPE, (layers, scales)),
        }

    def bytes_per_token(self, heads: int, head_dim: int, tokens: int, kv_bytes: int = 2) -> float:
        """Return the stored bytes per token of a layer (codes and scales; ``kv_bytes``: none's)."""
        if not self.quantized:
            return 2 * heads * head_dim * kv_bytes
        codes, scales = self.layer_bytes(heads, tokens, head_dim)
        return (codes + scales * SCALE_DTYPE.itemsize) / tokens

    @torch.inference_mode()
    def encode(self, kv: torch.Tensor) -> dict[str, torch.Tensor]:
        """Return the tensors an entry of ``kv`` ``[layers, 2, kv_heads, tokens, head_dim]`` holds.

        For ``none``, ``kv`` itself. The codes and scales are made on ``kv``'s device and
        returned contiguous there.
        """
        if not self.quantized:
            return {"kv": kv}
        if kv.dim() != 5 or kv.shape[1] != 2 or kv.shape[-1] % 2:
            raise ValueError(
                f"expected K/V [layers, 2, heads, tokens, even head_dim], got {list(kv.shape)}"
            )
        layers = kv.shape[0]
        keys, key_scale, key_min = _quantize(kv[:, 0], self.key_bits, dim=2)
        values = kv[:, 1].float()
        if self.rotate_values:
            values = values @ hadamard(kv.shape[-1], values.device)
        values, value_scale, value_min = _quantize(
            values, self.value_bits, dim=3, grid=self.value_grid
        )
        codes = torch.cat([keys.reshape(layers, -1), values.reshape(layers, -1)], dim=1)
        scales = torch.cat(
            [t.reshape(layers, -1) for t in (key_scale, key_min, value_scale, value_min)], dim=1
        )
        return {self.codes_name: codes, self.scales_name: scales}

    def open(self, tensors: Any, shape: tuple[int, ...], *, pin: bool = False) -> EncodedKV:
        """Return the `EncodedKV` of an entry's ``tensors`` whose K/V is ``shape``.

        Raises `ValueError` when the tensors are not this codec's for that shape. Scales become
        float32 here, once per entry (``pin``: in pinned host memory).
        """
        expected = self.stored_tensors(torch.uint8, shape)
        found = {}
        for name, (dtype, size) in expected.items():
            tensor = tensors.get(name) if hasattr(tensors, "get") else tensors[name]
            if tensor is None:
                raise ValueError(
                    f"the entry holds no {name!r}: not a {self.name} v{self.version} "
                    f"entry (it holds {', '.join(map(repr, tensors)) or 'nothing'})"
                )
            if tensor.dtype != dtype or tuple(tensor.shape) != size:
                raise ValueError(
                    f"stored tensor {name!r} is {tensor.dtype} {list(tensor.shape)}, the "
                    f"{self.name} codec needs {dtype} {list(size)}"
                )
            found[name] = tensor
        _, _, heads, tokens, head_dim = shape
        codes, scales = found[self.codes_name], found[self.scales_name]
        wide = torch.empty(
            scales.shape,
            dtype=torch.float32,
            device=scales.device,
            pin_memory=pin and scales.device.type == "cpu",
        )
        wide.copy_(scales)
        return EncodedKV(self, codes, wide, heads, tokens, head_dim)


#: Full precision: the engine's ``kv_dtype``, one tensor ``kv`` (the format before codecs).
NO_CODEC = KVCodec("none")
#: Every codec by name.
CODECS: dict[str, KVCodec] = {
    codec.name: codec
    for codec in (
        NO_CODEC,
        KVCodec("int8", 8, 8),
        KVCodec("k8v4", 8, 4, version=2, rotate_values=True, value_grid="gaussian"),
        KVCodec("int4", 4, 4),
    )
}

#: The 16 output levels of the Lloyd-Max quantizer of a unit Gaussian (Max, 1960, "Quantizing
#: for minimum distortion"), the positive half; the grid is them and their negatives, mapped
#: onto ``[0, 15]`` so the ends stay a slice's range as on the uniform grid.
LLOYD_MAX_16 = (0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6180, 2.0690, 2.7326)
GAUSSIAN_LEVELS = tuple(
    round((level / LLOYD_MAX_16[-1] + 1) * 7.5, 6)
    for level in (*(-x for x in reversed(LLOYD_MAX_16)), *LLOYD_MAX_16)
)


def hadamard(dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Return the orthonormal (and symmetric) Hadamard matrix values are turned by, float32.

    Sylvester's construction over blocks of the largest power of two dividing ``dim`` (all of
    it for 64 or 128), block-diagonal when ``dim`` is not a power of two.
    """
    return _hadamard(dim, str(device)).clone()


_HADAMARD: dict[tuple[int, str], torch.Tensor] = {}
_GRID_TABLES: dict[str, torch.Tensor] = {}


def _hadamard(dim: int, device: str) -> torch.Tensor:
    found = _HADAMARD.get((dim, device))
    if found is None:
        block = dim & -dim
        matrix = torch.ones(1, 1)
        while matrix.shape[0] < block:
            matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)])
        matrix = torch.block_diag(*[matrix / block**0.5] * (dim // block))
        found = _HADAMARD[(dim, device)] = matrix.to(device)
    return found


def _grid(device: torch.device) -> torch.Tensor:
    """Return the gaussian grid's levels, float32 on ``device``."""
    found = _GRID_TABLES.get(str(device))
    if found is None:
        found = _GRID_TABLES[str(device)] = torch.tensor(GAUSSIAN_LEVELS, device=device)
    return found


def _byte_pairs(device: torch.device) -> torch.Tensor:
    """``[256, 2]``: a code byte's low and high nibble as gaussian-grid levels."""
    key = f"pairs:{device}"
    found = _GRID_TABLES.get(key)
    if found is None:
        byte = torch.arange(256)
        levels = torch.tensor(GAUSSIAN_LEVELS)
        found = _GRID_TABLES[key] = torch.stack([levels[byte & 15], levels[byte >> 4]], 1).to(
            device
        )
    return found


def _pair_order_hadamard(dim: int, device: torch.device) -> torch.Tensor:
    """`hadamard` with its rows in the order a code byte's pairs decode: c, c + dim / 2, ...

    A value row decoded from ``[..., dim / 2, 2]`` pairs (reshaped, no copy) holds channel
    ``c`` then ``c + dim / 2``; this matrix takes such a row straight back to the K/V's values.
    """
    key = (dim, f"pairs:{device}")
    found = _HADAMARD.get(key)
    if found is None:
        half = dim // 2
        order = torch.stack([torch.arange(half), torch.arange(half) + half], 1).reshape(-1)
        found = _HADAMARD[key] = _hadamard(dim, str(device))[order.to(device)].contiguous()
    return found


def kv_codec(codec: str | KVCodec | None) -> KVCodec:
    """Return the codec ``codec`` names (None: ``none``); `ValueError` lists the names."""
    if codec is None:
        return NO_CODEC
    if isinstance(codec, KVCodec):
        return codec
    if isinstance(codec, str) and codec.strip().lower() in CODECS:
        return CODECS[codec.strip().lower()]
    raise ValueError(f"unknown KV codec {codec!r}; use one of {', '.join(CODECS)}")


def _packed(head_dim: int, bits: int) -> int:
    """Bytes of one row of ``head_dim`` codes of ``bits`` bits (0: not quantized)."""
    return head_dim if bits in (0, 8) else head_dim // 2


def _quantize(
    x: torch.Tensor, bits: int, dim: int, grid: str = "uniform"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes (packed), scale and minimum of ``x`` ``[layers, heads, tokens, head_dim]``.

    One range per slice along ``dim`` (2: per channel, over tokens; 3: per token, over
    channels). 8 bits: the slice's whole range. 4 bits: the range, shrunk about its middle by
    the factor of `CLIP_FACTORS` that gives the slice the least squared error (values outside it
    take the end codes: a few clipped outliers cost less than a coarser step for every value).
    The stored (float16) minimum and scale are rounded outwards, and codes are computed from
    them: decoding uses exactly the numbers the codes were rounded against. ``grid``
    ``"gaussian"`` (4 bits): codes pick the nearest of `GAUSSIAN_LEVELS` instead of an even step.
    """
    levels = (1 << bits) - 1
    table = _grid(x.device) if grid == "gaussian" else None
    x = x.float()
    low = x.amin(dim=dim, keepdim=True).clamp(-_SCALE_MAX, _SCALE_MAX)
    high = x.amax(dim=dim, keepdim=True).clamp(-_SCALE_MAX, _SCALE_MAX)
    middle, half = (high + low) / 2, (high - low) / 2
    best: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    error = torch.empty(0)
    for factor in CLIP_FACTORS if bits < 8 else (1.0,):
        scale, minimum = _stored_range(middle - half * factor, middle + half * factor, levels)
        codes = _codes(x, scale, minimum, levels, table)
        if best is None:
            best = codes, scale, minimum
            if factor == CLIP_FACTORS[-1] or bits == 8:
                break
            error = _squared_error(x, codes, scale, minimum, dim, table)
            continue
        found = _squared_error(x, codes, scale, minimum, dim, table)
        better = found < error
        error = torch.where(better, found, error)
        best = (
            torch.where(better, codes, best[0]),
            torch.where(better, scale, best[1]),
            torch.where(better, minimum, best[2]),
        )
    assert best is not None
    codes, scale, minimum = best
    if bits == 4:
        half_dim = codes.shape[-1] // 2
        codes = codes[..., :half_dim] | (codes[..., half_dim:] << 4)
    return codes.contiguous(), scale, minimum


#: Shrink factors of a 4-bit range tried per slice (`_quantize`): 1.0 is the whole range.
CLIP_FACTORS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65)


def _stored_range(
    low: torch.Tensor, high: torch.Tensor, levels: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and minimum as stored (float16), rounded outwards so they cover ``[low, high]``."""
    minimum = low.to(SCALE_DTYPE)
    minimum = torch.where(
        minimum.float() > low, minimum.nextafter(minimum.new_tensor(-1e9)), minimum
    )
    span = ((high - minimum.float()) / levels).clamp(max=_SCALE_MAX)
    scale = span.to(SCALE_DTYPE)
    scale = torch.where(scale.float() < span, scale.nextafter(scale.new_tensor(1e9)), scale)
    return scale, minimum


def _codes(
    x: torch.Tensor,
    scale: torch.Tensor,
    minimum: torch.Tensor,
    levels: int,
    table: torch.Tensor | None = None,
) -> torch.Tensor:
    """Nearest codes of ``x`` against a stored scale and minimum (unpacked uint8).

    On the even grid (``table`` None) or on ``table``'s levels (in steps of ``scale``).
    """
    safe = torch.where(scale > 0, scale.float(), torch.ones_like(scale, dtype=torch.float32))
    steps = (x - minimum.float()) / safe
    if table is None:
        return steps.round_().clamp_(0, levels).to(torch.uint8)
    return torch.bucketize(steps, (table[1:] + table[:-1]) / 2).to(torch.uint8)


def _squared_error(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    minimum: torch.Tensor,
    dim: int,
    table: torch.Tensor | None = None,
) -> torch.Tensor:
    steps = codes if table is None else table[codes.int()]
    decoded = torch.addcmul(minimum.float(), steps, scale.float())
    return (decoded - x).square_().sum(dim=dim, keepdim=True)


@dataclass(frozen=True)
class EncodedKV:
    """A stored entry's codes and float32 scales, cut (by views) as its K/V tensor would be.

    What the blend loop places (`place`) instead of a K/V tensor. The codes and scales keep the
    entry's layout, every layer's bytes contiguous, so a group of layers is one range of each
    (`layers`, `move`: two copies per document to another device); `rows` and `heads` narrow
    what is decoded, as slices of the K/V tensor would.
    """

    codec: KVCodec
    codes: torch.Tensor  # uint8 [layers, code bytes of a layer], as stored
    scales: torch.Tensor  # float32 [layers, scale values of a layer]
    entry_heads: int  # the layout's KV heads, tokens and head_dim
    entry_tokens: int
    head_dim: int
    row_range: tuple[int, int] | None = None  # rows decoded (None: all)
    head_range: tuple[int, int] | None = None  # KV heads decoded (None: all)

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """The shape of the K/V it decodes to, ``[layers, 2, kv_heads, rows, head_dim]``."""
        first_head, stop_head = self.head_range or (0, self.entry_heads)
        first_row, stop_row = self.row_range or (0, self.entry_tokens)
        return (
            int(self.codes.shape[0]),
            2,
            stop_head - first_head,
            stop_row - first_row,
            self.head_dim,
        )

    @property
    def device(self) -> torch.device:
        """Where the codes are."""
        return self.codes.device

    def tensors(self) -> list[torch.Tensor]:
        """Return the tensors it reads: the codes and the scales."""
        return [self.codes, self.scales]

    def parts(self) -> tuple[torch.Tensor, ...]:
        """Return views of the keys' and values' codes, then their scales and minimums.

        Codes ``[layers, kv_heads, rows, bytes]``; keys' scale and minimum ``[layers, kv_heads,
        1, head_dim]``, values' ``[layers, kv_heads, rows, 1]``.
        """
        layers, heads, tokens, dim = (
            int(self.codes.shape[0]),
            self.entry_heads,
            self.entry_tokens,
            self.head_dim,
        )
        key_bytes = heads * tokens * _packed(dim, self.codec.key_bits)
        heads_cut = slice(*self.head_range) if self.head_range else slice(None)
        rows_cut = slice(*self.row_range) if self.row_range else slice(None)
        keys = self.codes[:, :key_bytes].view(layers, heads, tokens, -1)
        values = self.codes[:, key_bytes:].view(layers, heads, tokens, -1)
        split = (heads * dim, heads * dim, heads * tokens, heads * tokens)
        key_scale, key_min, value_scale, value_min = self.scales.split(split, dim=1)
        per_channel = (layers, heads, 1, dim)
        per_token = (layers, heads, tokens, 1)
        return (
            keys[:, heads_cut, rows_cut],
            values[:, heads_cut, rows_cut],
            key_scale.view(per_channel)[:, heads_cut],
            key_min.view(per_channel)[:, heads_cut],
            value_scale.view(per_token)[:, heads_cut, rows_cut],
            value_min.view(per_token)[:, heads_cut, rows_cut],
        )

    def rows(self, rows: slice) -> EncodedKV:
        """Rows ``rows`` (a slice of ints, no step) of what it decodes now."""
        first, stop, _ = rows.indices(self.shape[3])
        offset = self.row_range[0] if self.row_range else 0
        return replace(self, row_range=(offset + first, offset + max(first, stop)))

    def heads(self, heads: slice) -> EncodedKV:
        """KV heads ``heads`` (a slice of ints, no step) of what it decodes now."""
        first, stop, _ = heads.indices(self.shape[2])
        offset = self.head_range[0] if self.head_range else 0
        return replace(self, head_range=(offset + first, offset + max(first, stop)))

    def layers(self, first: int, stop: int) -> EncodedKV:
        """Layers ``[first, stop)``: one range of the codes and one of the scales (views)."""
        return replace(self, codes=self.codes[first:stop], scales=self.scales[first:stop])

    def __len__(self) -> int:
        return int(self.codes.shape[0])

    def is_pinned(self) -> bool:
        """Whether its tensors are in pinned host memory."""
        return self.device.type == "cpu" and self.codes.is_pinned() and self.scales.is_pinned()

    def place(self, target: torch.Tensor) -> None:
        """Decode into ``target`` ``[layers, 2, kv_heads, rows, head_dim]`` (a buffer's view).

        On ``target``'s device (`move` codes elsewhere there first). Each code is read once and
        its value written once, straight into ``target``: two ops (keys, values) when both are
        8-bit, four for 4-bit keys or values (each half's nibbles, then that half decoded).
        """
        keys, values, key_scale, key_min, value_scale, value_min = self.parts()
        _decode(target[:, 0], keys, key_scale, key_min, self.codec.key_bits)
        if self.codec.rotate_values:
            _decode_rotated(target[:, 1], values, value_scale, value_min)
        else:
            _decode(target[:, 1], values, value_scale, value_min, self.codec.value_bits)

    def decode(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Return the K/V it stands for, ``[layers, 2, kv_heads, rows, head_dim]``."""
        out = torch.empty(self.shape, dtype=dtype, device=self.device)
        self.place(out)
        return out

    def select(self, index: int) -> torch.Tensor:
        """Layer ``index``'s K/V ``[2, kv_heads, rows, head_dim]`` in float32 (decoded)."""
        return self.layers(index, index + 1).decode()[0]


def move(
    encoded: list[EncodedKV], device: torch.device, non_blocking: bool = False
) -> list[EncodedKV]:
    """Return copies of ``encoded`` on ``device``: codes and scales in one multi-tensor copy.

    What a layer group's documents cost to reach a GPU: their codes and scales as stored
    (every layer's bytes contiguous, so two ranges per document), from pinned host memory with
    ``non_blocking``.
    """
    sources = [tensor for item in encoded for tensor in item.tensors()]
    moved = [torch.empty(t.shape, dtype=t.dtype, device=device) for t in sources]
    if moved:
        torch._foreach_copy_(moved, sources, non_blocking=non_blocking)
    return [
        replace(item, codes=moved[2 * i], scales=moved[2 * i + 1]) for i, item in enumerate(encoded)
    ]


def _decode(
    target: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bits: int
) -> None:
    """``target = minimum + codes * scale`` (a 4-bit byte holds two channels: both halves)."""
    if bits == 8:
        torch.addcmul(minimum, codes, scale, out=target)
        return
    half = target.shape[-1] // 2
    per_channel = scale.shape[-1] > 1
    low_cut = slice(None, half) if per_channel else slice(None)
    high_cut = slice(half, None) if per_channel else slice(None)
    torch.addcmul(minimum[..., low_cut], codes & 15, scale[..., low_cut], out=target[..., :half])
    torch.addcmul(minimum[..., high_cut], codes >> 4, scale[..., high_cut], out=target[..., half:])


def _decode_rotated(
    target: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor
) -> None:
    """Values of 4-bit gaussian-grid codes of rotated values: ``(minimum + level * scale) H``.

    Each byte is looked up as its two levels (``[..., dim / 2, 2]``, read as one row by a view),
    scaled, and turned back by the Hadamard matrix with its rows in that order: four ops.
    """
    pairs = torch.nn.functional.embedding(codes.int(), _byte_pairs(codes.device))
    rows = torch.addcmul(minimum, pairs.view(*codes.shape[:-1], -1), scale)
    target.copy_(rows @ _pair_order_hadamard(target.shape[-1], rows.device))
