"""`VLLMAdapter`: the blend loop's model adapter over the modules vLLM loaded.

It implements `kvblend.blend.adapter.ModelAdapter` by calling vLLM's own modules of a Llama,
Mistral, Qwen2 or Qwen3 model: the vocabulary-parallel embedding, the RMSNorms, the fused
``qkv_proj`` (split as vLLM's attention splits it), q/k norms, the rotary embedding's own
``cos_sin_cache``, ``o_proj`` and the MLP (row-parallel layers, so their all-reduce is vLLM's),
and ``compute_logits``. Nothing is copied or re-implemented: weights, biases, RoPE scaling and
quantized linear layers stay vLLM's. Under tensor parallelism the heads are this rank's
(``kv_heads``: which of a stored entry's), and selection scores are summed over the ranks
(`reduce_scores`), so every rank blends the same rows with its own heads.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvblend.blend.adapter import DecoderShape, rms_norm
from kvblend.errors import UnsupportedModelError
from kvblend.models.decoder import SUPPORTED_FAMILIES

__all__ = ["VLLMAdapter", "rank_kv_heads"]


def _checked_layers(model: nn.Module) -> tuple[Any, list[Any]]:
    """Return the model's backbone and its decoder layers, or refuse a model kvblend cannot run."""
    config: Any = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    backbone = getattr(model, "model", None)
    layers = list(getattr(backbone, "layers", None) or [])
    if model_type not in SUPPORTED_FAMILIES or not layers:
        raise UnsupportedModelError(
            f"kvblend cannot blend vLLM model {type(model).__name__} (model type "
            f"{model_type!r}); supported families: {', '.join(SUPPORTED_FAMILIES)}"
        )
    if len(layers) != config.num_hidden_layers:
        raise UnsupportedModelError(
            "kvblend cannot blend a pipeline-parallel vLLM model (this rank holds "
            f"{len(layers)} of {config.num_hidden_layers} layers)"
        )
    for layer in layers:
        attention = layer.self_attn
        rotary = attention.rotary_emb
        if not getattr(rotary, "is_neox_style", False) or rotary.rotary_dim != attention.head_dim:
            raise UnsupportedModelError(
                "kvblend needs a rotary embedding over the whole head in the neox (rotate-half) "
                f"style; {type(model).__name__} has another"
            )
    return backbone, layers


def rank_kv_heads(rank: int, kv_heads: int, replicas: int) -> slice:
    """Which of the model's KV heads tensor-parallel rank ``rank`` holds, as vLLM shards them.

    vLLM's ``QKVParallelLinear`` gives each rank ``kv_heads`` heads (its ``num_kv_heads``);
    when the model has fewer KV heads than ranks, each head is replicated on ``replicas``
    ranks (its ``num_kv_head_replicas``) and rank ``r`` holds head ``r // replicas``.
    """
    first = rank // replicas * kv_heads
    return slice(first, first + kv_heads)


def _norm(module: Any, x: torch.Tensor) -> torch.Tensor:
    """Apply one of the model's norms: vLLM's plain RMSNorm as `rms_norm`, else as is.

    vLLM's native RMSNorm computes in float32, ``x.to(weight.dtype) * weight``, in five ops
    (``pow``, ``mean``, ``rsqrt``, two products); with a weight of ``x``'s dtype that is
    `rms_norm`'s arithmetic in one op (the parity gate checks it against vLLM's forward).
    """
    plain = (
        type(module).__name__ == "RMSNorm"
        and getattr(module, "has_weight", False)
        and getattr(module, "variance_size_override", None) is None
        and module.weight.dtype == x.dtype
    )
    if not plain:
        return module(x)
    return rms_norm(x, module.weight, float(module.variance_epsilon))


