"""The parity self-check: kvblend's layer loop must reproduce the model's own forward pass.

`parity_error` runs one fixed text through the model's forward and through `run_blend` with
strategy ``full`` (every token computed, nothing read from a cache) and returns the largest
difference of their last logits, relative to the largest logit. `BlendEngine` runs it when built
and logs an error above `parity_tolerance`; `require_parity` then refuses every blend that reads
a cache, rather than produce wrong text from a model whose layers the loop does not reproduce.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvblend.blend.config import BlendConfig
from kvblend.blend.io import COMPUTE, BlendInput
from kvblend.blend.loop import run_blend
from kvblend.errors import BlendUnavailableError
from kvblend.models.decoder import Decoder

#: The text the self-check runs (any text would do; this one mixes words, digits and symbols).
PARITY_TEXT = (
    "Blended prefill must match the model's own forward pass: the quick brown fox jumps over "
    "the lazy dog, 0123456789."
)


def parity_tolerance(dtype: torch.dtype) -> float:
    """Largest relative logit error the check accepts: 1e-4 in float32, 3e-2 in 16-bit."""
    return 1e-4 if dtype == torch.float32 else 3e-2


def parity_error(model: torch.nn.Module, decoder: Decoder, ids: Sequence[int]) -> float:
    """Relative error of the blend loop's last logits against ``model``'s forward on ``ids``."""
    token_ids = torch.tensor(ids, dtype=torch.long)
    with torch.inference_mode():
        expected = model(token_ids[None].to(decoder.device)).logits[0, -1].float()
    kinds = torch.full((len(ids),), COMPUTE, dtype=torch.int8)
    got = run_blend(decoder, BlendInput(token_ids, kinds, []), BlendConfig("full")).logits
    assert got is not None
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
