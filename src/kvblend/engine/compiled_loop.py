"""How a blend pass runs its layer step: eagerly, or compiled once per shape bucket.

The step (`layer_step.layer_step`) is one pure function; the eager loop calls it as is. The
compiled loop is the same function under ``torch.compile(fullgraph=True)``: on CUDA with
``mode="reduce-overhead"`` (CUDA graphs). Compiling pays once per layer and shape, so shapes
are made few: the prompt's buffer is rounded up to a size bucket (`size_bucket`), and so are
the computed rows (padding rows read and write a scratch row past the prompt).

``KVBLEND_COMPILE=1`` forces the compiled loop, ``0`` the eager one; unset, the loop is eager
(compilation costs seconds per layer and bucket, more than it saves on a prefill).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .decoder import ModelAdapter
from .flex_rows import size_bucket
from .layer_step import layer_step
from .row_attention import use_flex

#: Environment variable forcing the compiled (``1``) or the eager (``0``) layer loop.
COMPILE_ENV = "KVBLEND_COMPILE"


@dataclass(frozen=True)
class StepRunner:
    """How the passes of one prompt run: the step function, attention kind and buffer size."""

    step: Callable[..., Any]
    flex: bool  # sparse rows attend with FlexAttention (else query chunks)
    length: int  # rows of the prompt's K/V buffer (the prompt's, or its bucket)
    compiled: bool = False


def step_runner(adapter: ModelAdapter, total: int) -> StepRunner:
    """Return the runner of a ``total``-token prompt on ``adapter``'s device."""
    device = adapter.device
    flex = use_flex(device, compiled=False)
    # FlexAttention is compiled per shape: on CUDA the buffer is a bucket's size
    length = size_bucket(total + 1) if flex and device.type == "cuda" else total
    return StepRunner(layer_step, flex, length)
