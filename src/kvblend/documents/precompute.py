"""Batched document precompute: the KV of many documents from one forward pass per batch.

Ingesting a corpus one document at a time runs the model over a single short sequence per
call: on a GPU most of the device idles, on a CPU every layer's matrix products are small.
Here documents are sorted by length, grouped so that ``batch x longest`` stays within a token
budget, right-padded to the longest one and run through the decoder together with a plain
per-layer loop over `Decoder`'s steps.

Why this is exact: every document starts at row 0 and position 0 of its batch row, and the
padding comes after its last token. With causal attention a real token attends only to the
tokens before it, all real, so its rows equal those of the document computed alone (up to
the rounding of differently sized matrix products); padded rows are computed and discarded.
Sliding-window layers add the window to the same mask, which is identical for every row of the
batch because every document's positions are 0..n-1. Without a mask, attention is
``scaled_dot_product_attention(..., is_causal=True)`` with grouped KV heads, which runs on the
fused (flash) kernels on a GPU; with a window mask KV heads are expanded first, as transformers'
SDPA attention does, since a mask together with ``enable_gqa`` falls back to the math kernel.

Keys are returned before RoPE, as the store keeps them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kvblend.blend.rope import apply_rope, signed_sin
from kvblend.models.decoder import Decoder

__all__ = ["DEFAULT_BATCH_TOKENS", "forward_batch", "length_batches"]

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


def _batch_attention(
    decoder: Decoder,
    layer: int,
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
) -> torch.Tensor:
    """Causal attention of rotated ``[batch, heads, tokens, head_dim]`` inputs, after ``o_proj``.

    Returns ``[batch * tokens, hidden]``. Keys and values have the KV heads only (GQA).
    """
    batch, heads, tokens, head_dim = queries.shape
    window = decoder.windows[layer]
    grouped = heads != keys.shape[1]
    if window is None or tokens <= window:
        out = F.scaled_dot_product_attention(
            queries, keys, values, is_causal=True, scale=decoder.scaling, enable_gqa=grouped
        )
    else:
        positions = torch.arange(tokens, device=queries.device)
        offset = positions.unsqueeze(0) - positions.unsqueeze(1)  # key - query
        allowed = (offset <= 0) & (offset > -window)  # [tokens, tokens], same for every row
        if grouped:
            groups = heads // keys.shape[1]
            keys = keys.repeat_interleave(groups, dim=1)
            values = values.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=allowed, scale=decoder.scaling
        )
    # [batch, heads, tokens, head_dim] -> [batch * tokens, heads * head_dim]
    out = out.transpose(1, 2).reshape(batch * tokens, heads * head_dim)
    return decoder.attention_output(layer, out)


@torch.inference_mode()
def forward_batch(
    decoder: Decoder, sequences: Sequence[Sequence[int]], pad_id: int = 0
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Run right-padded ``sequences`` through every layer; return their keys and values.

    Returns, per layer, un-rotated keys and values ``[batch, kv_heads, longest, head_dim]``;
    row ``b`` holds sequence ``b`` at ``[:, :len(sequences[b])]``, the rest is padding.
    The last layer's attention and MLP are skipped (its KV is all that is kept).
    """
    if not sequences or not all(sequences):
        raise ValueError("forward_batch needs at least one sequence and no empty one")
    device = decoder.device
    batch, longest = len(sequences), max(len(sequence) for sequence in sequences)
    token_ids = torch.full((batch, longest), pad_id, dtype=torch.long)
    for row, sequence in enumerate(sequences):
        token_ids[row, : len(sequence)] = torch.as_tensor(sequence, dtype=torch.long)
    cos, sin = decoder.rotary(torch.arange(longest, device=device))
    sin = signed_sin(sin)
    # Rows of every document one after another: the projections and the MLP see one
    # [batch * tokens, hidden] matrix; only attention needs the batch dimension.
    hidden = decoder.embed(token_ids.to(device)).reshape(batch * longest, -1)
    keys_out: list[torch.Tensor] = []
    values_out: list[torch.Tensor] = []
    last_layer = decoder.shape.num_layers - 1
    for i in range(decoder.shape.num_layers):
        # [heads, batch * tokens, head_dim] -> [batch, heads, tokens, head_dim]
        queries, keys, values = (
            x.unflatten(1, (batch, longest)).transpose(0, 1) for x in decoder.project(i, hidden)
        )
        keys_out.append(keys)
        values_out.append(values)
        if i == last_layer:
            break
        attended = _batch_attention(
            decoder, i, apply_rope(queries, cos, sin), apply_rope(keys, cos, sin), values
        )
        hidden = decoder.feed_forward(i, hidden + attended)
    return keys_out, values_out
