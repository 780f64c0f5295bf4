"""`VLLMAdapter`: the blend loop's model adapter over the modules vLLM loaded.

It implements `kvblend.blend.adapter.ModelAdapter` by calling vLLM's own modules of a Llama,
Mistral, Qwen2 or Qwen3 model (`compat.model_parts` reads them): the vocabulary-parallel
embedding, the RMSNorms, the fused ``qkv_proj`` (split as vLLM's attention splits it), q/k
norms, the rotary embedding's own ``cos_sin_cache``, ``o_proj`` and the MLP (row-parallel
layers, so their all-reduce is vLLM's), and ``compute_logits``. Nothing is copied or
re-implemented: weights, biases, RoPE scaling and quantized linear layers stay vLLM's. Under
tensor parallelism the heads are this rank's (``kv_heads``: which of a stored entry's), and
selection scores are summed over the ranks (`reduce_scores`, vLLM's public all-reduce), so
every rank blends the same rows with its own heads.
"""

from __future__ import annotations

import torch
from torch import nn

from kvblend.blend.adapter import DecoderShape, rms_norm
from kvblend.errors import UnsupportedModelError
from kvblend.models.decoder import SUPPORTED_FAMILIES
from kvblend.vllm.compat import ModelParts, Norm, model_parts

__all__ = ["VLLMAdapter", "rank_kv_heads"]


def checked_parts(model: nn.Module) -> ModelParts:
    """Return the model's parts, or refuse a model kvblend cannot run."""
    name = type(model).__name__
    try:
        parts = model_parts(model)
    except AttributeError as error:
        raise UnsupportedModelError(f"kvblend cannot blend vLLM model {name}: {error}") from None
    if parts.model_type not in SUPPORTED_FAMILIES:
        raise UnsupportedModelError(
            f"kvblend cannot blend vLLM model {name} (model type {parts.model_type!r}); "
            f"supported families: {', '.join(SUPPORTED_FAMILIES)}"
        )
    if len(parts.layers) != parts.config_layers:
        raise UnsupportedModelError(
            "kvblend cannot blend a pipeline-parallel vLLM model (this rank holds "
            f"{len(parts.layers)} of {parts.config_layers} layers)"
        )
    if not parts.neox_whole_head:
        raise UnsupportedModelError(
            "kvblend needs a rotary embedding over the whole head in the neox (rotate-half) "
            f"style; {name} has another"
        )
    return parts


def rank_kv_heads(rank: int, kv_heads: int, replicas: int) -> slice:
    """Which of the model's KV heads tensor-parallel rank ``rank`` holds, as vLLM shards them.

    vLLM's ``QKVParallelLinear`` gives each rank ``kv_heads`` heads (its ``num_kv_heads``);
    when the model has fewer KV heads than ranks, each head is replicated on ``replicas``
    ranks (its ``num_kv_head_replicas``) and rank ``r`` holds head ``r // replicas``.
    """
    first = rank // replicas * kv_heads
    return slice(first, first + kv_heads)


def _norm(norm: Norm, x: torch.Tensor) -> torch.Tensor:
    """Apply one of the model's norms: vLLM's plain RMSNorm as `rms_norm`, else as is.

    vLLM's native RMSNorm computes in float32, ``x.to(weight.dtype) * weight``, in five ops
    (``pow``, ``mean``, ``rsqrt``, two products); with a weight of ``x``'s dtype that is
    `rms_norm`'s arithmetic in one op (the parity gate checks it against vLLM's forward).
    """
    if norm.plain is None or norm.plain[0].dtype != x.dtype:
        out: torch.Tensor = norm.module(x)
        return out
    weight, epsilon = norm.plain
    return rms_norm(x, weight, epsilon)


