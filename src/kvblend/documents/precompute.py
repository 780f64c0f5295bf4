"""Document precompute: the KV of many documents from one full pass of the blend loop per batch.

Ingesting a corpus one document at a time runs the model over a single short sequence per
call: on a GPU most of the device idles, on a CPU every layer's matrix products are small.
Here documents are sorted by length, grouped so that ``batch x longest`` stays within a token
budget (`length_batches`), right-padded to the longest one and run through the blend loop
together (`document_kv`): the loop's full pass over ``batch x longest`` rows, each sequence at
positions ``0..longest-1`` and attending to its own rows only (`BlendInput.sequences`). The
model is driven through its adapter (`kvblend.blend.adapter.ModelAdapter`) as for any prompt,
so transformers' modules and vLLM's precompute alike.

Why this is exact: every document starts at row 0 and position 0 of its sequence, and the
padding comes after its last token. With causal attention a real token attends only to the
tokens before it, all real, so its rows equal those of the document computed alone (up to
the rounding of differently sized matrix products); padded rows are computed and discarded.
Sliding-window layers add the window to the same mask, which is identical for every sequence
because every document's positions are 0..n-1.

Keys are returned before RoPE, as the store keeps them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvblend.blend.adapter import ModelAdapter
from kvblend.blend.config import BlendConfig
from kvblend.blend.loop import Pause
from kvblend.blend.prefill import run_blend
from kvblend.blend.types import COMPUTE, BlendInput

__all__ = ["DEFAULT_BATCH_TOKENS", "document_kv", "length_batches"]

#: Token budget of one batch, counted as ``documents x longest document`` (padding included).
#: On a CPU the budget hardly matters: one 512-token document already keeps the matrix products
#: at full speed, and batches of 2K to 8K tokens ran at the same documents/s (docs/benchmarks.md,
#: "Document ingestion"). On a GPU a batch fills the device that one document leaves idle; 4K
#: tokens keep a batch's activations small (``budget x intermediate_size`` values at the MLP).
DEFAULT_BATCH_TOKENS = 4096


def length_batches(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Group indices of ``lengths`` into batches, longest documents first.

    A batch holds consecutive documents in descending length order, as many as keep
    ``count x longest <= batch_tokens`` (at least one, so a document longer than the budget
    is a batch of its own). Sorting keeps padding small; the first batch is the most expensive,
    so running out of memory happens at once rather than at the end.
    """
    if batch_tokens < 1:
        raise ValueError(f"batch_tokens must be at least 1, got {batch_tokens}")
    order = sorted(range(len(lengths)), key=lambda index: lengths[index], reverse=True)
    batches: list[list[int]] = []
    for index in order:
        if batches:
            current = batches[-1]
            longest = lengths[current[0]]
            if (len(current) + 1) * longest <= batch_tokens:
                current.append(index)
                continue
        batches.append([index])
    return batches


@torch.inference_mode()
def document_kv(
    adapter: ModelAdapter,
    sequences: Sequence[Sequence[int]],
    starts: Sequence[int],
    dtype: torch.dtype,
    pad_id: int = 0,
    pause: Pause | None = None,
) -> list[torch.Tensor]:
    """Run ``sequences`` through the blend loop's full pass at once; return each one's entry.

    Entry ``i`` is sequence ``i``'s rows from ``starts[i]`` on (the document after its context)
    as the store keeps them: ``[layers, 2, kv_heads, tokens, head_dim]`` in ``dtype``, keys
    before RoPE, a contiguous tensor of its own. Several sequences are right-padded to the
    longest with ``pad_id`` and run as one batch (`BlendInput.sequences`); one runs alone, as
    any prompt does. ``pause``: called before each layer of the pass (a progress report).
    """
    if not sequences or not all(sequences):
        raise ValueError("document_kv needs at least one sequence and no empty one")
    batch, longest = len(sequences), max(len(sequence) for sequence in sequences)
    token_ids = torch.full((batch, longest), pad_id, dtype=torch.long)
    for row, sequence in enumerate(sequences):
        token_ids[row, : len(sequence)] = torch.as_tensor(sequence, dtype=torch.long)
    kinds = torch.full((batch * longest,), COMPUTE, dtype=torch.int8)
    prompt = BlendInput(token_ids.flatten(), kinds, [], sequences=batch)
    out = run_blend(adapter, prompt, BlendConfig("full").selector(), need_logits=False, pause=pause)
    entries = []
    for row, (sequence, start) in enumerate(zip(sequences, starts, strict=True)):
        rows = out.raw_rows(row * longest + start, row * longest + len(sequence))
        entries.append(rows.to(dtype, memory_format=torch.contiguous_format))
    return entries
