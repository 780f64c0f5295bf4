"""The per-layer arithmetic of a Hugging Face RoPE decoder, exposed as small pure-torch steps.

`Decoder` wraps a transformers causal LM of a supported family (Llama, Mistral, Qwen2, Qwen3) and
calls the model's own modules (norms, projections, rotary embedding, MLP, head) so that weights,
biases, q/k norms and every RoPE scaling variant are the model's, not a re-implementation. The
blend loop in `blend.py` drives these steps with explicit positions; nothing here keeps
per-request state.

Tensor layout, batch of one, as in transformers' caches: queries ``[heads, tokens, head_dim]``,
keys and values ``[kv_heads, tokens, head_dim]`` (only the KV heads are kept: GQA).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

SUPPORTED_FAMILIES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3")


class UnsupportedModelError(ValueError):
    """The model's architecture is not one kvblend can blend."""


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


@dataclass(frozen=True)
class DecoderShape:
    """The sizes of a decoder that caches and the store depend on."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_positions: int


def sdpa_takes_gqa(masked: bool, device: torch.device) -> bool:
    """Whether SDPA should get grouped KV heads (``enable_gqa``) rather than expanded ones.

    Unmasked: always. With a mask, only on the CPU: on CUDA that combination falls back to the
    math kernel, so the KV heads are expanded instead, as transformers' sdpa_attention does;
    the CPU's flash kernel takes both at once, and expanding there only adds copies (about 6%
    of a default blend at 4K tokens).
    """
    return not masked or device.type == "cpu"


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Repeat each KV head ``groups`` times: ``[kv_heads, tokens, d] -> [heads, tokens, d]``.

    Query head ``h`` reads KV head ``h // groups``, as transformers' ``repeat_kv``.
    """
    kv_heads, tokens, head_dim = x.shape
    return x[:, None].expand(kv_heads, groups, tokens, head_dim).reshape(-1, tokens, head_dim)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` with its first half negated: the table `apply_rope` multiplies swapped halves by."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[heads, tokens, head_dim]`` by ``cos`` and ``signed_sin(sin)``.

    Computes transformers' ``x * cos + rotate_half(x) * sin`` with one product and two in-place
    multiply-adds over the halves instead of four temporaries: the blend rotates every key of
    the prompt at every layer, so this is on the hot path.
    """
    half = x.shape[-1] // 2
    out = x * cos
    out[..., :half].addcmul_(x[..., half:], sin_signed[..., :half])
    out[..., half:].addcmul_(x[..., :half], sin_signed[..., half:])
    return out


def rope_table(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Return the rotation of every position as one table ``[tokens, 2, 2, head_dim // 2]``.

    Entry ``[t, i, m]`` multiplies input half ``m`` into output half ``i``, so `rotate` is one
    product and one sum: the same products and sums as transformers' ``apply_rotary_pos_emb``
    (``x * cos + rotate_half(x) * sin``), so the result is bit for bit the same.
    """
    half = cos.shape[-1] // 2
    first = torch.stack((cos[..., :half], -sin[..., :half]), dim=-2)
    second = torch.stack((sin[..., half:], cos[..., half:]), dim=-2)
    return torch.stack((first, second), dim=-3)


def rotate(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[heads, tokens, head_dim]`` by a `rope_table` of its tokens (two ops)."""
    halves = x.unflatten(-1, (2, -1)).unsqueeze(-3)  # [heads, tokens, 1, 2, half]
    return (halves * table).sum(dim=-2).flatten(-2)


def scaled_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    causal: bool = True,
) -> torch.Tensor:
    """SDPA of rotated ``[heads, tokens, head_dim]`` inputs: ``[tokens, heads * head_dim]``.

    Before ``o_proj``. ``mask`` is an additive ``[queries, keys]`` mask (0 = may attend, -inf =
    may not) or a boolean one (True = may attend), or None for plain causal attention over
    aligned queries and keys (``causal=False``: every key). Keys and values may hold fewer
    (grouped) heads than the queries.
    """
    groups = queries.shape[0] // keys.shape[0]  # 1 when the caller expanded the heads
    if groups > 1 and not sdpa_takes_gqa(mask is not None, keys.device):
        keys, values = repeat_kv(keys, groups), repeat_kv(values, groups)
    out = F.scaled_dot_product_attention(
        queries.unsqueeze(0),
        keys.unsqueeze(0),
        values.unsqueeze(0),
        attn_mask=None if mask is None else mask.unsqueeze(0).unsqueeze(0),
        is_causal=mask is None and causal,
        scale=scaling,
        enable_gqa=queries.shape[0] != keys.shape[0],
    )
    # [1, heads, tokens, head_dim] -> [tokens, heads * head_dim]
    return out[0].transpose(0, 1).reshape(queries.shape[1], -1)


#: RMSNorm classes whose forward is exactly ``weight * rms_norm(x.float()).to(x.dtype)``.
_PLAIN_RMS_NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})


def norm(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Apply a norm module of the model: a plain RMSNorm as torch's one fused op, else as is.

    The supported families' RMSNorm computes ``weight * (x * rsqrt(mean(x^2) + eps))`` in
    float32 in five ops; ``F.rms_norm`` is one (and gives the same values).
    """
    if type(module).__name__ not in _PLAIN_RMS_NORMS:
        return module(x)
    weight: torch.Tensor = module.weight  # type: ignore[assignment]
    eps = float(module.variance_epsilon)  # type: ignore[arg-type]
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


class Decoder:
    """Pure-torch steps over one transformers decoder model (no state per request)."""

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
        probe = torch.empty(0, device=self.device, dtype=self.dtype)
        cos, sin = self.inner.rotary_emb(probe, positions.unsqueeze(0))
        return cos[0], sin[0]

    def project(
        self, layer: int, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return queries, un-rotated keys and values of ``hidden`` at ``layer``.

        ``hidden`` is ``[tokens, hidden]``; the outputs are ``[heads, tokens, head_dim]``.
        """
        block = self.layers[layer]
        attention = block.self_attn
        x = norm(block.input_layernorm, hidden)
        tokens = x.shape[0]
        head_dim = self.shape.head_dim
        q = attention.q_proj(x).view(tokens, -1, head_dim)
        k = attention.k_proj(x).view(tokens, -1, head_dim)
        v = attention.v_proj(x).view(tokens, -1, head_dim)
        if self.has_qk_norm:
            q = norm(attention.q_norm, q)
            k = norm(attention.k_norm, k)
        return q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)

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

        The same arithmetic as `project`, for the check layer's deviation, which needs one
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

    def attend(
        self,
        layer: int,
        queries: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor | None,
        rows: torch.Tensor | None = None,
        causal: bool = True,
    ) -> torch.Tensor:
        """Attention output ``[tokens, hidden]`` (after ``o_proj``) of rotated inputs.

        ``mask`` is an additive ``[queries, keys]`` mask (0 = may attend, -inf = may not) or a
        boolean one (True = may attend), or None for plain causal
        attention over aligned queries and keys (``causal=False``: every key). ``rows`` keeps
        only those query rows (before ``o_proj``).
        """
        out = scaled_attention(queries, keys, values, mask, self.scaling, causal)
        if rows is not None:
            out = out.index_select(0, rows)
        return self.attention_output(layer, out)

    def attention_output(self, layer: int, attended: torch.Tensor) -> torch.Tensor:
        """Apply ``o_proj`` of ``layer`` to attended rows ``[rows, heads * head_dim]``."""
        return self.layers[layer].self_attn.o_proj(attended)

    def feed_forward(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """Apply the residual MLP half of a block: ``hidden + mlp(norm(hidden))``."""
        block = self.layers[layer]
        return hidden + block.mlp(norm(block.post_attention_layernorm, hidden))

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
