"""Every use kvblend makes of vLLM beyond its public API, in one module, checked on each version.

The connector otherwise speaks vLLM's public APIs only: the KV connector API
(``KVConnectorBase_V1``, its metadata, stats and Prometheus classes), the logits-processor API,
the plugin entry points, the configuration objects it is handed and
``tensor_model_parallel_all_reduce``. What it needs beyond them is here, each use named in
`USES` with the vLLM versions it was checked on:

- a request's fields as the scheduler hands it over (`view`), vLLM's prefill stats of it
  (`report_cached`: what its usage reports) and its block hashes (`salt_hashes`: blended,
  approximate KV must never be found by a request computing in full);
- the scheduler's output a step's forward computes (`scheduled_rows`), the workers' report in
  the connector output (`worker_report`);
- the model vLLM loaded (`on_model_loaded`: the connector API never hands it over), its modules
  (`model_parts`: what `adapter.VLLMAdapter` calls), the attention backend's own KV write
  (`write_kv`) and vLLM's own forward over a few tokens (`reference_logits`: the parity gate);
- whether the platform gathers logits to every rank (`logits_on_every_rank`).

`check_uses` reports every use the installed vLLM changed (``tests/vllm/test_vllm.py`` runs it in
vLLM's engine process and pins the vLLM version CI installs). vLLM is imported inside the
functions only: the package's vLLM-free parts import this module without it.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import import_module
from typing import Any

import torch

from kvblend.vllm.fallbacks import RequestFallback

__all__ = [
    "CHECKED_ON",
    "USES",
    "LayerParts",
    "ModelParts",
    "Norm",
    "RequestView",
    "Salted",
    "Use",
    "check_uses",
    "logits_on_every_rank",
    "model_parts",
    "on_model_loaded",
    "prefill_stats",
    "reference_logits",
    "report_cached",
    "salt_hashes",
    "scheduled_rows",
    "unsalt_hashes",
    "view",
    "worker_report",
    "write_kv",
]

#: The vLLM versions every use below was checked on.
CHECKED_ON = ("0.32.0",)


# ---------------------------------------------------------------- the scheduler side's uses
@dataclass(frozen=True)
class RequestView:
    """What the scheduler side reads of a vLLM ``Request``.

    ``excluded``: why vLLM must prefill it itself, whatever its documents (None: it need not).
    """

    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: Any
    preemptions: int
    excluded: RequestFallback | None


def view(request: Any) -> RequestView:
    """Read a vLLM ``Request``'s fields (`USES`: ``Request``'s attributes)."""
    preemptions = int(request.num_preemptions or 0)
    params = request.sampling_params
    excluded = None
    if preemptions > 0:
        excluded = RequestFallback("preempted", "resumed after preemption: vLLM recomputes it")
    elif params is None:
        excluded = RequestFallback("not_generation", "not a generation request")
    elif params.prompt_logprobs:
        excluded = RequestFallback(
            "prompt_logprobs", "prompt logprobs need every prompt token's logits"
        )
    elif request.lora_request is not None:
        excluded = RequestFallback("lora", "LoRA adapters are not blended")
    elif request.mm_features:
        excluded = RequestFallback("multimodal", "multimodal inputs are not blended")
    ids = list(request.prompt_token_ids or ())
    return RequestView(request.request_id, ids, request.kv_transfer_params, preemptions, excluded)


def report_cached(stats: Any, cached: int) -> None:
    """Make vLLM's prefill stats of a request report ``cached`` tokens nobody computed.

    ``stats``: the request's ``prefill_stats`` (`USES`), kept by the caller from allocation on
    (vLLM takes them off the request when it reports them).
    """
    if stats is None or not stats.num_prompt_tokens:
        return
    local = stats.num_local_cached_tokens
    stats.set(stats.num_prompt_tokens, local, max(0, cached - local))


def prefill_stats(request: Any) -> Any:
    """Return vLLM's prefill stats of a request (None: none)."""
    return request.prefill_stats


@dataclass
class Salted:
    """A request's own block hashes and hasher, as they were before `salt_hashes`."""

    hashes: list[Any]
    hasher: Any


def _salted(block_hash: Any, salt: bytes) -> Any:
    """``block_hash`` salted: a hash no full prefill's block of the same tokens has."""
    digest = hashlib.sha256(b"kvblend-blended|" + salt + b"|" + bytes(block_hash)).digest()
    return type(block_hash)(digest) if isinstance(block_hash, bytes) else digest


