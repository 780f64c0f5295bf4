"""The parity self-check: kvblend's layer loop must reproduce the model's own forward pass.

`parity_error` runs one fixed text (`PARITY_TEXT`) through `run_blend` with strategy ``full``
(every token computed, nothing read from a cache) on any model adapter and returns the largest
difference of its last logits from the model's own forward's (``expected``), relative to the
largest logit. It is the one check both runtimes use: `BlendEngine` compares the loop with
transformers' forward (`forward_logits`) when built and logs an error above `parity_tolerance`
(`require_parity` then refuses every blend that reads a cache, rather than produce wrong text
from a model whose layers the loop does not reproduce); the vLLM connector's worker compares it
with vLLM's own forward and claims nothing unless it passes (`kvblend.vllm.execution.worker`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvblend.blend.adapter import ModelAdapter
from kvblend.blend.config import BlendConfig
from kvblend.blend.prefill import run_blend
from kvblend.blend.types import COMPUTE, BlendInput
from kvblend.errors import BlendUnavailableError

#: The text the self-check runs (any text would do; this one mixes words, digits and symbols).
PARITY_TEXT = (
    "Blended prefill must match the model's own forward pass: the quick brown fox jumps over "
    "the lazy dog, 0123456789."
)


def parity_tolerance(dtype: torch.dtype) -> float:
    """Largest relative logit error the check accepts: 1e-4 in float32, 6e-2 in 16-bit.

    In 16-bit two correct forwards differ by their kernels' rounding, which on a CPU without
    bfloat16 units (vLLM's CPU kernels there against kvblend's loop) is several times bfloat16's
    own; a model whose layers the loop gets wrong (RoPE at another base) is off by an order of
    magnitude more.
    """
    return 1e-4 if dtype == torch.float32 else 6e-2


def forward_logits(
    model: torch.nn.Module, ids: Sequence[int], device: torch.device
) -> torch.Tensor:
    """Float32 last logits ``[vocab]`` of a transformers model's own forward over ``ids``."""
    token_ids = torch.tensor([list(ids)], dtype=torch.long, device=device)
    with torch.inference_mode():
        return model(token_ids).logits[0, -1].float()


def parity_error(adapter: ModelAdapter, expected: torch.Tensor, ids: Sequence[int]) -> float:
    """Relative error of the blend loop's (``full``) last logits on ``adapter`` over ``ids``.

    ``expected``: the float32 last logits the model's own forward gives for the same ``ids``
    (transformers' `forward_logits`, or vLLM's forward for the connector).
    """
    token_ids = torch.tensor(list(ids), dtype=torch.long)
    kinds = torch.full((len(ids),), COMPUTE, dtype=torch.int8)
    got = run_blend(
        adapter, BlendInput(token_ids, kinds, []), BlendConfig("full").selector()
    ).logits
    assert got is not None
    expected = expected.to(got.device).float()
    return float((got - expected).abs().max() / expected.abs().max().clamp_min(1e-6))


def require_parity(error: float | None, dtype: torch.dtype, model_name: str) -> None:
    """Raise `BlendUnavailableError` when the self-check ran and failed (None: it did not run)."""
    if error is None:
        return
    tolerance = parity_tolerance(dtype)
    if not error <= tolerance:
        raise BlendUnavailableError(
            f"kvblend's layer loop does not reproduce {model_name}'s forward pass (relative "
            f"logit error {error:.3g} > {tolerance:g}); refusing to blend rather "
            "than produce wrong text. Please report the model and transformers version."
        )
