"""How a blend pass runs its layer step: eagerly, or compiled once per layer and shape bucket.

The step (`layer_step.layer_step`) is one pure function; the eager loop calls it as it is. The
compiled loop is the same function under ``torch.compile(fullgraph=True, dynamic=False)``, on
CUDA with ``mode="reduce-overhead"`` (CUDA graphs): one graph per layer (the model's weights of
each layer are its own inputs) and per shape, so shapes are made few. The prompt's K/V buffer
is a size bucket long (`size_bucket` of the prompt plus one row, where the correction's padding
rows add nothing that is read), and the computed rows are padded to a size bucket with copies
of the last row (the prompt's last token): computed like it, they write the same K/V at its
position and attend like it, and the last row keeps a fixed index. Every size inside the step
is then a bucket's, never the prompt's, and a new prompt of the same buckets runs the graphs
already made (`tests/blend/test_compiled_loop.py` counts dynamo's compilations).

``KVBLEND_COMPILE=1`` forces the compiled loop, ``0`` the eager one; unset, the loop is eager:
compiling costs seconds per layer and bucket, far more than the step's launches cost on one
prefill, and on the CPU the compiled step was not faster (docs/benchmarks.md). On CUDA, sparse
rows attend with FlexAttention in both loops; the eager loop compiles that kernel alone (per
bucket), so its buffer is a bucket long too.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from kvblend.blend.adapter import ModelAdapter
from kvblend.blend.attention import use_flex
from kvblend.blend.flex import size_bucket
from kvblend.blend.layer_step import layer_step

#: Environment variable forcing the compiled (``1``) or the eager (``0``) layer loop.
COMPILE_ENV = "KVBLEND_COMPILE"

#: Graphs dynamo may keep of the step: one per layer, mode and shape bucket in use.
RECOMPILE_LIMIT = 4096


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
    """Let dynamo keep a graph per layer (its default limit is 8 per function)."""
    config: Any = torch._dynamo.config
    with config.patch(recompile_limit=RECOMPILE_LIMIT, accumulated_recompile_limit=RECOMPILE_LIMIT):
        yield


def compiled_step(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """`layer_step` compiled for the device of its hidden states (``args`` as `layer_step`'s)."""
    with _graphs_kept():
        return _compiled_step(args[3].device.type)(*args)


@dataclass(frozen=True)
class StepRunner:
    """How the passes of one prompt run: the step function, attention kind and buffer size."""

    step: Callable[..., Any]
    flex: bool  # sparse rows attend with FlexAttention (else query chunks)
    length: int  # rows of the prompt's K/V buffer (the prompt's, or its bucket)
    compiled: bool = False

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


def step_runner(adapter: ModelAdapter, total: int) -> StepRunner:
    """Return the runner of a ``total``-token prompt on ``adapter``'s device."""
    device = adapter.device
    if compile_loop():
        return StepRunner(compiled_step, True, size_bucket(total + 1), compiled=True)
    flex = use_flex(device, compiled=False)
    # FlexAttention's kernel is compiled per shape: on CUDA the buffer is a bucket long
    length = size_bucket(total + 1) if flex and device.type == "cuda" else total
    return StepRunner(layer_step, flex, length)
