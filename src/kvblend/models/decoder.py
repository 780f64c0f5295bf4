"""`Decoder`: the model adapter (`kvblend.blend.adapter.ModelAdapter`) of a transformers model.

The blend loop (`blend.py` and the modules it uses) calls the adapter's members and nothing
else; attention itself (the rows' mask, the kernel) is the loop's job (`row_attention.py`).

`Decoder` wraps a transformers causal LM of a supported family (Llama, Mistral, Qwen2, Qwen3) and
calls the model's own modules (norms, projections, rotary embedding, MLP, head) so that weights,
biases, q/k norms and every RoPE scaling variant are the model's, not a re-implementation.
Nothing here keeps per-request state.

Tensor layout, batch of one, as in transformers' caches: queries ``[heads, tokens, head_dim]``,
keys and values ``[kv_heads, tokens, head_dim]`` (only the KV heads are kept: GQA).
"""

from __future__ import annotations

import copy
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from kvblend.blend.adapter import DecoderShape, rms_norm
from kvblend.errors import UnsupportedModelError

SUPPORTED_FAMILIES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3")


class _Attention(Protocol):
    """The attention module of a supported decoder layer (``q_norm``/``k_norm``: Qwen3 only)."""

    head_dim: int
    scaling: float
    q_proj: nn.Linear
    k_proj: nn.Linear
    v_proj: nn.Linear
    o_proj: nn.Linear
    q_norm: nn.Module
    k_norm: nn.Module


class _Layer(Protocol):
    """One decoder layer: pre-norm attention and MLP halves."""

    self_attn: _Attention
    input_layernorm: nn.Module
    post_attention_layernorm: nn.Module
    mlp: nn.Module


class _Backbone(Protocol):
    """The ``model.model`` of a transformers causal LM of a supported family."""

    embed_tokens: nn.Embedding
    layers: nn.ModuleList
    rotary_emb: nn.Module
    norm: nn.Module


class CausalLM(Protocol):
    """The parts of a transformers Llama-style causal LM that `Decoder` calls."""

    config: Any  # a transformers PretrainedConfig
    model: _Backbone
    lm_head: nn.Linear


#: RMSNorm classes whose forward is exactly ``weight * rms_norm(x.float()).to(x.dtype)``.
_PLAIN_RMS_NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})