def salt_hashes(request: Any, first: int) -> Salted:
    """Salt the request's block hashes from block ``first`` on, those hashed later included.

    The blocks hashed already are salted here; vLLM's hasher of the request (which hashes each
    block as it fills, prompt and generated tokens alike) is wrapped so that those it hashes
    later from that block on are salted too (`USES`: ``Request.block_hashes`` and
    ``Request._block_hasher``). Returns what `unsalt_hashes` gives back.
    """
    hashes, hasher = request.block_hashes, request._block_hasher
    own = Salted(list(hashes), hasher)
    salt = str(request.request_id).encode()
    for index in range(first, len(hashes)):
        hashes[index] = _salted(hashes[index], salt)
    if hasher is not None:

        def salted_hasher(owner: Any) -> list[Any]:
            start = len(owner.block_hashes)
            new = hasher(owner)
            return [_salted(h, salt) if start + i >= first else h for i, h in enumerate(new)]

        request._block_hasher = salted_hasher
    return own


def unsalt_hashes(request: Any, own: Salted) -> None:
    """Give a request back the block hashes and hasher `salt_hashes` found."""
    request.block_hashes[: len(own.hashes)] = own.hashes
    request._block_hasher = own.hasher


def scheduled_rows(scheduler_output: Any) -> list[tuple[int, int]]:
    """Return ``(tokens, prefix)`` of each request a step's forward computes (`USES`)."""
    scheduled: dict[str, int] = scheduler_output.num_scheduled_tokens or {}
    prefix: dict[str, int] = {}
    for new in scheduler_output.scheduled_new_reqs or ():
        prefix[new.req_id] = int(new.num_computed_tokens)
    cached = scheduler_output.scheduled_cached_reqs
    if cached is not None:
        for request_id, computed in zip(cached.req_ids, cached.num_computed_tokens, strict=False):
            prefix[request_id] = int(computed)
    return [(int(tokens), prefix.get(rid, 0)) for rid, tokens in scheduled.items()]


def worker_report(connector_output: Any) -> Any:
    """Return the workers' aggregated report in a ``KVConnectorOutput`` (None: none)."""
    return connector_output.kv_connector_worker_meta


# ---------------------------------------------------------------- the worker side's uses
def on_model_loaded(keep: Callable[[Any, Any, Any], None]) -> str | None:
    """Call ``keep(model, vllm_config, model_config)`` with every model this process loads.

    Wraps ``BaseModelLoader.load_model``, which every weight format's loader inherits
    (`USES`); the wrapper calls the original and only keeps a reference to its result.
    Returns why it could not (another vLLM layout), or None.
    """
    try:
        base = import_module("vllm.model_executor.model_loader.base_loader").BaseModelLoader
    except (ImportError, AttributeError) as error:
        return f"{error}"
    original = base.load_model

    @functools.wraps(original)
    def load_model(
        self: Any, vllm_config: Any, model_config: Any, *args: Any, **kwargs: Any
    ) -> Any:
        model = original(self, vllm_config, model_config, *args, **kwargs)
        keep(model, vllm_config, model_config)
        return model

    base.load_model = load_model
    return None


@dataclass(frozen=True)
class Norm:
    """One of the model's norms: the module, and its weight and epsilon when a plain RMSNorm."""

    module: Any
    plain: tuple[torch.Tensor, float] | None


@dataclass(frozen=True)
class LayerParts:
    """The modules of one decoder layer, as vLLM loaded them."""

    input_norm: Norm
    post_norm: Norm
    qkv: Any  # QKVParallelLinear: returns (qkv, bias)
    split: tuple[int, int, int]  # the widths of q, k and v in its output
    q_norm: Norm | None
    k_norm: Norm | None
    o_proj: Any  # RowParallelLinear (its all-reduce is vLLM's)
    mlp: Any
    attention: Any  # vLLM's attention layer: its paged cache and backend
    window: int | None


@dataclass(frozen=True)
class ModelParts:
    """What `adapter.VLLMAdapter` calls of a vLLM decoder model."""

    model_type: str | None
    config_layers: int  # the model's layers (this rank may hold fewer: pipeline parallelism)
    max_positions: int
    embed: Any
    layers: list[LayerParts]
    final_norm: Norm
    compute_logits: Callable[[torch.Tensor], torch.Tensor | None]
    cos_sin_cache: torch.Tensor
    neox_whole_head: bool  # a rotary embedding over the whole head, neox (rotate-half) style
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    tp_rank: int
    tp_size: int
    kv_head_replicas: int


