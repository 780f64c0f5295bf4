"""``attention``: recompute the reused tokens the question draws most from.

A probe pass computes only the uncached tokens (as ``reuse`` would) over the reused KV and
sums, over every layer, head and query of the prompt's uncached tail (the question and the
template text after it), how much each token contributes to the attention output
(`tail_attention`). The top ``recompute_ratio`` of the moved tokens by that score are recomputed
at every layer. The probe's KV (reused rows in place, already rotated) is the prefill's
starting point, so the cached KV is loaded and rotated once.
"""

from __future__ import annotations

import numpy as np
import torch

from ..blend_io import COMPUTE, MOVED, read_back, to_device
from ..decoder import Decoder
from ..row_attention import attention_mask
from .base import (
    CORRECTION,
    RECOMPUTE_RATIO,
    Selection,
    SelectionContext,
    Selector,
    Setting,
    non_negative_int,
    ratio,
    top_scoring,
)


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


def tail_attention(
    decoder: Decoder,
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
) -> torch.Tensor:
    """How much each token contributes to the attention output of ``queries``: ``[tokens]``.

    The attention weight each query pays each key, times the norm of that key's value (the
    size of what it adds to the output: attention sinks take much weight and add little),
    summed over heads and queries. ``queries`` are rotated ``[heads, rows, head_dim]``;
    ``keys`` (rotated) and ``values`` are ``[kv_heads, tokens, head_dim]`` (GQA: query head ``h``
    reads KV head ``h // groups``, as transformers' ``repeat_kv``); ``mask`` is the float32
    additive ``[rows, tokens]`` causal (and sliding-window) mask of the queries' positions.
    """
    kv_heads, total, head_dim = keys.shape
    groups = queries.shape[0] // kv_heads
    grouped = queries.reshape(kv_heads, groups * queries.shape[1], head_dim)
    if mask.shape[0] != grouped.shape[1]:  # one mask row per (head of the group, query)
        mask = mask.repeat(groups, 1)
    scores = torch.baddbmm(
        mask.to(keys.dtype), grouped, keys.transpose(1, 2), alpha=decoder.scaling
    )
    weights = scores.softmax(dim=-1, dtype=torch.float32)
    norms = torch.linalg.vector_norm(values, dim=-1, dtype=torch.float32)
    return (weights.sum(dim=1) * norms).sum(dim=0)


class TailAttention:
    """A probe pass's observer: sums `tail_attention` of the tail rows over every layer."""

    def __init__(self, decoder: Decoder, computed: np.ndarray, tail: np.ndarray, total: int):
        self.decoder = decoder
        device = decoder.device
        local = np.searchsorted(computed, tail)  # the tail among the computed rows
        self.local = to_device(local, device)
        self.scores = torch.zeros(total, device=device, dtype=torch.float32)
        groups = decoder.shape.num_heads // decoder.shape.num_kv_heads
        positions = to_device(tail, device)
        self.masks = {  # [groups * tail, total], made once per pass
            window: attention_mask(positions, 0, total, window, decoder.dtype).repeat(groups, 1)
            for window in set(decoder.windows)
        }

    def observe(
        self, layer: int, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Add this layer's tail attention to the scores."""
        tail_queries = queries.index_select(1, self.local)
        mask = self.masks[self.decoder.windows[layer]]
        self.scores.add_(tail_attention(self.decoder, tail_queries, keys, values, mask))


def leading_rows(context: SelectionContext, count: int, short: int = 0) -> np.ndarray:
    """Boolean ``[tokens]`` (host): the first ``count`` rows of every moved span.

    Every row of a moved span of at most ``short`` rows.
    """
    lead = np.zeros(context.kinds.numel(), dtype=bool)
    for span in context.spans:
        if span.kind == MOVED:
            rows = span.end - span.start if span.end - span.start <= short else count
            lead[span.start : min(span.end, span.start + rows)] = True
    return lead


class AttentionSelector(Selector):
    """Recompute the top ``recompute_ratio`` of moved tokens by the probe's tail attention.

    ``min_recompute`` sets a floor under that budget, the leading rows below included: a prompt
    of few moved tokens (five retrieved passages) gets a larger share of them recomputed, while
    a long prompt, whose share is larger than the floor, keeps ``recompute_ratio``.

    With ``lead_tokens``, the first tokens of every moved document are recomputed too (they
    saw only the document head when cached and act as the document's attention sink; a short
    document's answer depends on them most), on top of the ratio's budget.

    When the blend would compute more than ``full_above`` of a full prefill's tokens, probe
    included (short documents, such as a few one-line records), the whole prompt is computed
    instead: such a blend is no faster than full prefill, and the few rows it leaves stale
    still cost quality.
    """

    name = "attention"
    settings = {
        "recompute_ratio": RECOMPUTE_RATIO,
        "min_recompute": Setting(
            256, non_negative_int, "moved tokens recomputed at least, leading ones included"
        ),
        "lead_tokens": Setting(8, non_negative_int, "leading tokens of each moved document"),
        "short_document": Setting(
            32, non_negative_int, "moved documents of at most this many tokens are recomputed whole"
        ),
        "full_above": Setting(
            0.7, ratio, "compute above which the whole prompt is computed (1: never)"
        ),
        "correction": CORRECTION,
    }

    def select(self, context: SelectionContext) -> Selection:
        """Run the probe and pick the moved rows scoring most."""
        # Every count here is on the host (numpy): the decision costs no device sync.
        kinds = context.kinds.numpy()
        uncached = context.uncached.numpy()
        lead = leading_rows(context, self.options["lead_tokens"], self.options["short_document"])
        computed = uncached | lead
        moved = context.moved.numpy()
        candidates = moved[~lead[moved]]  # moved rows not recomputed already
        share = round(self.options["recompute_ratio"] * moved.size)
        floor = self.options["min_recompute"] - (moved.size - candidates.size)  # leads count
        keep = min(max(share, floor), candidates.size)
        probe = int(uncached.sum()) if 0 < keep < candidates.size else 0
        full_above = self.options["full_above"]
        if keep == candidates.size or (
            full_above < 1 and int(computed.sum()) + keep + probe > full_above * kinds.size
        ):  # every moved row, or a blend that would cost about as much as full prefill
            computed[moved] = True
            return Selection(torch.from_numpy(np.flatnonzero(computed)))
        if not probe:  # nothing to choose (ratio 0): no probe
            return Selection(torch.from_numpy(np.flatnonzero(computed)))
        probe_rows = np.flatnonzero(uncached)
        observer = TailAttention(context.decoder, probe_rows, tail_rows(kinds), kinds.size)
        start = context.run_pass(torch.from_numpy(probe_rows), observer)
        # the one host sync of the prefill: the rows chosen on the device
        computed[read_back(top_scoring(observer.scores, candidates, keep))] = True
        self.scores = observer.scores
        return Selection(torch.from_numpy(np.flatnonzero(computed)), start=start)
