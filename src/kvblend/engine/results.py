"""What a prefill returns: the logits, the fused KV cache and the statistics of what it did."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["BlendCancelledError", "BlendStats", "BlendUnavailableError", "PrefillResult"]


class BlendUnavailableError(RuntimeError):
    """The model failed kvblend's parity self-check, so blending would produce wrong text."""


class BlendCancelledError(RuntimeError):
    """A prefill was cancelled through its ``cancel`` event (checked between layers)."""


@dataclass
class BlendStats:
    """What a prefill did: token counts by origin and where the time went."""

    strategy: str
    prompt_tokens: int = 0
    reused_tokens: int = 0  # tokens whose KV came from a cache (prefix + moved - recomputed)
    prefix_tokens: int = 0
    moved_tokens: int = 0  # cached tokens placed at a new position
    recomputed_tokens: int = 0  # moved tokens recomputed through the last layer
    computed_tokens: int = 0  # uncached tokens, computed in full
    segments_cached: int = 0  # store entries read (documents and prefix)
    segments_precomputed: int = 0  # cache misses computed during this prefill
    documents_found: int = 0  # cached document segments in the prompt
    documents_reused: int = 0  # of those, how many had tokens read from their cache
    compute_fraction: float = 0.0  # token-layers computed / token-layers of a full prefill
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def recompute_fraction(self) -> float:
        """Recomputed share of the moved tokens."""
        return self.recomputed_tokens / self.moved_tokens if self.moved_tokens else 0.0


@dataclass
class PrefillResult:
    """Next-token logits after the prompt, the prompt's token ids and the fused KV cache."""

    logits: torch.Tensor  # [vocab] float32
    token_ids: list[int]
    stats: BlendStats
    keys: list[torch.Tensor] = field(repr=False)  # per layer [kv_heads, tokens, head_dim], rotated
    values: list[torch.Tensor] = field(repr=False)
