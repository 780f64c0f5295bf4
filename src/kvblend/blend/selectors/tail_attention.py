"""The probe's measure: how much each token adds to the attention output of the question.

`TailAttention` observes a probe pass: at every layer, the attention weight each query of the
prompt's uncached tail (`tail_rows`: the question and the template text after it) pays each key,
times the norm of that key's value, summed over heads and queries (`tail_attention`).
"""

from __future__ import annotations

import numpy as np
import torch

from kvblend.blend.adapter import ModelAdapter
from kvblend.blend.attention.rows import attention_mask
from kvblend.blend.types import COMPUTE, MOVED, to_device


def tail_rows(kinds: torch.Tensor | np.ndarray) -> np.ndarray:
    """Positions of the uncached tail: the computed tokens after the last moved one (host).

    In a RAG prompt that is the question and the template text after it, the part of the prompt
    the answer is generated from. ``kinds`` is on the host.
    """
    kinds = np.asarray(kinds)
    moved = np.flatnonzero(kinds == MOVED)
    start = int(moved[-1]) + 1 if moved.size else 0
    tail = np.flatnonzero(kinds[start:] == COMPUTE) + start
    return tail if tail.size else np.array([kinds.size - 1])


def tail_weights(
    decoder: ModelAdapter, queries: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Return the attention weight ``queries`` pay each key, per KV head: ``[kv_heads, tokens]``.

    ``queries`` are rotated ``[heads, rows, head_dim]``; ``keys`` (rotated) ``[kv_heads, tokens,
    head_dim]`` (GQA: query head ``h`` reads KV head ``h // groups``, as transformers'
    ``repeat_kv``); ``mask`` is the additive ``[groups * rows, tokens]`` causal (and
    sliding-window) mask of the queries' positions, one row per (head of the group, query).
    """
    kv_heads, _, head_dim = keys.shape
    grouped = queries.reshape(kv_heads, -1, head_dim)
    scores = torch.baddbmm(
        mask.to(keys.dtype), grouped, keys.transpose(1, 2), alpha=decoder.scaling
    )
    return scores.softmax(dim=-1, dtype=torch.float32).sum(dim=1)


def tail_attention(
    decoder: ModelAdapter,
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
) -> torch.Tensor:
    """How much each token contributes to the attention output of ``queries``: ``[tokens]``.

    The attention weight each query pays each key (`tail_weights`), times the norm of that
    key's value (the size of what it adds to the output: attention sinks take much weight and
    add little), summed over heads and queries. ``mask``: ``[rows, tokens]`` or per head of a
    group, as `tail_weights` takes it.
    """
    groups = queries.shape[0] // keys.shape[0]
    if mask.shape[0] == queries.shape[1] and groups > 1:
        mask = mask.repeat(groups, 1)
    norms = torch.linalg.vector_norm(values, dim=-1, dtype=torch.float32)
    return (tail_weights(decoder, queries, keys, mask) * norms).sum(dim=0)


class TailAttention:
    """A probe pass's observer: sums `tail_attention` of the tail rows over every layer.

    Each layer's share is added per KV head (one multiply-add), the heads summed once, when
    the scores are read.
    """

    def __init__(
        self, decoder: ModelAdapter, computed: np.ndarray, tail: np.ndarray, total: int
    ) -> None:
        self.decoder = decoder
        device = decoder.device
        local = np.searchsorted(computed, tail)  # the tail among the computed rows
        # None: the computed rows are the tail (a probe of the tail alone), nothing to select but
        # the rows before a compiled loop's padding
        self.local = None if local.size == computed.size else to_device(local, device)
        self.rows = int(local.size)
        kv_heads = decoder.shape.num_kv_heads
        self.by_head = torch.zeros(kv_heads, total, device=device, dtype=torch.float32)
        groups = decoder.shape.num_heads // kv_heads
        positions = to_device(tail, device)
        self.masks = {  # [groups * tail, total], made once per pass
            window: attention_mask(positions, 0, total, window, decoder.dtype).repeat(groups, 1)
            for window in set(decoder.windows)
        }

    @property
    def scores(self) -> torch.Tensor:
        """Each token's score ``[tokens]``, summed over the layers observed (on the device)."""
        return self.by_head.sum(dim=0)

    def observe(
        self, layer: int, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Add this layer's tail attention to the scores."""
        if self.local is None:  # a view: the rows past the tail are a bucket's padding
            tail_queries = queries.narrow(1, 0, self.rows)
        else:
            tail_queries = queries.index_select(1, self.local)
        mask = self.masks[self.decoder.windows[layer]]
        weights = tail_weights(self.decoder, tail_queries, keys, mask)
        norms = torch.linalg.vector_norm(values, dim=-1, dtype=torch.float32)
        self.by_head.addcmul_(weights, norms)