class VLLMAdapter:
    """Pure-torch steps over one vLLM decoder model (no state per request)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.parts = parts = checked_parts(model)
        self._layers = parts.layers
        self.shape = DecoderShape(
            num_layers=len(parts.layers),
            num_heads=parts.num_heads,
            num_kv_heads=parts.num_kv_heads,
            head_dim=parts.head_dim,
            max_positions=parts.max_positions,
        )
        self.scaling = parts.scaling
        self.has_qk_norm = parts.layers[0].q_norm is not None
        self.windows: list[int | None] = [layer.window for layer in parts.layers]
        #: The vLLM attention layer of each decoder layer (its name keys the paged KV cache).
        self.attention_layers = [layer.attention for layer in parts.layers]
        #: This rank and the tensor-parallel size (1: no tensor parallelism).
        self.tp_rank, self.tp_size = parts.tp_rank, parts.tp_size
        #: The KV heads of this rank among the model's (a stored entry holds every one).
        self.kv_heads = rank_kv_heads(self.tp_rank, self.shape.num_kv_heads, parts.kv_head_replicas)

    @property
    def device(self) -> torch.device:
        """Device of the model's weights."""
        weight: torch.Tensor = self.parts.embed.weight
        return weight.device

    @property
    def dtype(self) -> torch.dtype:
        """Compute dtype of the model (the dtype vLLM loaded it in)."""
        weight: torch.Tensor = self.parts.embed.weight
        return weight.dtype

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Return token embeddings ``[tokens, hidden]`` (all-reduced across vocabulary shards)."""
        embedded: torch.Tensor = self.parts.embed(token_ids)
        return embedded

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the rotary embedding's ``cos``/``sin`` ``[tokens, head_dim]`` at ``positions``.

        vLLM keeps one half of each (``cos_sin_cache`` rows are ``[cos | sin]``); the neox style
        rotates the halves, so the full-width tables of transformers repeat them.
        """
        cache = self.parts.cos_sin_cache
        cos, sin = cache.index_select(0, positions.to(cache.device)).chunk(2, dim=-1)
        return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)

    def _qkv(self, layer: int, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Return queries, keys and values ``[rows, heads, head_dim]`` (q/k norms applied)."""
        parts = self._layers[layer]
        qkv, _ = parts.qkv(_norm(parts.input_norm, hidden))
        q, k, v = qkv.split(list(parts.split), dim=-1)
        rows, head_dim = hidden.shape[0], self.shape.head_dim
        q, k, v = (t.reshape(rows, -1, head_dim) for t in (q, k, v))
        if parts.q_norm is not None and parts.k_norm is not None:
            q, k = _norm(parts.q_norm, q), _norm(parts.k_norm, k)
        return q, k, v

    def project_rows(self, layer: int, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return un-rotated queries ``[heads, rows, d]`` and K/V ``[rows, 2, kv_heads, d]``."""
        q, k, v = self._qkv(layer, hidden)
        return q.transpose(0, 1), torch.stack((k, v), dim=1)

    def project_kv(self, layer: int, hidden: torch.Tensor, *, keys: bool) -> torch.Tensor:
        """Return un-rotated keys (``keys=True``) or values ``[kv_heads, rows, head_dim]``."""
        _, k, v = self._qkv(layer, hidden)
        return (k if keys else v).transpose(0, 1)

    def attention_output(self, layer: int, attended: torch.Tensor) -> torch.Tensor:
        """Apply ``o_proj`` to attended rows ``[rows, heads * head_dim]`` (with its all-reduce)."""
        out, _ = self._layers[layer].o_proj(attended)
        result: torch.Tensor = out
        return result

    def feed_forward(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """Return ``hidden + mlp(post_attention_layernorm(hidden))`` with vLLM's modules."""
        parts = self._layers[layer]
        out: torch.Tensor = hidden + parts.mlp(_norm(parts.post_norm, hidden))
        return out

    def reduce_scores(self, scores: torch.Tensor) -> torch.Tensor:
        """Return selection scores summed over the tensor-parallel ranks (one all-reduce).

        Each rank scores tokens from its own heads; the sum is every head's score, the same on
        every rank, so every rank picks the same rows. Without tensor parallelism: ``scores``.
        """
        if self.tp_size == 1:
            return scores
        from vllm.distributed import tensor_model_parallel_all_reduce

        reduced: torch.Tensor = tensor_model_parallel_all_reduce(scores.contiguous())
        return reduced

    def gather_ranks(self, values: torch.Tensor) -> torch.Tensor:
        """Return every rank's float32 ``values`` ``[n]`` as ``[tp_size, n]`` (on every rank).

        One all-reduce (the collective the model's own layers use) of a zero tensor holding
        this rank's values in its row.
        """
        values = values.float().reshape(-1)
        if self.tp_size == 1:
            return values[None]
        rows = torch.zeros(self.tp_size, values.numel(), device=self.device)
        rows[self.tp_rank] = values.to(self.device)
        return self.reduce_scores(rows).cpu()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Return float32 next-token logits ``[vocab]`` of the last row (vLLM's processor)."""
        logits = self.parts.compute_logits(_norm(self.parts.final_norm, hidden[-1:]))
        if logits is None:  # a tensor-parallel rank that does not gather the logits
            raise RuntimeError("this tensor-parallel rank holds no logits")
        return logits[0].float()
