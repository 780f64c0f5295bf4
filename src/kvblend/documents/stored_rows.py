"""Rows of one stored segment's KV, read a layer at a time, recomputed if the read fails.

`StoredRows` is what the blend loop reads a cached span from (`kvblend.documents.blend_plan`
makes them): views into the tensor a store handed out, which the loop only ever copies out of,
or, for an entry of a quantized codec, views into its codes and scales (`EncodedKV`), which the
loop decodes as it places them (`kvblend.blend.kv_codec`). The shape is checked again as it is
used, so a store that ignores the expected shape still never feeds a wrong-shaped tensor to
the model.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import torch

from kvblend.blend.kv_codec import NO_CODEC, EncodedKV, KVCodec
from kvblend.prompt.segments import KV_NAME

logger = logging.getLogger(__name__)

__all__ = ["StoredRows"]


class StoredRows:
    """Rows of a store entry (`SegmentKV.entry_shape`), read a layer at a time.

    ``layers()`` is a view into the stored tensor, never a copy: the caller only reads it; for
    a quantized ``codec``, views into the stored codes and scales (an `EncodedKV`, decoded as
    the loop places it). ``heads``: only these KV heads (a tensor-parallel rank's). A lazy entry
    reads its tensors when the blend loop first asks for a layer (on CUDA, a tensor is handed
    out once the current stream is ordered after its copy: `kvblend.store.transfer`); if that
    read fails, whatever the store raised, ``recompute`` produces the segment's KV instead (and
    stores it again).
    """

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        rows: slice,
        recompute: Callable[[], Mapping[str, torch.Tensor]],
        expected: tuple[torch.dtype, tuple[int, ...]] | None = None,
        codec: KVCodec = NO_CODEC,
        heads: slice | None = None,
    ) -> None:
        self.tensors = tensors
        self.rows = rows
        self.expected = expected  # dtype and shape of the entry's K/V (every head), when known
        self.codec = codec
        self.heads = heads
        self.recomputed = False  # True once a failed read made this segment be computed anew
        self._recompute: Callable[[], Mapping[str, torch.Tensor]] | None = recompute
        self._kv: torch.Tensor | EncodedKV | None = None  # the rows of every layer, once read

    def layer(self, index: int) -> torch.Tensor:
        """Return layer ``index``'s un-rotated K/V ``[2, kv_heads, rows, head_dim]``.

        A view of the stored tensor; for a quantized codec, the layer decoded (float32).
        """
        kv = self.layers()
        return kv.select(index) if isinstance(kv, EncodedKV) else kv[index]

    def layers(self) -> torch.Tensor | EncodedKV:
        """Return every layer's K/V ``[layers, 2, kv_heads, rows, head_dim]``, or its codes.

        A view of the stored tensor, or, for part of an entry kept in pinned host memory, a
        contiguous pinned copy of that part (made once): a copy to the GPU from a strided
        host view would go through pageable memory and block the host. Codes are handed out
        whole (`EncodedKV` decodes only the rows asked for), so they are never copied here.
        """
        if self._kv is None:
            kv = self._open()
            if isinstance(kv, EncodedKV):  # whole layers' bytes stay contiguous: no copy
                self._kv = kv.rows(self.rows)
                return self._kv
            rows = kv[:, :, :, self.rows]
            if kv.device.type == "cpu" and not rows.is_contiguous() and kv.is_pinned():
                rows = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True).copy_(rows)
            self._kv = rows
        return self._kv

    def _open(self) -> torch.Tensor | EncodedKV:
        try:
            return self._read()
        except Exception as error:  # noqa: BLE001 - any failure to read stored KV is recomputed
            if self._recompute is None:
                raise
            logger.warning("stored KV unreadable mid-prompt, recomputing the segment: %s", error)
            self.tensors, self._recompute = self._recompute(), None
            self.recomputed = True
            return self._read()

    def _read(self) -> torch.Tensor | EncodedKV:
        if self.codec.quantized:
            return self._read_encoded()
        kv = self.tensors[KV_NAME]
        if self.expected is not None and (kv.dtype, tuple(kv.shape)) != self.expected:
            raise ValueError(
                f"stored tensor {KV_NAME!r} is {kv.dtype} {list(kv.shape)}, the model needs "
                f"{self.expected[0]} {list(self.expected[1])}"
            )
        return kv[:, :, self.heads] if self.heads is not None else kv

    def _read_encoded(self) -> EncodedKV:
        if self.expected is None:  # codes are [layers, bytes]: the K/V shape must be given
            raise ValueError(f"the {self.codec.name} codec needs the entry's K/V shape")
        codes = self.tensors[self.codec.codes_name]
        pin = codes.device.type == "cpu" and torch.cuda.is_available() and codes.is_pinned()
        kv = self.codec.open(self.tensors, self.expected[1], pin=pin)
        return kv.heads(self.heads) if self.heads is not None else kv
