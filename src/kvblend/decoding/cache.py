"""The transformers cache that decoding continues from, holding the blended prompt's K/V.

Two kinds, one interface (`DecodeCache`) that the CPU and CUDA paths both run:

- ``static``: transformers' `StaticCache`, allocated once for the prompt plus every token the
  call may decode, and filled with the prompt's rotated K/V through the cache's own `update`
  (the writes a prefill through the model would make: a sliding-window layer keeps its window's
  tail). Each decoded token is then written in place at its row; nothing grows.
- ``dynamic``: a `DynamicCache`, which concatenates every layer's K/V with the new token's at
  every step (a copy of the whole cache per token and layer).

Both decode the same tokens as transformers' own `generate` (greedy, token for token: the
prompt rows are the same, and a static cache's rows not yet written are masked out). The
static cache is the default on every device: on the CPU it decodes as fast as the dynamic one
after short prompts and faster after long ones (`docs/benchmarks.md`, "Decoding"). The
environment variable ``KVBLEND_DECODE_CACHE=dynamic`` switches back to the dynamic cache.

A compiled decode step: with a static cache on CUDA and ``KVBLEND_DECODE_COMPILE=1``,
transformers' `generate` compiles the model's forward (`torch.compile`,
``mode="reduce-overhead"``: CUDA graphs) through its own `CompileConfig`; the cache length is
then rounded up to a multiple of `COMPILE_BUCKET` tokens so a few graphs serve every prompt.
Off by default (the first call of every bucket compiles for seconds); asked for on the CPU, or
with a dynamic cache, it warns and decodes uncompiled.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import CompileConfig, DynamicCache, GenerationConfig, StaticCache
from transformers.cache_utils import Cache

__all__ = ["DecodeCache", "check_environment"]

#: ``static`` (the default) or ``dynamic``.
CACHE_ENV = "KVBLEND_DECODE_CACHE"
#: ``1``: compile the decode step on CUDA (static cache only).
COMPILE_ENV = "KVBLEND_DECODE_COMPILE"
#: A compiled decode step's cache length is a multiple of this (one graph per bucket).
COMPILE_BUCKET = 256
KINDS = ("static", "dynamic")


def _setting(name: str, choices: Sequence[str], default: str) -> str:
    """Return environment variable ``name``, refused with one line unless in ``choices``."""
    value = os.environ.get(name, "").strip().lower() or default
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value


def check_environment() -> None:
    """Refuse a ``KVBLEND_DECODE_CACHE`` or ``KVBLEND_DECODE_COMPILE`` out of its choices."""
    _setting(CACHE_ENV, KINDS, "static")
    _setting(COMPILE_ENV, ("0", "1"), "0")


@dataclass(frozen=True)
class DecodeCache:
    """Which cache one decoding call continues from, and whether its step is compiled.

    ``kind`` is ``static`` or ``dynamic``; ``compiled`` only ever with a static cache on CUDA.
    """

    kind: str = "static"
    compiled: bool = False

    @classmethod
    def choose(cls, device: torch.device) -> DecodeCache:
        """Return the cache for decoding on ``device``, as the environment says.

        ``KVBLEND_DECODE_CACHE`` and ``KVBLEND_DECODE_COMPILE`` are each refused with one line
        when out of their choices.
        """
        kind = _setting(CACHE_ENV, KINDS, "static")
        compiled = _setting(COMPILE_ENV, ("0", "1"), "0") == "1"
        if compiled and (kind != "static" or device.type != "cuda"):
            warnings.warn(
                f"{COMPILE_ENV}=1 compiles decoding only with a static cache on CUDA; "
                f"decoding on {device.type} with a {kind} cache runs uncompiled",
                stacklevel=2,
            )
            compiled = False
        return cls(kind, compiled)

    def length(self, tokens: int) -> int:
        """Return the static cache's length for ``tokens`` rows (a bucket's when compiled)."""
        if not self.compiled:
            return tokens
        return -(-tokens // COMPILE_BUCKET) * COMPILE_BUCKET

    def build(
        self,
        model: Any,
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
        new_tokens: int,
    ) -> Cache:
        """Return a cache of the prompt's K/V (per layer ``[batch, kv_heads, tokens, head_dim]``).

        A static one has room for ``new_tokens`` more rows (the tokens `generate` feeds back)
        and is filled with one copy of the prompt's K/V, as the dynamic one is (its first
        concatenation); nothing is copied per token after that. The blend cannot write its
        keys straight into it: `prefill` does not know how many tokens will be decoded.
        """
        if self.kind == "dynamic":
            data = list(zip(keys, values, strict=True))
            return DynamicCache(ddp_cache_data=data, config=model.config)
        tokens = keys[0].shape[-2]
        cache = StaticCache(config=model.config, max_cache_len=self.length(tokens + new_tokens))
        for layer, (layer_keys, layer_values) in enumerate(zip(keys, values, strict=True)):
            cache.update(layer_keys, layer_values, layer)
        return cache

    def configure(self, config: GenerationConfig) -> None:
        """Set ``config``'s compilation: transformers' `CompileConfig` when compiled, else off.

        transformers compiles on its own whenever it decodes from a static cache on CUDA; kvblend
        compiles only when asked (``KVBLEND_DECODE_COMPILE=1``).
        """
        config.disable_compile = not self.compiled
        if self.compiled:
            config.compile_config = CompileConfig(mode="reduce-overhead")