class VLLMAdapter:
    """Pure-torch steps over one vLLM decoder model (no state per request)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.backbone, self._layers = _checked_layers(model)
        config: Any = model.config
        first = self._layers[0].self_attn
        self.shape = DecoderShape(
            num_layers=len(self._layers),
            num_heads=int(first.num_heads),
            num_kv_heads=int(first.num_kv_heads),
            head_dim=int(first.head_dim),
            max_positions=int(getattr(config, "max_position_embeddings", 0) or 0),
        )
        self.scaling = float(first.scaling)
        self.has_qk_norm = hasattr(first, "q_norm")
        self.windows: list[int | None] = [
            getattr(layer.self_attn.attn, "sliding_window", None) or None for layer in self._layers
        ]
        #: The vLLM attention layer of each decoder layer (its name keys the paged KV cache).
        self.attention_layers = [layer.self_attn.attn for layer in self._layers]
        qkv = first.qkv_proj
        #: This rank and the tensor-parallel size (1: no tensor parallelism).
        self.tp_rank, self.tp_size = (
            int(getattr(qkv, "tp_rank", 0)),
            int(getattr(qkv, "tp_size", 1)),
        )
        #: The KV heads of this rank among the model's (a stored entry holds every one).
        replicas = int(getattr(qkv, "num_kv_head_replicas", 1) or 1)
        self.kv_heads = rank_kv_heads(self.tp_rank, self.shape.num_kv_heads, replicas)

    @property
    def device(self) -> torch.device:
        """Device of the model's weights."""
        return self.backbone.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """Compute dtype of the model (the dtype vLLM loaded it in)."""
        return self.backbone.embed_tokens.weight.dtype

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Return token embeddings ``[tokens, hidden]`` (all-reduced across vocabulary shards)."""
        return self.backbone.embed_tokens(token_ids)

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the rotary embedding's ``cos``/``sin`` ``[tokens, head_dim]`` at ``positions``.

        vLLM keeps one half of each (``cos_sin_cache`` rows are ``[cos | sin]``); the neox style
        rotates the halves, so the full-width tables of transformers repeat them.
        """
        cache = self._layers[0].self_attn.rotary_emb.cos_sin_cache
        cos, sin = cache.index_select(0, positions.to(cache.device)).chunk(2, dim=-1)
        return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)

    def _qkv(self, layer: int, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Return queries, keys and values ``[rows, heads, head_dim]`` (q/k norms applied)."""
        attention = self._layers[layer].self_attn
        x = _norm(self._layers[layer].input_layernorm, hidden)
        qkv, _ = attention.qkv_proj(x)
        q, k, v = qkv.split([attention.q_size, attention.kv_size, attention.kv_size], dim=-1)
        rows, head_dim = hidden.shape[0], self.shape.head_dim
        q, k, v = (t.reshape(rows, -1, head_dim) for t in (q, k, v))
        if self.has_qk_norm:
            q, k = _norm(attention.q_norm, q), _norm(attention.k_norm, k)
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
        out, _ = self._layers[layer].self_attn.o_proj(attended)
        return out

    def feed_forward(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """Return ``hidden + mlp(post_attention_layernorm(hidden))`` with vLLM's modules."""
        block = self._layers[layer]
        return hidden + block.mlp(_norm(block.post_attention_layernorm, hidden))

    def reduce_scores(self, scores: torch.Tensor) -> torch.Tensor:
        """Return selection scores summed over the tensor-parallel ranks (one all-reduce).

        Each rank scores tokens from its own heads; the sum is every head's score, the same on
        every rank, so every rank picks the same rows. Without tensor parallelism: ``scores``.
        """
        if self.tp_size == 1:
            return scores
        from vllm.distributed import tensor_model_parallel_all_reduce

        return tensor_model_parallel_all_reduce(scores.contiguous())

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
        last = _norm(self.backbone.norm, hidden[-1:])
        logits = self.model.compute_logits(last)  # type: ignore[operator]
        if logits is None:  # a tensor-parallel rank that does not gather the logits
            raise RuntimeError("this tensor-parallel rank holds no logits")
        return logits[0].float()