def _norm(module: Any) -> Norm:
    """Return a norm, plain when vLLM's RMSNorm with a weight and no size override (`USES`)."""
    plain = (
        type(module).__name__ == "RMSNorm"
        and module.has_weight
        and module.variance_size_override is None
    )
    return Norm(module, (module.weight, float(module.variance_epsilon)) if plain else None)


def _layer(layer: Any) -> LayerParts:
    attention = layer.self_attn
    has_qk_norm = hasattr(attention, "q_norm")
    return LayerParts(
        _norm(layer.input_layernorm),
        _norm(layer.post_attention_layernorm),
        attention.qkv_proj,
        (attention.q_size, attention.kv_size, attention.kv_size),
        _norm(attention.q_norm) if has_qk_norm else None,
        _norm(attention.k_norm) if has_qk_norm else None,
        attention.o_proj,
        layer.mlp,
        attention.attn,
        attention.attn.sliding_window or None,
    )


def model_parts(model: Any) -> ModelParts:
    """Read a vLLM Llama, Mistral, Qwen2 or Qwen3 model's modules (`USES`: their attributes).

    AttributeError: a model without them (another family).
    """
    config = model.config
    backbone = model.model
    decoder_layers = list(backbone.layers or [])
    if not decoder_layers:
        raise AttributeError(f"{type(model).__name__} has no decoder layers")
    first = decoder_layers[0].self_attn
    rotary, qkv = first.rotary_emb, first.qkv_proj
    return ModelParts(
        model_type=getattr(config, "model_type", None),
        config_layers=int(config.num_hidden_layers),
        max_positions=int(getattr(config, "max_position_embeddings", 0) or 0),
        embed=backbone.embed_tokens,
        layers=[_layer(layer) for layer in decoder_layers],
        final_norm=_norm(backbone.norm),
        compute_logits=model.compute_logits,
        cos_sin_cache=rotary.cos_sin_cache,
        neox_whole_head=bool(rotary.is_neox_style and rotary.rotary_dim == first.head_dim),
        num_heads=int(first.num_heads),
        num_kv_heads=int(first.num_kv_heads),
        head_dim=int(first.head_dim),
        scaling=float(first.scaling),
        tp_rank=int(qkv.tp_rank),
        tp_size=int(qkv.tp_size),
        kv_head_replicas=int(getattr(qkv, "num_kv_head_replicas", 1) or 1),
    )


