"""vLLM's own forward pass over one short text, for the connector's parity gate.

The gate compares the blend loop (strategy ``full``, over `VLLMAdapter`) with what vLLM itself
computes for the same token ids: the model's ``forward`` and ``compute_logits``, with vLLM's
attention backend reading and writing the paged KV cache. It runs once, when the worker
registers its KV caches, before any request exists: the text's KV is written into the first
free blocks (block 0 is vLLM's null block), which hold nothing yet and are overwritten or zeroed
before any request reads them. The attention metadata comes from the backend's own metadata
builder, so the backend's layout and kernels are vLLM's business; any failure here (another
vLLM version, another backend) makes the gate fail closed: the connector then refuses to blend.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["vllm_logits"]


def _metadata(vllm_config: Any, group: Any, device: torch.device, tokens: int) -> tuple[Any, Any]:
    """Attention metadata of one prefill of ``tokens`` tokens, and its slot mapping."""
    from vllm.config import set_current_vllm_config
    from vllm.config.vllm import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.v1.attention.backend import CommonAttentionMetadata

    spec, names = group.kv_cache_spec, list(group.layer_names)
    layers = get_layers_from_vllm_config(vllm_config, Attention, names)
    backend = next(iter(layers.values())).get_attn_backend()
    block_size = int(spec.block_size)
    blocks = torch.arange(1, 1 + -(-tokens // block_size), dtype=torch.int32, device=device)
    positions = torch.arange(tokens, device=device)
    slots = (blocks.long()[positions // block_size] * block_size + positions % block_size).long()
    starts = torch.tensor([0, tokens], dtype=torch.int32)
    lengths = torch.tensor([tokens], dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=starts.to(device), query_start_loc_cpu=starts,
        seq_lens=lengths.to(device), num_reqs=1, num_actual_tokens=tokens,
        max_query_len=tokens, max_seq_len=tokens, block_table_tensor=blocks[None],
        slot_mapping=slots, causal=True, positions=positions,
        seq_lens_cpu_upper_bound=lengths, is_prefilling=torch.ones(1, dtype=torch.bool),
    )  # fmt: skip
    with set_current_vllm_config(vllm_config):
        builder = backend.get_builder_cls()(spec, names, vllm_config, device)
        metadata = builder.build(0, common)
    return {name: metadata for name in names}, {name: slots for name in names}


@torch.inference_mode()
def vllm_logits(
    model: Any, vllm_config: Any, kv_cache_config: Any, token_ids: Sequence[int]
) -> torch.Tensor:
    """Float32 next-token logits ``[vocab]`` vLLM's own forward gives after ``token_ids``."""
    from vllm.forward_context import set_forward_context

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise RuntimeError(f"the model has {len(groups)} KV cache groups; kvblend handles one")
    device = next(model.parameters()).device
    tokens = len(token_ids)
    metadata, slots = _metadata(vllm_config, groups[0], device, tokens)
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=device)
    positions = torch.arange(tokens, device=device)
    with set_forward_context(
        metadata, vllm_config, num_tokens=tokens, slot_mapping=slots, skip_compiled=True
    ):
        hidden = model(input_ids=ids, positions=positions)
    logits = model.compute_logits(hidden[-1:])
    if logits is None:
        raise RuntimeError("this tensor-parallel rank holds no logits")
    return logits[0].float()
