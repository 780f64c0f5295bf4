"""Writing a blend's K/V into vLLM's paged KV cache, through the attention backend's own op.

vLLM's attention layers write their K/V with ``impl.do_kv_cache_update(layer, key, value,
kv_cache, slot_mapping)`` (FlashAttention's ``reshape_and_cache_flash`` on a GPU, the CPU
backend's ``cpu_attn_reshape_and_cache``; fp8 caches quantize there). The connector calls the
same method of each layer's own backend (`compat.write_kv`), so the cache layout, its dtype and
any quantization stay vLLM's business. A slot is ``block_id * block_size + offset`` for the
request's blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvblend.vllm.compat import write_kv

__all__ = ["slot_mapping", "write_rows"]


def slot_mapping(
    block_ids: Sequence[int], block_size: int, start: int, stop: int, device: torch.device
) -> torch.Tensor:
    """Return the cache slots of prompt positions ``start..stop-1`` of one request."""
    positions = torch.arange(start, stop)
    blocks = torch.tensor(list(block_ids), dtype=torch.long)
    if stop > start and int(positions[-1]) // block_size >= len(blocks):
        raise ValueError(f"{len(blocks)} blocks of {block_size} cannot hold position {stop - 1}")
    slots = blocks[positions // block_size] * block_size + positions % block_size
    return slots.to(device)


def write_rows(
    attention_layer: Any,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: int,
    stop: int,
    slots: torch.Tensor,
) -> None:
    """Write rows ``start..stop-1`` of one layer's rotated keys and values into vLLM's cache.

    ``keys`` / ``values`` are the blend's ``[kv_heads, tokens, head_dim]``; the backend takes
    ``[rows, kv_heads, head_dim]`` in the model's dtype (`compat.write_kv`).
    """
    key_rows = keys[:, start:stop].transpose(0, 1).contiguous()
    value_rows = values[:, start:stop].transpose(0, 1).contiguous()
    write_kv(attention_layer, key_rows, value_rows, slots)
