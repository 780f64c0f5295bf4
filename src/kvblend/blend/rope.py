"""Rotary position embedding as the blend loop applies it: from the model's own ``cos``/``sin``.

The model adapter gives ``cos``/``sin`` of any positions (`ModelAdapter.rotary`, transformers'
convention ``x * cos + rotate_half(x) * sin``), so every RoPE variant a model declares
(default, linear, dynamic, ``llama3``, YaRN) is the model's. Here they become a table of 2x2
rotations per position (`rope_table`): rotating is one product and one sum, the same products
and sums as transformers' formula, so the result is bit for bit the same. The blend's K/V
buffer holds keys rotated to their prompt positions: a cached document's keys are rotated once
per prefill as they are placed (`rotate_` over a group of layers), a computed row's fresh key
as it is written. RoPE is linear and orthogonal, so a change of a rotated key is un-rotated
with the inverse table (`inverse_table`) of the same position.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

#: Rotations done at once, in elements of the rotated tensor: `rotate_` works on slices of at
#: most this size (its temporary holds twice as many: 32 MiB in float32), so rotating every
#: layer of a long prompt at once never needs much scratch memory.
ROTATE_SLICE = 1 << 22


def rope_table(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Return the rotation of every position as one table ``[tokens, 2, 2, head_dim // 2]``.

    Entry ``[t, i, m]`` multiplies input half ``m`` into output half ``i``, so `rotate` is one
    product and one sum: the same products and sums as transformers' ``apply_rotary_pos_emb``
    (``x * cos + rotate_half(x) * sin``), so the result is bit for bit the same.
    """
    half = cos.shape[-1] // 2
    blocks = (cos[..., :half], -sin[..., :half], sin[..., half:], cos[..., half:])
    return torch.stack(blocks, dim=-2).unflatten(-2, (2, 2))


def inverse_table(table: torch.Tensor) -> torch.Tensor:
    """Return the `rope_table` of the inverse rotations (each 2x2 block transposed)."""
    return table.transpose(-3, -2).contiguous()


def rotate(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[..., tokens, head_dim]`` by a `rope_table` of its tokens (two ops).

    ``table`` broadcasts against ``x``'s leading dimensions: ``[tokens, 2, 2, half]`` for
    ``[heads, tokens, head_dim]``; ``table[:, None]`` for ``[tokens, heads, head_dim]``.
    """
    halves = x.unflatten(-1, (2, -1)).unsqueeze(-3)  # [..., tokens, 1, 2, half]
    return (halves * table).sum(dim=-2).flatten(-2)


def rotate_(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` in place (as `rotate`; ``x`` may be a view, e.g. the keys of a K/V buffer).

    A leading dimension is cut into slices of at most `ROTATE_SLICE` elements, so the
    temporary stays bounded; a tensor that small is one product and one sum.
    """
    first = x.shape[0]
    step = max(1, ROTATE_SLICE // max(1, x[:1].numel())) if x.dim() > 3 else first
    for begin in range(0, first, step):
        part = x[begin : begin + step]
        halves = part.unflatten(-1, (2, -1))
        products = halves.unsqueeze(-3) * table
        if torch.compiler.is_compiling():  # dynamo takes no strided ``out=`` (and fuses these)
            halves.copy_(products.sum(dim=-2))
        else:
            torch.sum(products, dim=-2, out=halves)
    return x


class RopeTables:
    """The `rope_table` of every row of a prompt's buffer, and its `inverse_table` (on use)."""

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table
        self._inverse: torch.Tensor | None = None

    @property
    def inverse(self) -> torch.Tensor:
        """The inverse rotations (made on first use: `BlendOutput.raw_kv`)."""
        if self._inverse is None:
            self._inverse = inverse_table(self.table)
        return self._inverse


def rope_tables(
    rotary: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    total: int,
    length: int,
    device: torch.device,
) -> RopeTables:
    """Return the `RopeTables` of a ``length``-row buffer for a ``total``-token prompt.

    ``rotary`` (the model adapter's) is asked for the prompt's positions only (a dynamic RoPE
    scales by the longest one, and a model may have no table past its context); the rows past
    them (a size bucket's) get zeros: no query reads them.
    """
    cos, sin = rotary(torch.arange(total, device=device))
    table = rope_table(cos, sin)
    if length > total:
        table = torch.cat((table, table.new_zeros(length - total, *table.shape[1:])))
    return RopeTables(table)