def write_kv(attention: Any, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
    """Write rows ``[rows, kv_heads, head_dim]`` into an attention layer's paged cache.

    Through the layer's own backend op, ``impl.do_kv_cache_update`` (`USES`): the cache layout,
    its dtype and any fp8 quantization stay vLLM's business.
    """
    cache = attention.kv_cache
    cache = cache[0] if isinstance(cache, (list, tuple)) else cache  # older: one per engine
    attention.impl.do_kv_cache_update(attention, keys, values, cache, slots)


def _metadata(vllm_config: Any, group: Any, device: torch.device, tokens: int) -> tuple[Any, Any]:
    """Attention metadata of one prefill of ``tokens`` tokens, and its slot mapping."""
    from vllm.config import set_current_vllm_config
    from vllm.config.vllm import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.v1.attention.backend import CommonAttentionMetadata

    spec, names = group.kv_cache_spec, list(group.layer_names)
    layers = get_layers_from_vllm_config(vllm_config, Attention, names)
    backend = next(iter(layers.values())).get_attn_backend()
    block_size = int(spec.block_size)
    blocks = torch.arange(1, 1 + -(-tokens // block_size), dtype=torch.int32, device=device)
    positions = torch.arange(tokens, device=device)
    slots = (blocks.long()[positions // block_size] * block_size + positions % block_size).long()
    starts = torch.tensor([0, tokens], dtype=torch.int32)
    lengths = torch.tensor([tokens], dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=starts.to(device),
        query_start_loc_cpu=starts,
        seq_lens=lengths.to(device),
        num_reqs=1,
        num_actual_tokens=tokens,
        max_query_len=tokens,
        max_seq_len=tokens,
        block_table_tensor=blocks[None],
        slot_mapping=slots,
        causal=True,
        positions=positions,
        seq_lens_cpu_upper_bound=lengths,
        is_prefilling=torch.ones(1, dtype=torch.bool),
    )
    with set_current_vllm_config(vllm_config):
        builder = backend.get_builder_cls()(spec, names, vllm_config, device)
        metadata = builder.build(0, common)
    return {name: metadata for name in names}, {name: slots for name in names}


@torch.inference_mode()
def reference_logits(
    model: Any, vllm_config: Any, kv_cache_config: Any, token_ids: Sequence[int]
) -> torch.Tensor:
    """Float32 next-token logits ``[vocab]`` vLLM's own forward gives after ``token_ids``.

    The model's ``forward`` and ``compute_logits``, with the attention backend's own metadata
    builder and kernels (`USES`). Run when the worker registers its KV caches, before any
    request: the text's KV goes into the first free blocks (block 0 is vLLM's null block),
    which hold nothing yet and are overwritten or zeroed before any request reads them.
    """
    from vllm.forward_context import set_forward_context

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise RuntimeError(f"the model has {len(groups)} KV cache groups; kvblend handles one")
    device = next(model.parameters()).device
    tokens = len(token_ids)
    metadata, slots = _metadata(vllm_config, groups[0], device, tokens)
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=device)
    positions = torch.arange(tokens, device=device)
    with set_forward_context(
        metadata, vllm_config, num_tokens=tokens, slot_mapping=slots, skip_compiled=True
    ):
        hidden = model(input_ids=ids, positions=positions)
    logits = model.compute_logits(hidden[-1:])
    if logits is None:
        raise RuntimeError("this tensor-parallel rank holds no logits")
    return logits[0].float()


def logits_on_every_rank() -> bool:
    """Whether this platform gathers the logits to every tensor-parallel rank (`USES`)."""
    from vllm.platforms import current_platform

    return bool(current_platform.use_all_gather())


# ---------------------------------------------------------------- the uses, checked
@dataclass(frozen=True)
class Use:
    """One use of vLLM beyond its public API: what, where in vLLM, and how to check it."""

    name: str
    module: str  # where in vLLM
    owner: str  # a class or function of that module
    kind: str  # "sets": the class's source assigns ``self.<n>``; "params": its parameters
    names: tuple[str, ...]
    versions: tuple[str, ...] = CHECKED_ON

    def check(self) -> str | None:
        """Return what the installed vLLM changed of this use (None: nothing)."""
        try:
            owner: Any = import_module(self.module)
            for part in self.owner.split("."):
                owner = getattr(owner, part)
        except (ImportError, AttributeError) as error:
            return f"{self.name}: {self.module}.{self.owner} is gone ({error})"
        if self.kind == "params":
            found = set(inspect.signature(owner).parameters)
        else:
            source = _source(owner)
            found = {n for n in self.names if f"self.{n}" in source or f"def {n}(" in source}
        missing = [n for n in self.names if n not in found]
        return f"{self.name}: {self.owner} has no {', '.join(missing)}" if missing else None


def _source(owner: Any) -> str:
    """Return the source of a class and its bases from the owner's own package, or a function's."""
    package = owner.__module__.split(".")[0]
    classes = inspect.getmro(owner) if inspect.isclass(owner) else (owner,)
    return "\n".join(
        inspect.getsource(cls) for cls in classes if cls.__module__.split(".")[0] == package
    )


_M = "vllm.model_executor"
_ATTENTION = (
    "qkv_proj o_proj rotary_emb attn q_size kv_size head_dim num_heads num_kv_heads scaling"
)
# fmt: off
#: Every use of vLLM beyond its public API: what kvblend uses, where (module:owner), how it is
#: checked (``sets``: the owner's source assigns ``self.<name>`` or defines it; ``params``: its
#: parameters) and the names, all checked on `CHECKED_ON`.
_TABLE = (
    ("a request's fields", "vllm.v1.request:Request", "sets",
     "request_id prompt_token_ids kv_transfer_params num_preemptions sampling_params "
     "lora_request mm_features prefill_stats block_hashes _block_hasher"),
    ("vLLM hashes a request's new blocks with its hasher", "vllm.v1.request:Request", "sets",
     "block_hashes.extend(self._block_hasher(self)"),
    ("prefill stats", "vllm.v1.metrics.stats:PrefillStats", "sets",
     "num_prompt_tokens num_local_cached_tokens num_cached_tokens"),
    ("prefill stats set", "vllm.v1.metrics.stats:PrefillStats.set", "params",
     "num_prompt_tokens num_local_cached_tokens num_external_cached_tokens"),
    ("a step's scheduled tokens", "vllm.v1.core.sched.output:SchedulerOutput", "params",
     "num_scheduled_tokens scheduled_new_reqs scheduled_cached_reqs"),
    ("a new request's computed tokens", "vllm.v1.core.sched.output:NewRequestData", "params",
     "req_id num_computed_tokens"),
    ("a running request's computed tokens", "vllm.v1.core.sched.output:CachedRequestData",
     "params", "req_ids num_computed_tokens"),
    ("the workers' report", "vllm.v1.outputs:KVConnectorOutput", "params",
     "kv_connector_worker_meta"),
    ("the model loader", f"{_M}.model_loader.base_loader:BaseModelLoader.load_model", "params",
     "self vllm_config model_config"),
    ("a causal LM's backbone and logits", f"{_M}.models.llama:LlamaForCausalLM", "sets",
     "model compute_logits"),
    ("a backbone's modules", f"{_M}.models.llama:LlamaModel", "sets", "embed_tokens layers norm"),
    ("a Qwen2 backbone's modules", f"{_M}.models.qwen2:Qwen2Model", "sets",
     "embed_tokens layers norm"),
    ("a decoder layer's modules", f"{_M}.models.llama:LlamaDecoderLayer", "sets",
     "self_attn mlp input_layernorm post_attention_layernorm"),
    ("a Qwen2 decoder layer's modules", f"{_M}.models.qwen2:Qwen2DecoderLayer", "sets",
     "self_attn mlp input_layernorm post_attention_layernorm"),
    ("an attention's modules", f"{_M}.models.llama:LlamaAttention", "sets", _ATTENTION),
    ("a Qwen2 attention's modules", f"{_M}.models.qwen2:Qwen2Attention", "sets",
     f"{_ATTENTION} q_norm k_norm"),
    ("a Qwen3 attention's modules", f"{_M}.models.qwen3:Qwen3Attention", "sets",
     f"{_ATTENTION} q_norm k_norm"),
    ("the rotary embedding's table", f"{_M}.layers.rotary_embedding.base:RotaryEmbedding",
     "sets", "cos_sin_cache is_neox_style rotary_dim"),
    ("qkv_proj's tensor-parallel shards", f"{_M}.layers.linear:QKVParallelLinear", "sets",
     "tp_rank tp_size num_kv_head_replicas"),
    ("RMSNorm's weight and epsilon", f"{_M}.layers.layernorm:RMSNorm", "sets",
     "weight variance_epsilon has_weight variance_size_override"),
    ("an attention layer's cache and backend", f"{_M}.layers.attention.attention:Attention",
     "sets", "sliding_window kv_cache impl get_attn_backend"),
    ("the CPU backend's KV write",
     "vllm.v1.attention.backends.cpu_attn:CPUAttentionBackendImpl.do_kv_cache_update",
     "params", "layer key value kv_cache slot_mapping"),
    ("the forward context", "vllm.forward_context:set_forward_context", "params",
     "attn_metadata vllm_config num_tokens slot_mapping skip_compiled"),
    ("common attention metadata", "vllm.v1.attention.backend:CommonAttentionMetadata", "params",
     "query_start_loc query_start_loc_cpu seq_lens num_reqs num_actual_tokens max_query_len "
     "max_seq_len block_table_tensor slot_mapping causal positions seq_lens_cpu_upper_bound "
     "is_prefilling"),
    ("the attention layers of a config", "vllm.config.vllm:get_layers_from_vllm_config",
     "params", "vllm_config layer_type layer_names"),
    ("the current config", "vllm.config:set_current_vllm_config", "params", "vllm_config"),
    ("the platform's logits gathering", "vllm.platforms.interface:Platform", "sets",
     "use_all_gather"),
)
# fmt: on
USES = tuple(
    Use(name, where.split(":")[0], where.split(":")[1], kind, tuple(names.split()))
    for name, where, kind, names in _TABLE
)


def check_uses() -> list[str]:
    """Return what the installed vLLM changed of `USES` (empty: every use holds)."""
    changed = []
    for use in USES:
        try:
            found = use.check()
        except (OSError, TypeError, ValueError) as error:  # no source, no signature
            found = f"{use.name}: cannot be checked ({error})"
        if found is not None:
            changed.append(found)
    return changed
