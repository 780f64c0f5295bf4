"""How a blend pass runs its layer step: eagerly, or compiled once per size bucket for all layers.

The step (`layer_step.layer_step`) is one pure function; the eager loop calls it as it is. The
compiled loop runs the same function under ``torch.compile(fullgraph=True, dynamic=False)``,
on CUDA with ``mode="reduce-overhead"`` (CUDA graphs), for every layer but a pass's last (its
logits row, or a probe's last K/V, run eagerly: one graph serves all the others). The layer
is not a constant of the graph: the step is given the model adapter of that one layer (its
``layer_adapters``, whose weights and buffers are the graph's inputs, as its layer 0), so one
graph serves every layer, and its window size is the only thing taken from the layer. The
graphs are few because the shapes are: the prompt's K/V buffer is a size bucket long
(`size_bucket` of the prompt plus one row, where the correction's padding rows add nothing
that is read), and the computed rows are padded to a size bucket with copies of the last row
(the prompt's last token): computed like it, they write the same K/V at its position and
attend like it, and the last row keeps a fixed index. Every size inside the step is then a
bucket's, never the prompt's, and a new prompt of the same buckets runs the graph already made:
one graph per (rows, buffer) bucket pair, correction on or off and window size
(`tests/blend/test_compiled_loop.py` counts dynamo's compilations). CUDA graphs record one
replay per layer of the graph (each layer's weights are at their own addresses), then replay it.

``KVBLEND_COMPILE=1`` forces the compiled loop, ``0`` the eager one; unset, the loop is eager:
compiling costs seconds per bucket, more than the step's launches cost on one prefill, and on
the CPU the compiled step was not faster (docs/benchmarks.md). On CUDA, sparse rows attend
with FlexAttention in both loops; the eager loop compiles that kernel alone (per
`flex.key_bucket` and `flex.query_bucket`), so its buffer is a key bucket long.
A compile the backend refuses never reaches the caller: whatever compiling a bucket's graph
raises (dynamo's recompile limit, a lowering or codegen the backend refuses, such as torch
2.11's CPU inductor with FlexAttention, a torch version that lacks something), or its first
run (`flex.PROVEN_RUNS`), that bucket's steps run eagerly from then on, logged once per kind
and counted (`flex.COMPILE_REFUSALS`, ``stats.uncompiled_calls``). A step writes the layer's
K/V in place (the fresh rows, the correction's shift), so an untrusted run first keeps a copy
of the layer's K/V and a run that fails halfway puts it back before the eager step runs from
the same inputs: the answer is the eager loop's.
"""

from __future__ import annotations

import contextlib
import functools
import os
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from kvblend.blend.adapter import ModelAdapter
from kvblend.blend.attention import flex
from kvblend.blend.attention.flex import BLOCK, PROVEN_RUNS, compiled_flex, key_bucket, size_bucket
from kvblend.blend.attention.rows import use_flex
from kvblend.blend.layer_step import FULL, layer_step

#: Environment variable forcing the compiled (``1``) or the eager (``0``) layer loop.
COMPILE_ENV = "KVBLEND_COMPILE"

#: Graphs dynamo may keep of the step: one per bucket pair, correction and window in use.
RECOMPILE_LIMIT = 256


def compile_loop() -> bool:
    """Whether the layer loop runs compiled (``KVBLEND_COMPILE``: ``1``, or ``0``/unset: eager).

    Any other value is refused with one line.
    """
    value = os.environ.get(COMPILE_ENV, "").strip() or "0"
    if value not in ("0", "1"):
        raise ValueError(f"{COMPILE_ENV} must be 0 or 1, got {value!r}")
    return value == "1"


@functools.cache
def _compiled_step(device_type: str) -> Callable[..., Any]:
    mode = "reduce-overhead" if device_type == "cuda" else None
    return torch.compile(layer_step, fullgraph=True, dynamic=False, mode=mode)


@contextlib.contextmanager
def _graphs_kept() -> Iterator[None]:
    """Let dynamo keep the step's graphs (its default limit is 8 per function)."""
    config: Any = torch._dynamo.config
    with config.patch(recompile_limit=RECOMPILE_LIMIT, accumulated_recompile_limit=RECOMPILE_LIMIT):
        yield


