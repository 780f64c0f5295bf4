"""The model fingerprint: the model part of every segment key, computed from content alone.

Two models must never share a fingerprint, and one model must always get the same one, so it is
computed from what decides the KV a model computes (every element of every weight as loaded, the
config's architecture fields without paths or names, the tokenizer, the KV dtype), never from
where the files lie.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import torch

__all__ = [
    "config_identity",
    "digest_weights",
    "fingerprint_of",
    "model_fingerprint",
    "tokenizer_identity",
    "weights_digest",
]


#: One weight as `weights_digest` hashes it: its name, dtype, shape, the key of its storage (tied
#: weights share one: the second is hashed as a reference to the first) and its values.
Weight = tuple[str, torch.dtype, tuple[int, ...], Hashable, Callable[[], torch.Tensor]]


def digest_weights(weights: Iterable[Weight]) -> str:
    """sha256 over ``weights`` in name order: each storage hashed once, by its first name."""
    digest = hashlib.sha256()
    seen: dict[Hashable, str] = {}
    for name, dtype, shape, storage, values in sorted(weights, key=lambda weight: weight[0]):
        digest.update(f"{name}|{dtype}|{shape};".encode())
        numel = math.prod(shape)
        if numel and storage in seen:
            digest.update(f"={seen[storage]};".encode())
            continue
        seen[storage] = name
        data = values().to("cpu").contiguous().reshape(-1)
        digest.update(data.view(torch.uint8).numpy().data if numel else b"")
    return digest.hexdigest()


def _given(tensor: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: tensor


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 over every element of every weight of ``model``, as loaded in memory.

    The tensors themselves are hashed (each storage once: tied weights are named, not hashed
    twice), so the identity is what the model computes with, wherever its files came from.
    """
    weights: list[Weight] = []
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach()
        storage = (tensor.data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.stride())
        weights.append((name, tensor.dtype, tuple(tensor.shape), storage, _given(tensor)))
    return digest_weights(weights)


#: Config fields that name or locate a model, or record the library that saved it: not part of
#: its identity (the same weights in two folders, or saved by two versions, compute the same KV).
_NOT_IDENTITY = frozenset(
    {
        "_name_or_path",
        "name_or_path",
        "_commit_hash",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "_attn_implementation",
        "_attn_implementation_autoset",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
    }
)


def _identity_fields(value: Any) -> Any:
    """Return a config dict without the fields in `_NOT_IDENTITY`, at every nesting level."""
    if isinstance(value, dict):
        return {
            key: _identity_fields(item)
            for key, item in value.items()
            if key not in _NOT_IDENTITY and not str(key).endswith("name_or_path")
        }
    if isinstance(value, list):
        return [_identity_fields(item) for item in value]
    return value


def config_identity(config: Any) -> str:
    """Return the config's architecture fields as canonical JSON: no paths, names, versions."""
    if config is None:
        return "null"
    fields = _identity_fields(config.to_dict())
    return json.dumps(fields, sort_keys=True, default=str, separators=(",", ":"))


def tokenizer_identity(tokenizer: object) -> str:
    """Return the sha256 of what decides a tokenizer's ids.

    That is its whole definition (tokenizer.json of a fast tokenizer, without runtime padding or
    truncation settings; else its vocabulary) and its special tokens.
    """
    digest = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    to_str = getattr(backend, "to_str", None)
    if callable(to_str):
        text = to_str()
        if getattr(backend, "padding", None) or getattr(backend, "truncation", None):
            spec = json.loads(text)  # settings a call left switched on: not the tokenizer's
            spec["padding"] = spec["truncation"] = None
            text = json.dumps(spec)
        digest.update(text.encode())
    else:
        get_vocab = getattr(tokenizer, "get_vocab", None)
        vocab: dict[str, int] = get_vocab() if callable(get_vocab) else {}
        digest.update(str(len(vocab)).encode())
        for token in sorted(vocab):
            digest.update(f"{token}={vocab[token]};".encode())
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        digest.update(f"|{name}={getattr(tokenizer, name, None)}".encode())
    return digest.hexdigest()


def model_fingerprint(model: torch.nn.Module, tokenizer: object, kv_dtype: torch.dtype) -> str:
    """Content fingerprint of a model: weights, config, tokenizer and KV dtype.

    Two models that differ in any weight element, architecture field or tokenizer entry get
    different fingerprints, so they never read each other's stored KV; the same model loaded
    from two folders, two machines or two conversions of one GGUF file gets the same one (no
    path or name is part of it), so they share every entry.
    """
    config = getattr(model, "config", None)
    return fingerprint_of(config, weights_digest(model), tokenizer, kv_dtype)


def fingerprint_of(config: Any, weights: str, tokenizer: object, kv_dtype: torch.dtype) -> str:
    """Return the fingerprint of a ``config``, a weights digest (`digest_weights`), a tokenizer."""
    digest = hashlib.sha256(b"kvblend-model/2|")
    digest.update(config_identity(config).encode())
    digest.update(f"|kv={kv_dtype}|".encode())
    digest.update(weights.encode())
    digest.update(b"|tokenizer=")
    digest.update(tokenizer_identity(tokenizer).encode())
    return digest.hexdigest()[:32]
