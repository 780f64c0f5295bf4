"""The model adapter protocol: what the blend loop may call on a model, and nothing else.

The blend loop (`loop.py` and the modules it uses: `layer_step.py`, `attention/`,
`correction.py`, `kv_buffer.py`, `selectors/`) drives a model through these members only, so one
loop serves two back-ends: `kvblend.models.decoder.Decoder` over a transformers model, and
`kvblend.vllm.execution.adapter.VLLMAdapter` over the modules vLLM loaded. Attention itself
(SDPA or FlexAttention over the loop's own K/V buffer, with the exact causal mask of the computed
rows) and RoPE (from ``rotary``'s tables) are the loop's job, not the adapter's. Every member is
a pure function of its inputs, so the loop may run a layer's steps compiled
(``KVBLEND_COMPILE=1``).

Layouts, one prompt at a time: hidden states ``[rows, hidden]``; queries
``[heads, rows, head_dim]``; keys and values ``[kv_heads, rows, head_dim]`` (under tensor
parallelism, the heads of this rank: `reduce_scores` makes selection scores the same on every
rank). Keys are always returned un-rotated; ``rotary`` gives the model's own RoPE tables in
transformers' convention (``x * cos + rotate_half(x) * sin``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

__all__ = ["DecoderShape", "ModelAdapter", "rms_norm"]


@dataclass(frozen=True)
class DecoderShape:
    """The sizes of a decoder that caches and the store depend on."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_positions: int


class ModelAdapter(Protocol):
    """The per-layer steps of one decoder model, pure functions of their inputs."""

    shape: DecoderShape
    windows: list[int | None]  # sliding window per layer (None: full attention)
    scaling: float  # attention's softmax scale
    has_qk_norm: bool

    @property
    def device(self) -> torch.device:
        """Device of the model's weights."""
        ...

    @property
    def dtype(self) -> torch.dtype:
        """Compute dtype of the model's weights."""
        ...

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Return token embeddings ``[tokens, hidden]``."""
        ...

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the model's RoPE ``cos`` and ``sin`` ``[tokens, head_dim]`` at ``positions``."""
        ...

    def project_rows(self, layer: int, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return queries ``[heads, rows, head_dim]`` and K/V ``[rows, 2, kv_heads, head_dim]``.

        Both un-rotated, after the input norm (and q/k norms where the model has them).
        """
        ...

    def project_kv(self, layer: int, hidden: torch.Tensor, *, keys: bool) -> torch.Tensor:
        """Return un-rotated keys (``keys=True``) or values ``[kv_heads, rows, head_dim]``."""
        ...

    def attention_output(self, layer: int, attended: torch.Tensor) -> torch.Tensor:
        """Apply ``o_proj`` to attended rows ``[rows, heads * head_dim]`` (all-reduced under TP)."""
        ...

    def feed_forward(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """Apply the residual MLP half: ``hidden + mlp(post_attention_norm(hidden))``."""
        ...

    def reduce_scores(self, scores: torch.Tensor) -> torch.Tensor:
        """Return per-token selection scores ``[tokens]`` summed over every rank's heads.

        A selector scores tokens from the heads it sees; under tensor parallelism those are one
        rank's, so the scores are summed across the ranks (one all-reduce) and every rank
        chooses the same rows. Without it, the scores as they are. Called once per selection.
        """
        ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Return float32 next-token logits ``[vocab]`` of the last row of ``hidden``."""
        ...


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as the supported families compute it, in as few ops as torch allows.

    ``weight * (x * rsqrt(mean(x^2) + eps))`` in float32, cast back to ``x``'s dtype before the
    weight: transformers' Llama/Mistral/Qwen RMSNorm in five ops, and vLLM's native one when the
    weight has ``x``'s dtype. ``F.rms_norm`` is one op with the same arithmetic; in float32 the
    weight is fused into it too. Both adapters call it for a plain RMSNorm module.
    """
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)