def step_bucket(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Return the bucket of a compiled step's graph for ``args`` (as `layer_step`'s).

    The sizes (a size bucket's), the mode, the layer's window, the model's shape, whether a
    correction runs (and its sizes) and the attention's own flags (`RowAttention.graph_key`).
    """
    view, index, mode, hidden, layer_kv, rows, _, correction, attention = args
    shapes = (
        None
        if correction is None
        else (*(tuple(t.shape) for t in correction[:-1]), correction.key_scale)
    )
    graph_key = getattr(attention, "graph_key", None)
    return (
        "step",
        hidden.device.type,
        hidden.dtype,
        type(view).__name__,
        view.shape,
        view.windows[index],
        mode,
        tuple(hidden.shape),
        tuple(layer_kv.shape),
        rows.numel(),
        shapes,
        graph_key() if graph_key is not None else type(attention).__name__,
    )


def compiled_step(*args: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`layer_step` compiled for the device of its hidden states (``args`` as `layer_step`'s).

    None when the compile of its bucket was refused (logged once, counted): the caller runs
    the step eagerly, from the same inputs (the layer's K/V as it was before the call).
    """
    device = args[3].device.type
    layer_kv: torch.Tensor = args[4]

    def call() -> tuple[torch.Tensor, torch.Tensor]:
        with _graphs_kept():
            out: tuple[torch.Tensor, torch.Tensor] = _compiled_step(device)(*args)
            return out

    def keep() -> Callable[[], Any]:
        kept = layer_kv.clone()
        return lambda: layer_kv.copy_(kept)

    bucket, layer = step_bucket(args), (id(args[0]), args[1])
    proven = PROVEN_RUNS.get(device, 1)
    return flex.COMPILE_REFUSALS.run("the compiled layer step", bucket, call, proven, keep, layer)


_VIEWS: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()


def layer_views(adapter: ModelAdapter) -> list[Any] | None:
    """Return the adapter of each layer alone (``adapter.layer_adapters()``, made once), or None.

    An adapter without them gets a graph per layer (its layer index is then a constant).
    """
    views = _VIEWS.get(adapter)
    if views is None:
        make = getattr(adapter, "layer_adapters", None)
        if make is None:
            return None
        views = _VIEWS[adapter] = make()
    return views


@dataclass
class StepRunner:
    """How the passes of one prompt run: attention kind, buffer size, compiled or not."""

    flex: bool  # sparse rows attend with FlexAttention (else query chunks)
    length: int  # rows of the prompt's K/V buffer (the prompt's, or its bucket)
    compiled: bool = False
    zero_to: int | None = None  # buffer rows past the prompt that must be zeros (None: all)
    uncompiled: int = 0  # steps run eagerly because their compile was refused

    @property
    def bucket(self) -> Callable[[int], int] | None:
        """The size bucket of the step's row counts (None: the eager loop's exact sizes)."""
        return size_bucket if self.compiled else None

    def begin(self, device: torch.device) -> None:
        """Start a pass: CUDA graphs may reuse the memory of the last pass's outputs."""
        if self.compiled and device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()

    def pad(
        self, positions: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pad computed rows to their size bucket when compiled: copies of the last row.

        A copy is computed exactly like the last row (the prompt's last token) and writes the
        same K/V there; the last row of the padded set stays the last token's, at a fixed index.
        """
        count = positions.numel()
        extra = size_bucket(count) - count if self.compiled else 0
        if extra == 0:
            return positions, hidden
        positions = torch.cat((positions, positions[-1:].expand(extra)))
        return positions, torch.cat((hidden, hidden[-1:].expand(extra, -1)))

    def step(
        self, adapter: ModelAdapter, layer: int, mode: str, *args: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run ``layer``'s step (`layer_step`; ``args`` after its mode): compiled or eagerly.

        Compiled: a `FULL` step, through the layer's own adapter where it has one (one graph for
        every layer); a pass's last layer runs eagerly.
        """
        if self.compiled and mode == FULL:
            views = layer_views(adapter)
            view, index = (adapter, layer) if views is None else (views[layer], 0)
            out = compiled_step(view, index, mode, *args)
            if out is not None:
                return out
            self.uncompiled += 1
        return layer_step(adapter, layer, mode, *args)


def step_runner(adapter: ModelAdapter, total: int) -> StepRunner:
    """Return the runner of a ``total``-token prompt on ``adapter``'s device."""
    device = adapter.device
    if compile_loop():
        return StepRunner(True, size_bucket(total + 1), compiled=True)
    flex_rows = use_flex(device, compiled=False)
    if flex_rows and compiled_flex(device):  # the kernel is compiled per shape: a key bucket long
        return StepRunner(flex_rows, key_bucket(total), zero_to=-(-total // BLOCK) * BLOCK)
    return StepRunner(flex_rows, total)
