"""One layer of a blend pass, as the named steps of a model file: the loop's body.

`layer_step` is a pure function of its tensors (the model adapter's steps, RoPE, the
correction, attention), so the same function runs eagerly or compiled (`compiled.py`, given
one layer's own adapter as its layer 0: the layer index is then no constant of the graph, and
the window size of a layer is read from the adapter, never from an index into the model):

1. `write_fresh`: project the computed rows (keys and values in one product), rotate their
   queries and keys to their positions, move the stale cached rows by the correction
   (`correction.py`) and write the fresh K/V over their rows (one op);
2. `attend_and_mlp`: the computed rows attend over the layer's whole K/V (`attention/`),
   then ``o_proj``, the residual and the MLP; on the last layer, when only the logits are
   needed, the last row alone (`last_row`).

A pass's first layers may stop after step 1 (``WRITE``: a probe's last layer, whose K/V is
all that is kept).

On the CPU the loop runs a layer on one thread (`threads.small_ops`); here the adapter's
matmuls, and the RoPE and writes of many rows, get every thread back when their work pays for
it (`threads.big`: a no-op inside a compiled step).
"""

from __future__ import annotations

from typing import Any

import torch

from kvblend.blend.adapter import ModelAdapter
from kvblend.blend.correction import CorrectionTensors, apply_correction
from kvblend.blend.op_threads import ELEMENT_WORK, big
from kvblend.blend.rope import rotate, rotate_

#: What a step does after writing the layer's K/V: attention and MLP of every computed row
#: (``FULL``), of the last row only (``LAST``, for the logits), or nothing (``WRITE``).
FULL, LAST, WRITE = "full", "last", "write"


def write_fresh(
    adapter: ModelAdapter,
    layer: int,
    hidden: torch.Tensor,
    layer_kv: torch.Tensor,
    rows: torch.Tensor,
    row_table: torch.Tensor,
    correction: CorrectionTensors | None,
) -> torch.Tensor:
    """Step 1: write the computed rows' fresh K/V (keys rotated); return their rotated queries.

    ``layer_kv``: the layer's ``[2, kv_heads, length, head_dim]`` K/V (written in place).
    """
    with big(matmul_work(hidden)):  # queries, keys and values: about one width's products
        queries, fresh = adapter.project_rows(layer, hidden)
    moved = 0 if correction is None else correction.moved.numel()  # rows the correction moves
    with big((queries.numel() + (fresh.shape[0] + moved) * fresh[0].numel()) * ELEMENT_WORK):
        queries = rotate(queries, row_table)
        rotate_(fresh[:, 0], row_table.unsqueeze(1))
        if correction is not None:  # before the fresh K/V overwrite the cached ones
            apply_correction(correction, layer_kv, fresh)
        layer_kv.index_copy_(2, rows, fresh.permute(1, 2, 0, 3))
    return queries


#: `matmul_work` units of ``o_proj`` and the MLP: 1 + 3 x intermediate / hidden (SmolLM2 and
#: Qwen2.5: 2.7; Llama-3.1-8B: 3.5), taken low.
MLP_WORK = 8


def matmul_work(hidden: torch.Tensor) -> int:
    """Return the multiply-adds of projecting ``hidden`` ``[rows, width]`` to its own width.

    A lower bound of an adapter step's work (its projections, its MLP).
    """
    rows, width = hidden.shape
    return int(rows) * int(width) * int(width)


def attend_and_mlp(
    adapter: ModelAdapter,
    layer: int,
    hidden: torch.Tensor,
    queries: torch.Tensor,
    layer_kv: torch.Tensor,
    attention: Any,
) -> torch.Tensor:
    """Step 2: the computed rows attend over the whole patched K/V, then the MLP."""
    attended = attention(adapter.windows[layer], queries, layer_kv[0], layer_kv[1])
    with big(matmul_work(hidden) * MLP_WORK):  # o_proj and the MLP
        hidden = hidden + adapter.attention_output(layer, attended)
        return adapter.feed_forward(layer, hidden)


def last_row(
    adapter: ModelAdapter,
    layer: int,
    hidden: torch.Tensor,
    queries: torch.Tensor,
    layer_kv: torch.Tensor,
    attention: Any,
) -> torch.Tensor:
    """Step 2 of the last layer for the logits: the last computed row (the last token) only.

    The other rows' K/V are written already and only this row's output feeds the logits.
    """
    attended = attention.last_row(adapter.windows[layer], queries[:, -1:], layer_kv[0], layer_kv[1])
    return adapter.feed_forward(layer, hidden[-1:] + adapter.attention_output(layer, attended))


def layer_step(
    adapter: ModelAdapter,
    layer: int,
    mode: str,
    hidden: torch.Tensor,
    layer_kv: torch.Tensor,
    rows: torch.Tensor,
    row_table: torch.Tensor,
    correction: CorrectionTensors | None,
    attention: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run one layer over the computed ``rows``; return the new hidden states and the queries.

    ``mode``: `FULL`, `LAST` or `WRITE`. The last of ``rows`` is the prompt's last token.
    """
    queries = write_fresh(adapter, layer, hidden, layer_kv, rows, row_table, correction)
    if mode == FULL:
        hidden = attend_and_mlp(adapter, layer, hidden, queries, layer_kv, attention)
    elif mode == LAST:
        hidden = last_row(adapter, layer, hidden, queries, layer_kv, attention)
    return hidden, queries