def norm(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Apply a norm module of the model: a plain RMSNorm as `rms_norm` (one op), else as is."""
    if type(module).__name__ not in _PLAIN_RMS_NORMS:
        return module(x)
    weight: torch.Tensor = module.weight  # type: ignore[assignment]
    return rms_norm(x, weight, float(module.variance_epsilon))  # type: ignore[arg-type]


class Decoder:
    """The `ModelAdapter` of a transformers decoder model (pure torch, no state per request)."""

    def __init__(self, model: nn.Module) -> None:
        config: Any = getattr(model, "config", None)
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_FAMILIES:
            architectures = getattr(config, "architectures", None) or [type(model).__name__]
            raise UnsupportedModelError(
                f"kvblend cannot blend model type {model_type!r} ({', '.join(architectures)}); "
                f"supported families: {', '.join(SUPPORTED_FAMILIES)}"
            )
        lm = cast(CausalLM, model)  # the family check above vouches for the structure
        self.model: CausalLM = lm
        self.model_type: str = model_type
        self.inner: _Backbone = lm.model
        self.layers: list[_Layer] = [cast(_Layer, layer) for layer in self.inner.layers]
        first_attention = self.layers[0].self_attn
        head_dim = first_attention.head_dim
        self.shape = DecoderShape(
            num_layers=len(self.layers),
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
            max_positions=int(getattr(config, "max_position_embeddings", 0) or 0),
        )
        self.scaling: float = float(first_attention.scaling)
        self.has_qk_norm = hasattr(first_attention, "q_norm")
        self.windows: list[int | None] = _sliding_windows(config, len(self.layers))
        # Per layer: k_proj and v_proj stacked into one projection (built on first use).
        self._kv_proj: list[tuple[torch.Tensor, torch.Tensor | None]] | None = None

    @property
    def device(self) -> torch.device:
        """Device of the model's weights."""
        return self.inner.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """Compute dtype of the model's weights."""
        return self.inner.embed_tokens.weight.dtype

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[tokens, hidden]``."""
        return self.inner.embed_tokens(token_ids)

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the model's own RoPE ``cos``/``sin`` ``[tokens, head_dim]`` at ``positions``."""
        probe = self.inner.embed_tokens.weight[:0]  # its device and dtype are all it reads
        cos, sin = self.inner.rotary_emb(probe, positions.unsqueeze(0))
        return cos[0], sin[0]

    def project_rows(self, layer: int, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return queries ``[heads, tokens, head_dim]`` and K/V ``[tokens, 2, kv_heads, head_dim]``.

        The blend loop's projection: keys (un-rotated) and values come out of one matrix
        product over k_proj and v_proj stacked (a copy of those weights, made once: about a
        tenth of the attention weights of a GQA model), so they are written with one op.
        """
        block = self.layers[layer]
        attention = block.self_attn
        x = norm(block.input_layernorm, hidden)
        tokens, head_dim = x.shape[0], self.shape.head_dim
        queries = attention.q_proj(x).view(tokens, -1, head_dim)
        if self.has_qk_norm:  # the key norm acts on the keys alone: two projections
            keys = norm(attention.k_norm, attention.k_proj(x).view(tokens, -1, head_dim))
            values = attention.v_proj(x).view(tokens, -1, head_dim)
            queries = norm(attention.q_norm, queries)
            return queries.transpose(0, 1), torch.stack((keys, values), 1)
        weight, bias = self.kv_projection(layer)
        kv = F.linear(x, weight, bias).view(tokens, 2, -1, head_dim)
        return queries.transpose(0, 1), kv

    def layer_adapters(self) -> list[Decoder]:
        """Return, for each layer, this adapter restricted to that layer (as its layer 0).

        What the compiled loop hands its step: the same members, the one layer's modules, window
        and stacked K/V projection (shared with this adapter, nothing copied), so one compiled
        graph serves every layer (the weights are its inputs, the layer index is no constant).
        """
        views = []
        for layer in range(self.shape.num_layers):
            view = copy.copy(self)
            view.layers = [self.layers[layer]]
            view.windows = [self.windows[layer]]
            view._kv_proj = [self.kv_projection(layer)]
            views.append(view)
        return views

    def kv_projection(self, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """k_proj and v_proj of ``layer`` stacked: weight and bias (None: no biases)."""
        if self._kv_proj is None:
            stacked: list[tuple[torch.Tensor, torch.Tensor | None]] = []
            with torch.no_grad():
                for block in self.layers:
                    k, v = block.self_attn.k_proj, block.self_attn.v_proj
                    bias = None if k.bias is None else torch.cat((k.bias, v.bias))
                    stacked.append((torch.cat((k.weight, v.weight)), bias))
            self._kv_proj = stacked
        return self._kv_proj[layer]

    def project_kv(self, layer: int, hidden: torch.Tensor, *, keys: bool) -> torch.Tensor:
        """Return only the un-rotated keys (``keys=True``) or the values of ``hidden`` at ``layer``.

        The same arithmetic as `project_rows`, for the check layer's deviation, which needs one
        projection of every row and the rest only for the rows it keeps.
        """
        block = self.layers[layer]
        attention = block.self_attn
        x = norm(block.input_layernorm, hidden)
        tokens = x.shape[0]
        if keys:
            k = attention.k_proj(x).view(tokens, -1, self.shape.head_dim)
            if self.has_qk_norm:
                k = norm(attention.k_norm, k)
            return k.transpose(0, 1)
        return attention.v_proj(x).view(tokens, -1, self.shape.head_dim).transpose(0, 1)

    def attention_output(self, layer: int, attended: torch.Tensor) -> torch.Tensor:
        """Return ``o_proj`` of ``layer`` over attention outputs ``[rows, heads * head_dim]``."""
        return self.layers[layer].self_attn.o_proj(attended)

    def feed_forward(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """Apply the residual MLP half of a block: ``hidden + mlp(norm(hidden))``."""
        block = self.layers[layer]
        return hidden + block.mlp(norm(block.post_attention_layernorm, hidden))

    def reduce_scores(self, scores: torch.Tensor) -> torch.Tensor:
        """Return selection scores summed over every rank's heads: one process, so ``scores``."""
        return scores

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 next-token logits ``[vocab]`` for the last row of ``hidden``."""
        last = norm(self.inner.norm, hidden[-1:])
        return self.model.lm_head(last)[0].float()


def _sliding_windows(config: object, num_layers: int) -> list[int | None]:
    """Per-layer sliding-window size (None = full attention), as transformers applies it."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return [None] * num_layers
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return [window if kind == "sliding_attention" else None for kind in layer_types]
    if getattr(config, "model_type", None) == "mistral":
        return [window] * num_layers
    return [None] * num_layers
