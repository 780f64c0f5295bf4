"""The model fingerprint: the model part of every segment key, computed from content alone.

Two models must never share a fingerprint, and one model must always get the same one, so it is
computed from what decides the KV a model computes (every element of every weight as loaded, the
config's architecture fields without paths or names, the tokenizer, the KV dtype), never from
where the files lie.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

__all__ = ["config_identity", "model_fingerprint", "tokenizer_identity", "weights_digest"]


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 over every element of every weight of ``model``, as loaded in memory.

    The tensors themselves are hashed (each storage once: tied weights are named, not hashed
    twice), so the identity is what the model computes with, wherever its files came from.
    """
    digest = hashlib.sha256()
    seen: dict[tuple[int, int, tuple[int, ...], tuple[int, ...]], str] = {}
    for name, tensor in sorted(model.state_dict().items()):
        tensor = tensor.detach()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)};".encode())
        alias = (tensor.data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.stride())
        if tensor.numel() and alias in seen:
            digest.update(f"={seen[alias]};".encode())
            continue
        seen[alias] = name
        data = tensor.to("cpu").contiguous().reshape(-1)
        digest.update(data.view(torch.uint8).numpy().data if data.numel() else b"")
    return digest.hexdigest()


#: Config fields that name or locate a model, or record the library that saved it: not part of
#: its identity (the same weights in two folders, or saved by two versions, compute the same KV).
_NOT_IDENTITY = frozenset(
    {"_name_or_path", "name_or_path", "_commit_hash", "transformers_version", "torch_dtype",
     "dtype", "_attn_implementation", "_attn_implementation_autoset", "use_cache",
     "output_attentions", "output_hidden_states", "return_dict"}
)  # fmt: skip


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
    digest = hashlib.sha256(b"kvblend-model/2|")
    digest.update(config_identity(getattr(model, "config", None)).encode())
    digest.update(f"|kv={kv_dtype}|".encode())
    digest.update(weights_digest(model).encode())
    digest.update(b"|tokenizer=")
    digest.update(tokenizer_identity(tokenizer).encode())
    return digest.hexdigest()[:32]
